"""`segue sim --workload mooncake`: the Mooncake traces at GPU scale.

1. Prefix-cache hit rate against capacity (prefix_cache.py): the device pool alone, then the
   preset's device pool with a host tier behind it, for LRU and Segue's reuse-keyed eviction,
   beside the infinite-cache maximum.
2. Latency at the preset (the real scheduler on the simulated executor): the first
   --latency-requests requests of the trace, arrivals stretched by --time-scale (one A100 serves
   far less than Mooncake's cluster; the README's rule: scale the rate, not the trace), under
   prefix_eviction = lru and reuse.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from segue.sim.prefix_cache import EVICTIONS, max_hit_rate, replay_hit_rate
from segue.sim.workloads.mooncake import TRACE_BLOCK_TOKENS, as_trace_requests, load_mooncake

DEFAULT_CAPACITIES = "128k,512k,1M,2M,4M,8M,16M,32M,64M"


def _tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def add_mooncake_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mooncake (prefix cache at GPU scale; --trace: conversation, synthetic or a path)")
    g.add_argument("--capacities", default=DEFAULT_CAPACITIES,
                   help=f"cache capacities in tokens, k/M suffixes (default: {DEFAULT_CAPACITIES})")
    g.add_argument("--latency-requests", type=int, default=200,
                   help="mooncake: requests of the latency run at the preset (default: 200; 0: skip)")
    g.add_argument("--time-scale", type=float, default=8.0,
                   help="mooncake: stretch the trace's arrival times by this factor in the latency run (default: 8)")


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _size(tokens: int) -> str:
    return f"{tokens / (1 << 20):g}M" if tokens >= 1 << 20 else f"{tokens >> 10}k"


def hit_rate_rows(trace: list[Any], device_blocks: int, capacities: list[int], progress: bool) -> list[dict[str, Any]]:
    rows = []
    for cap in capacities:
        blocks = max(1, cap // TRACE_BLOCK_TOKENS)
        for tier, dev, host in (("device", blocks, 0), ("device + host", device_blocks, blocks - device_blocks)):
            if host < 0 or (tier == "device + host" and host == 0):
                continue
            row: dict[str, Any] = {"capacity_tokens": cap, "tier": tier, "device_blocks": dev, "host_blocks": host}
            for ev in EVICTIONS:
                res = replay_hit_rate(trace, ev, dev, host)
                row[ev] = res.to_dict()
            rows.append(row)
            if progress:
                print(f"done: {tier} {_size(cap)}: lru {_pct(row['lru']['hit_rate'])}, segue "
                      f"{_pct(row['segue']['hit_rate'])}", file=sys.stderr, flush=True)
    return rows


def latency_rows(args: argparse.Namespace, trace: list[Any], make_engine: Callable[[str], Any]) -> list[dict[str, Any]]:
    """`make_engine(prefix_eviction)`: a simulated engine built from args (read at the call)."""
    from segue.sim.replay import replay

    reqs = as_trace_requests(trace)
    t0 = trace[0].timestamp_s
    arrivals = [(r.timestamp_s - t0) * args.time_scale for r in trace]
    args.max_model_len = max(args.max_model_len, max(r.input_length + r.output_length for r in trace) + 1)
    rows = []
    for ev in ("lru", "reuse"):
        engine = make_engine(ev)
        res = replay(engine, reqs, arrivals, engine.clock.advance_to, seed=args.seed,
                     progress=not args.no_progress, desc=f"mooncake latency, {ev}")
        s = engine.scheduler.state
        rows.append({"eviction": ev, **res.to_dict(),
                     "prefix_hit": s.prefix_hit_tokens / max(1, s.prefix_query_tokens)})
    return rows


def render(args: argparse.Namespace, name: str, n: int, kv_tokens: int, best: float,
           rows: list[dict[str, Any]], lat: list[dict[str, Any]]) -> str:
    lines = [f"### segue sim --workload mooncake — {name} trace, {n} requests; device pool of "
             f"{args.preset}: {kv_tokens} tokens", "",
             f"Infinite cache (nothing evicted): **{_pct(best)}** of prompt tokens served from cache.", "",
             "| capacity (tokens) | tier | device / host blocks (512 tokens) | LRU | Segue (reuse keys) | "
             "Segue − LRU | of max (Segue) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lru, seg = r["lru"]["hit_rate"], r["segue"]["hit_rate"]
        lines.append(f"| {_size(r['capacity_tokens'])} | {r['tier']} | {r['device_blocks']} / {r['host_blocks']} | "
                     f"{_pct(lru)} | {_pct(seg)} | {100 * (seg - lru):+.1f} pt | {_pct(seg / max(best, 1e-12))} |")
    if lat:
        lines += ["", f"Latency at {args.preset}: first {lat[0]['num_requests']} requests, arrivals × "
                  f"{args.time_scale:g}:", "",
                  "| eviction | done | prompt tokens from cache | TTFT mean (s) | TTFT p90 (s) | e2e mean (s) | "
                  "preemptions |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in lat:
            s = r.get("summary") or {}
            ttft, e2e = s.get("ttft") or {}, s.get("e2e_latency") or {}
            lines.append(f"| {r['eviction']} | {r['num_finished']}/{r['num_requests']} | {_pct(r['prefix_hit'])} | "
                         f"{ttft.get('mean', float('nan')):.2f} | {ttft.get('p90', float('nan')):.2f} | "
                         f"{e2e.get('mean', float('nan')):.2f} | {r['preemptions']} |")
    return "\n".join(lines)


def plot_hit_rates(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for tier, style in (("device", "-"), ("device + host", "--")):
        rows = [r for r in result["hit_rates"] if r["tier"] == tier]
        xs = [r["capacity_tokens"] / (1 << 20) for r in rows]
        for ev, label in (("lru", "LRU"), ("segue", "Segue")):
            ax.plot(xs, [100 * r[ev]["hit_rate"] for r in rows], style, marker="o", ms=3, label=f"{label}, {tier}")
    ax.axhline(100 * result["max_hit_rate"], color="grey", lw=0.8, label="infinite cache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache capacity (M tokens; device + host: the preset's device pool + host)")
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_title(f"Mooncake {result['trace']} trace: prefix-cache hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_mooncake(args: argparse.Namespace, make_engine: Callable[[str], Any]) -> tuple[dict[str, Any], str]:
    from segue.sched.cost_model import load_preset
    from segue.sim.engine import default_kv_cache_tokens

    name = args.trace or "conversation"
    trace = load_mooncake(name, limit=args.num_requests)
    cost = load_preset(args.preset, args.step_time_scale)
    kv_tokens = args.kv_cache_tokens or default_kv_cache_tokens(args.preset, cost.kv_bytes_per_token,
                                                                args.block_size, args.gpu_memory_gib)
    if kv_tokens is None:
        raise SystemExit("--kv-cache-tokens is required with a profile JSON")
    capacities = [_tokens(c) for c in args.capacities.split(",") if c.strip()]
    best = max_hit_rate(trace).hit_rate
    rows = hit_rate_rows(trace, max(1, kv_tokens // TRACE_BLOCK_TOKENS), capacities, not args.no_progress)
    lat = latency_rows(args, trace[:args.latency_requests], make_engine) if args.latency_requests > 0 else []
    result = {"trace": name, "num_requests": len(trace), "kv_cache_tokens": kv_tokens, "max_hit_rate": best,
              "hit_rates": rows, "latency": lat}
    if args.plot:
        plot_hit_rates(result, args.plot)
    return result, render(args, name, len(trace), kv_tokens, best, rows, lat)

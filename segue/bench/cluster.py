"""`segue bench cluster`: mixed chat + map-reduce on 1 engine and on N engines, affinity vs round robin.

The workload (closed loop, everything starts at once): chat sessions whose every turn re-sends the
growing history (program_id = the session), and map-reduce documents whose map calls share the
document as a long prefix (task_group = the document) followed by one reduce call. Each setup gets
fresh random prompt ids (a seed per setup), so no setup is served from a cache another one warmed.
Reported per setup: prefix-cache hit rate (cached / prompt tokens over all calls), chat turn
latency, map-reduce completion time, makespan, and where the router placed calls.

N engines run as Ray actors on this machine: on fewer cores than engines they compete for the same
cores, which the numbers then show. Heavy imports stay inside functions (see segue/bench).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from segue.bench import Benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--engines", type=int, default=2, help="replicas for the multi-engine setups (default: 2)")
    g.add_argument("--chat-sessions", type=int, default=4, help="concurrent multi-turn chats (default: 4)")
    g.add_argument("--chat-turns", type=int, default=3, help="turns per chat (default: 3)")
    g.add_argument("--system-len", type=int, default=160, help="chat system prompt tokens (default: 160)")
    g.add_argument("--user-len", type=int, default=24, help="tokens per user message (default: 24)")
    g.add_argument("--documents", type=int, default=2, help="map-reduce documents (default: 2)")
    g.add_argument("--maps", type=int, default=4, help="map calls per document (default: 4)")
    g.add_argument("--document-len", type=int, default=320, help="document tokens, the shared prefix (default: 320)")
    g.add_argument("--output-len", type=int, default=16, help="tokens per chat turn and map call (default: 16)")
    g.add_argument("--setups", default="single,round_robin,affinity",
                   help="comma list of single, round_robin, affinity (default: all three)")
    g.add_argument("--ray-cpus", type=int, default=None, help="CPUs given to Ray (default: all)")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, one seed per setup from it (default: 0)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")


@dataclass
class MeasuredCall:
    kind: str  # "chat", "map" or "reduce"
    latency_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: int | None


@dataclass
class SetupResult:
    setup: str
    engines: int
    makespan_s: float
    calls: list[MeasuredCall] = field(default_factory=list)
    programs_s: dict[str, list[float]] = field(default_factory=dict)
    placements: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        prompt = sum(c.prompt_tokens for c in self.calls)
        cached = sum(c.cached_tokens for c in self.calls)
        chat = [c.latency_s for c in self.calls if c.kind == "chat"]
        chat_ttft = [c.ttft_s for c in self.calls if c.kind == "chat"]
        return {"setup": self.setup, "engines": self.engines, "makespan_s": self.makespan_s,
                "prefix_hit_rate": cached / prompt if prompt else 0.0, "prompt_tokens": prompt,
                "cached_tokens": cached, "chat_turn_p50_s": _pct(chat, 50), "chat_turn_p90_s": _pct(chat, 90),
                "chat_ttft_p50_s": _pct(chat_ttft, 50),
                "mapreduce_mean_s": statistics.fmean(self.programs_s.get("mapreduce", [0.0])),
                "placements": self.placements}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Workload:
    def __init__(self, args: argparse.Namespace, vocab_size: int, seed: int) -> None:
        import random

        self.args = args
        self.rng = random.Random(seed)
        self.lo, self.hi = (1000, vocab_size - 1000) if vocab_size > 4000 else (0, vocab_size - 1)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randint(self.lo, self.hi) for _ in range(n)]


async def _call(engine: Any, kind: str, prompt: list[int], max_tokens: int, rid: str, result: SetupResult,
                program_id: str, task_group: str | None = None) -> list[int]:
    from segue.engine.engine_request import EngineRequest, RequestHints
    from segue.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # One engine ignores the task group (nothing to place); a pool's router reads it.
    request = EngineRequest(prompt, params, rid, hints=RequestHints(program_id=program_id, task_group=task_group))
    start, first, replica, last = time.monotonic(), None, None, None
    async for out in engine.generate(request):
        last = out
        if first is None:
            first = time.monotonic()
            replica = engine.owner_of(rid) if hasattr(engine, "owner_of") else 0
    end = time.monotonic()
    assert last is not None  # a request always ends with an output
    result.calls.append(MeasuredCall(kind, end - start, (first or end) - start, len(prompt), last.num_cached_tokens,
                                     replica))
    return list(last.outputs[0].token_ids)


async def _chat(engine: Any, w: Workload, session: int, result: SetupResult) -> None:
    history = w.ids(w.args.system_len)
    for turn in range(w.args.chat_turns):
        history = history + w.ids(w.args.user_len)
        out = await _call(engine, "chat", history, w.args.output_len, f"chat{session}-{turn}", result,
                          program_id=f"chat{session}")
        history = history + out


async def _mapreduce(engine: Any, w: Workload, doc: int, result: SetupResult) -> None:
    start = time.monotonic()
    document = w.ids(w.args.document_len)
    maps = await asyncio.gather(*(
        _call(engine, "map", document + w.ids(8), w.args.output_len, f"doc{doc}-map{i}", result,
              program_id=f"doc{doc}", task_group=f"doc{doc}-maps") for i in range(w.args.maps)))
    summary = [t for out in maps for t in out]
    await _call(engine, "reduce", document + summary, 2 * w.args.output_len, f"doc{doc}-reduce", result,
                program_id=f"doc{doc}")
    result.programs_s.setdefault("mapreduce", []).append(time.monotonic() - start)


async def _run_setup(engine: Any, name: str, engines: int, args: argparse.Namespace, vocab: int,
                     seed: int) -> SetupResult:
    w = Workload(args, vocab, seed)
    result = SetupResult(name, engines, 0.0)
    before = dict(engine.router.placements) if hasattr(engine, "router") else {}
    start = time.monotonic()
    await asyncio.gather(*(_chat(engine, w, s, result) for s in range(args.chat_sessions)),
                         *(_mapreduce(engine, w, d, result) for d in range(args.documents)))
    result.makespan_s = time.monotonic() - start
    if hasattr(engine, "router"):
        result.placements = {k.value: v - before.get(k, 0) for k, v in engine.router.placements.items()
                             if v - before.get(k, 0)}
    return result


async def _warm_up(engine: Any, vocab: int, copies: int) -> None:
    """One-off costs (kernel build, allocator growth) stay out of the runs: one short call per engine."""
    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams

    lo = 1000 if vocab > 4000 else 0
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    await asyncio.gather(*(_drain(engine.generate(EngineRequest([lo + i] * 20, params, f"warm{i}")))
                           for i in range(copies)))


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


def render_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | engines | prefix hit rate | chat turn p50 (s) | chat turn p90 (s) | chat TTFT p50 (s) "
             "| map-reduce mean (s) | makespan (s) | placements |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        placed = ", ".join(f"{k} {v}" for k, v in sorted(r["placements"].items())) or "-"
        lines.append(f"| {r['setup']} | {r['engines']} | {r['prefix_hit_rate']:.1%} | {r['chat_turn_p50_s']:.2f} "
                     f"| {r['chat_turn_p90_s']:.2f} | {r['chat_ttft_p50_s']:.2f} | {r['mapreduce_mean_s']:.2f} "
                     f"| {r['makespan_s']:.2f} | {placed} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from segue.cluster import build_engine, make_router
    from segue.engine.args import engine_config_from_args

    config = engine_config_from_args(args)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = set(setups) - {"single", "round_robin", "affinity"}
    if unknown:
        raise SystemExit(f"unknown setup(s) {sorted(unknown)}")
    rows: list[dict[str, Any]] = []
    results: list[SetupResult] = []

    async def measure(engine: Any, names: list[str], engines: int) -> None:
        vocab = engine.model_info().vocab_size
        await _warm_up(engine, vocab, engines)
        for name in names:
            if hasattr(engine, "router"):
                engine.router = make_router(name, engines, **({"block_size": config.cache.block_size}
                                                              if name == "affinity" else {}))
            result = await _run_setup(engine, name, engines, args, vocab, seed=args.seed * 100 + len(results))
            results.append(result)
            rows.append(result.summary())
            print(render_markdown(rows[-1:]).splitlines()[-1], file=sys.stderr)
        await engine.shutdown()

    if "single" in setups:
        asyncio.run(measure(build_engine(config, 1), ["single"], 1))
    multi = [s for s in setups if s != "single"]
    if multi:
        pool = build_engine(config, args.engines, router=multi[0], num_cpus=args.ray_cpus)
        asyncio.run(measure(pool, multi, args.engines))
    print(render_markdown(rows))
    print(f"\ncommand: segue {shlex.join(sys.argv[1:])}; {os.cpu_count()} CPUs")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": rows, "calls": {r.setup: [asdict(c) for c in r.calls] for r in results},
                       "argv": sys.argv}, f, indent=2)
    return 0


BENCHMARK = Benchmark("cluster", "mixed chat + map-reduce on 1 vs N engines, affinity vs round-robin routing",
                      add_arguments, run, description=__doc__)

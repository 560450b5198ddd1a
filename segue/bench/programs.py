"""`segue bench programs`: Parrot-style programs against request-centric clients (paper 003 §8.2-8.4).

Workloads over one long public-domain text (by default the API documentation in liblzma's headers,
/usr/include/lzma/*.h, which their author put in the public domain), cut into chunks by tokens:

- chain summary: each step summarizes the next chunk together with the summary so far;
- map-reduce summary: one call per chunk, then one call that combines their summaries;
- coder/reviewer: two agents take turns for --rounds rounds over one shared context (the first
  --shared-prefix-tokens of the document), each reading the other's last output;
- shared prefix: many questions over the same document prefix, prefix caching on vs off.

Program runs use segue.program.client over the /v1/programs API; the baseline makes each call
itself through /v1/completions (program_workloads.py). Every run gets a fresh engine (same weights
and settings) and server, so no run reads KV that an earlier one cached.
"""
from __future__ import annotations

import argparse
import copy
import json
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable

from segue.bench import Benchmark
from segue.bench.program_workloads import (
    DEFAULT_DOCUMENT,
    chain_baseline,
    chain_program,
    coder_reviewer_baseline,
    coder_reviewer_program,
    load_document,
    map_reduce_baseline,
    map_reduce_program,
    shared_prefix_run,
)

PARTS = ("chain", "map-reduce", "coder-reviewer", "shared-prefix")
# (server url, output tokens, delay per round trip) -> wall seconds
Workload = Callable[[str, int, float], float]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--document", default=DEFAULT_DOCUMENT, help="text file(s) (glob) to summarize")
    g.add_argument("--chunks", type=int, default=8, help="chunks per document (default: 8)")
    g.add_argument("--chunk-tokens", type=int, default=128, help="tokens per chunk (default: 128)")
    g.add_argument("--output-tokens", default="8,32", help="generated tokens per call, comma separated "
                   "values to sweep (default: 8,32; EOS ignored so lengths are exact)")
    g.add_argument("--delay-ms", type=float, default=250.0, help="emulated network delay per round trip")
    g.add_argument("--repeats", type=int, default=3,
                   help="runs of each configuration; medians are reported (default: 3)")
    g.add_argument("--shared-calls", type=int, default=12, help="calls in the shared-prefix run (default: 12)")
    g.add_argument("--shared-prefix-tokens", type=int, default=768,
                   help="shared document tokens, in the shared-prefix and coder-reviewer parts (default: 768)")
    g.add_argument("--rounds", type=int, default=3, help="coder/reviewer rounds, two calls each (default: 3)")
    g.add_argument("--skip", default="", help=f"comma separated parts to skip: {', '.join(PARTS)}")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")


class ForwardTimer:
    """Adds up the time the executor spends in forward passes. The machine is shared, so the same
    work takes from 1x to 3x as long from run to run; what is left after the forward passes is what
    the client-server design changes."""

    def __init__(self, executor: Any) -> None:
        self.seconds = 0.0
        self._execute = executor.execute
        executor.execute = self._timed

    def _timed(self, batch: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._execute(batch)
        finally:
            self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = 0.0


class LiveServer:
    """A fresh engine over the loaded weights, served by uvicorn on a thread."""

    def __init__(self, make_engine: Callable[[], Any], share_prefix: bool = True) -> None:
        import uvicorn

        from segue.engine.async_engine import AsyncLLMEngine
        from segue.program.executor import ProgramExecutor
        from segue.server.app import create_app

        self.engine = AsyncLLMEngine(make_engine())
        app = create_app(self.engine)
        llm = self.engine.engine
        app.state.programs = ProgramExecutor(self.engine, llm.encode, llm.max_model_len, share_prefix=share_prefix)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio

        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        asyncio.run(self.engine.shutdown())


def run(args: argparse.Namespace) -> int:
    from segue.engine.args import engine_config_from_args
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.loading import load_model

    skip = set(filter(None, args.skip.split(",")))
    if skip - set(PARTS):
        raise SystemExit(f"--skip: unknown parts {sorted(skip - set(PARTS))}; the parts are {', '.join(PARTS)}")
    base = engine_config_from_args(args)
    executor, tokenizer, model_config, model_name, chat_template = load_model(base)
    forward = ForwardTimer(executor)

    def factory(prefix_caching: bool = True) -> Callable[[], Any]:
        config = copy.deepcopy(base)
        config.cache.enable_prefix_caching = prefix_caching
        return lambda: LLMEngine(config, executor=executor, tokenizer=tokenizer, model_config=model_config,
                                 model_name=model_name, chat_template=chat_template)

    text = load_document(args.document)
    ids = tokenizer.encode(text, add_special_tokens=False)
    need = args.chunks * args.chunk_tokens
    if len(ids) < max(need, args.shared_prefix_tokens):
        raise SystemExit(f"the document has {len(ids)} tokens; the workload needs {need}")
    chunks = [tokenizer.decode(ids[i * args.chunk_tokens:(i + 1) * args.chunk_tokens]) for i in range(args.chunks)]
    delay = args.delay_ms / 1000
    results: dict[str, Any] = {"model": model_name, "document": args.document, "document_tokens": len(ids),
                               "chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "delay_ms": args.delay_ms,
                               "rounds": args.rounds, "shared_prefix_tokens": args.shared_prefix_tokens, "runs": []}
    with LiveServer(factory()) as s:  # warm-up: the first forward passes are slow
        chain_baseline(s.url, chunks[:2], 4, 0.0)
    task = "Task: write C code that uses the library documented below.\n\n" + tokenizer.decode(
        ids[:args.shared_prefix_tokens])
    workloads: list[tuple[str, Workload, Workload]] = [
        ("chain", _bind(chain_program, chunks), _bind(chain_baseline, chunks)),
        ("map-reduce", _bind(map_reduce_program, chunks), _bind(map_reduce_baseline, chunks)),
        ("coder-reviewer", _bind(coder_reviewer_program, task, args.rounds),
         _bind(coder_reviewer_baseline, task, args.rounds))]
    for name, program_fn, baseline_fn in workloads:
        if name in skip:
            continue
        for n in [int(x) for x in args.output_tokens.split(",")]:
            times: dict[str, list[float]] = {"program": [], "baseline": []}
            forward_s: dict[str, list[float]] = {"program": [], "baseline": []}
            for _ in range(args.repeats):
                for kind, fn in (("baseline", baseline_fn), ("program", program_fn)):
                    with LiveServer(factory()) as s:
                        forward.reset()
                        times[kind].append(fn(s.url, n, delay))
                        forward_s[kind].append(forward.seconds)
            med = {k: statistics.median(v) for k, v in times.items()}
            # Wall time minus the model's forward passes: network, queueing, HTTP, scheduling.
            rest = {k: statistics.median(w - f for w, f in zip(times[k], forward_s[k], strict=True)) for k in times}
            both = statistics.median(forward_s["program"] + forward_s["baseline"])
            row = {"workload": name, "output_tokens": n, "calls": _calls(name, args),
                   **{f"{k}_s": v for k, v in times.items()},
                   **{f"{k}_forward_s": v for k, v in forward_s.items()},
                   # Medians: the machine is shared and single runs swing by tens of percent.
                   "speedup": med["baseline"] / med["program"],
                   "baseline_rest_s": rest["baseline"], "program_rest_s": rest["program"],
                   # Derived, not measured end to end: both sides with the same (median) forward time.
                   "speedup_same_forward": (rest["baseline"] + both) / (rest["program"] + both)}
            results["runs"].append(row)
            print(json.dumps(row), file=sys.stderr)
    if "shared-prefix" not in skip:
        doc = tokenizer.decode(ids[:args.shared_prefix_tokens])
        n = int(args.output_tokens.split(",")[0])
        configs = [("caching on, prefix gate on", True, True), ("caching on, scheduler only", True, False),
                   ("caching off", False, False)]
        for label, caching, gate in configs:
            secs = []
            for _ in range(args.repeats):
                with LiveServer(factory(caching), share_prefix=gate) as s:
                    secs.append(shared_prefix_run(s.url, doc, args.shared_calls, n))
            row = {"workload": "shared-prefix", "config": label, "calls": args.shared_calls, "output_tokens": n,
                   "seconds": secs, "calls_per_s": args.shared_calls / statistics.median(secs)}
            results["runs"].append(row)
            print(json.dumps(row), file=sys.stderr)
    print(render(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _bind(fn: Callable[..., float], *data: Any) -> Workload:
    """The workload with its data filled in, called as fn(url, *data, n, delay)."""
    return lambda url, n, delay: fn(url, *data, n, delay)


def _calls(name: str, args: argparse.Namespace) -> int:
    """LLM calls in one run of the workload (its round trips in the baseline, concurrent map calls aside)."""
    return {"chain": args.chunks, "map-reduce": args.chunks + 1, "coder-reviewer": 2 * args.rounds}[name]


def render(results: dict[str, Any]) -> str:
    lines = [f"segue bench programs — {results['model']}, {results['chunks']} chunks x {results['chunk_tokens']} "
             f"tokens of {results['document']}, {results['delay_ms']:g} ms per round trip"
             + (f"; coder-reviewer: {results['rounds']} rounds over its first {results['shared_prefix_tokens']} tokens"
                if any(r["workload"] == "coder-reviewer" for r in results["runs"]) else ""), "",
             "| workload | calls | output tokens | baseline s (runs) | program s (runs) | speedup (medians) "
             "| not forward s, baseline / program | speedup at equal forward time (derived) |",
             "|---|---:|---:|---|---|---:|---|---:|"]
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    for r in results["runs"]:
        if r["workload"] != "shared-prefix":
            lines.append(f"| {r['workload']} | {r.get('calls', '-')} | {r['output_tokens']} | {fmt(r['baseline_s'])} "
                         f"| {fmt(r['program_s'])} | **{r['speedup']:.2f}x** "
                         f"| {r['baseline_rest_s']:.2f} / {r['program_rest_s']:.2f} "
                         f"| {r['speedup_same_forward']:.2f}x |")
    shared = [r for r in results["runs"] if r["workload"] == "shared-prefix"]
    if shared:
        off = next((r["calls_per_s"] for r in shared if r["config"] == "caching off"), None)
        lines += ["", "| shared prefix | seconds (runs) | calls/s (median) | vs caching off |", "|---|---|---:|---:|"]
        for r in shared:
            ratio = f"{r['calls_per_s'] / off:.2f}x" if off else "-"
            lines.append(f"| {r['config']} | {fmt(r['seconds'])} | {r['calls_per_s']:.2f} | {ratio} |")
    return "\n".join(lines)


BENCHMARK = Benchmark(
    name="programs",
    help="Parrot-style programs vs request-centric clients: chain and map-reduce summaries, a coder/reviewer "
         "loop, shared prefixes",
    add_arguments=add_arguments,
    run=run,
    description=__doc__,
)

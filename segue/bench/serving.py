"""`segue bench serving --url URL`: the four serving rows of BENCHMARKS.md against any
OpenAI-compatible server (Segue, vLLM, ...), over HTTP, with random token-id prompts the way
vLLM's `bench serve --dataset-name random` makes them:

- load: 64 requests of 256 prompt / 128 output tokens at once (output tok/s);
- single: 4 such requests one at a time (output tok/s);
- prefill: 16 requests of 2,048 prompt tokens and 1 output token at once (input tok/s);
- next: 32 requests sharing a 3,000-token prefix plus 400 tokens of their own, 16 output tokens,
  after two requests have put the prefix in the server's cache (input tok/s): the shape of every
  agent turn after the first, a long history re-sent on top of a cached prefix.

The headline comparisons in BENCHMARKS.md use vLLM's own client (the peer's tool, not ours); this
is the same workload for anyone without vLLM installed, and its numbers are comparable between
servers measured with it in one session. `--peer-url` measures a second server (vLLM, llama.cpp's
llama-server: /work/shared/peers/ says how to build and run them) row by row beside the first,
one server at a time, and prints the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace

from segue.bench import Benchmark

ROWS = ("load", "single", "prefill", "next")


@dataclass(frozen=True)
class RowShape:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int | None = None  # None: all at once
    prefix_len: int = 0


SHAPES = {"load": RowShape(64, 256, 128), "single": RowShape(4, 256, 128, concurrency=1),
          "prefill": RowShape(16, 2048, 1), "next": RowShape(32, 400, 16, prefix_len=3000)}


@dataclass
class RowResult:
    row: str
    duration_s: float
    input_tokens: int
    output_tokens: int
    mean_ttft_ms: float
    errors: int

    @property
    def input_tok_s(self) -> float:
        return self.input_tokens / self.duration_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows to run ({', '.join(ROWS)})")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts (default: 0)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the results here as JSON")
    p.add_argument("--peer-url", default=None, help="a second server measured beside the first, row by row "
                                                     "(e.g. llama-server's http://127.0.0.1:8090/v1); ratios printed")
    p.add_argument("--peer-model", default=None, help="model name to send the peer (default: its first)")
    p.add_argument("--num-prompts", type=int, default=None, help="override every row's request count")
    p.add_argument("--output-len", type=int, default=None, help="override every row's output tokens (prefill keeps 1)")


def random_ids(rng, n: int, vocab: int) -> list[int]:
    # Away from the special and byte tokens at both ends of the vocabulary, as throughput's prompts.
    lo, hi = (1000, vocab - 1000) if vocab > 4000 else (0, vocab)
    return [rng.randrange(lo, hi) for _ in range(n)]


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT in seconds, output tokens) of one streamed completion. A connection the server closed
    before answering (llama-server drops idle keep-alive connections) is retried once on a new one:
    the request never reached it, and counting it as failed would wrong the server."""
    import httpx

    try:
        return await _stream_one(client, url, model, prompt, max_tokens)
    except httpx.RemoteProtocolError as e:
        if "without sending a response" not in str(e):
            raise
        return await _stream_one(client, url, model, prompt, max_tokens)


async def _stream_one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    t0, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                # A failure after the 200 status line: the request was not served either.
                raise ValueError(f"error in stream: {chunk['error']}")
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


async def run_row(url: str, model: str, row: str, vocab: int, seed: int,
                  shape: RowShape | None = None) -> RowResult:
    """One row; `shape` overrides the row's standard shape (tests on a small model)."""
    import random

    import httpx

    shape, rng = shape or SHAPES[row], random.Random(seed)
    prefix = random_ids(rng, shape.prefix_len, vocab)
    prompts = [prefix + random_ids(rng, shape.input_len, vocab) for _ in range(shape.num_prompts)]
    limit = asyncio.Semaphore(shape.concurrency or shape.num_prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        if shape.prefix_len:  # the prefix is in the server's cache before the measured requests
            for _ in range(2):
                await _one(client, url, model, prefix + random_ids(rng, shape.input_len, vocab), shape.output_len)

        async def bounded(prompt: list[int]) -> tuple[float, int] | BaseException:
            async with limit:
                try:
                    return await _one(client, url, model, prompt, shape.output_len)
                except (httpx.HTTPError, ValueError) as e:
                    return e

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - t0
    served = [(p, r) for p, r in zip(prompts, results, strict=True) if not isinstance(r, BaseException)]
    ok = [r for _, r in served]
    # Input throughput counts the prompts that were answered: a failed request's may never have
    # been prefilled, and counting it would flatter a server that fails fast.
    return RowResult(row, duration, sum(len(p) for p, _ in served), sum(n for _, n in ok),
                     1000 * sum(t for t, _ in ok) / max(1, len(ok)), len(results) - len(ok))


def run(args: argparse.Namespace) -> int:
    import httpx

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    servers = [("segue", args.url.rstrip("/"), args.served_model)]
    if args.peer_url:
        servers.append(("peer", args.peer_url.rstrip("/"), args.peer_model))
    named = [(name, url, model or httpx.get(url + "/models", timeout=30).json()["data"][0]["id"])
             for name, url, model in servers]
    results: list[tuple[str, RowResult]] = []
    for row in rows:
        shape = _shape(row, args)
        for name, url, model in named:  # one server at a time: each row's servers in the same minutes
            results.append((name, asyncio.run(run_row(url, model, row, args.vocab_size, args.seed, shape))))
    print("| server | row | requests x in/out | duration (s) | input tok/s | output tok/s | mean TTFT (ms) | errors |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, r in results:
        sh = _shape(r.row, args)
        print(f"| {name} | {r.row} | {sh.num_prompts} x {sh.prefix_len + sh.input_len}/{sh.output_len} | "
              f"{r.duration_s:.2f} | {r.input_tok_s:.0f} | {r.output_tok_s:.1f} | {r.mean_ttft_ms:.0f} | {r.errors} |")
    if args.peer_url:
        print("\n| row | Segue / peer (the row's rate: output tok/s, input tok/s for prefill and next) |\n|---|---:|")
        for (_, ours), (_, theirs) in zip(results[::2], results[1::2], strict=True):
            rate = (lambda r: r.input_tok_s) if ours.row in ("prefill", "next") else (lambda r: r.output_tok_s)
            print(f"| {ours.row} | {rate(ours) / max(rate(theirs), 1e-9):.2f}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([{"server": name, **asdict(r), "input_tok_s": r.input_tok_s, "output_tok_s": r.output_tok_s}
                       for name, r in results], f, indent=1)
    return 1 if any(r.errors for _, r in results) else 0


def _shape(row: str, args: argparse.Namespace) -> RowShape:
    shape = SHAPES[row]
    if args.num_prompts is not None:
        shape = replace(shape, num_prompts=args.num_prompts)
    if args.output_len is not None and row != "prefill":
        shape = replace(shape, output_len=args.output_len)
    return shape


BENCHMARK = Benchmark("serving", "load, single-stream, long-prefill and next-turn rows against any OpenAI URL",
                      add_arguments, run, description=__doc__)

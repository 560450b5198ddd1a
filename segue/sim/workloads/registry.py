"""Workloads by name, with the flags that choose them: one seeded draw of requests and arrivals that
every configuration of a comparison replays unchanged.

  infercept            the InferCept trace, requests drawn with replacement (the reference)
  infercept-synthetic  new requests from the trace's per-kind distributions (workloads/synthetic.py)
  chat                 long-tailed multi-turn chat (workloads/chat.py)
  throughput           fixed prompt and output lengths, no pauses
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from segue.sim.arrivals import ArrivalProcess
from segue.sim.workloads.trace_request import TraceRequest

WORKLOAD_NAMES: tuple[str, ...] = ("infercept", "infercept-synthetic", "chat", "throughput")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "infercept"
    num_requests: int = 32
    kinds: tuple[str, ...] | None = None
    trace: str | None = None
    prompt_len: int = 256
    output_len: int = 128
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else None
        return cls(args.workload, args.num_requests, kinds, args.trace, args.prompt_len, args.output_len,
                   args.arrival, args.cv, args.seed)

    def describe(self) -> str:
        what = {"throughput": f"throughput mix ({self.prompt_len} prompt + {self.output_len} output tokens)"}
        text = what.get(self.name, self.name + (f" ({', '.join(self.kinds)})" if self.kinds else ""))
        arrivals = "poisson" if self.arrival == "poisson" else f"gamma CV {self.cv:g}"
        return f"{text}, {self.num_requests} requests, {arrivals} arrivals, seed {self.seed}"


def add_workload_args(p: argparse.ArgumentParser, num_requests: int = 32, workload: str = "infercept") -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOAD_NAMES, default=workload,
                   help=f"which requests to send (default: {workload})")
    g.add_argument("--num-requests", type=int, default=num_requests,
                   help=f"requests per run (default: {num_requests})")
    g.add_argument("--rates", type=_floats, default=[1.0], help="comma list of arrival rates in req/s (default: 1)")
    g.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson",
                   help="inter-arrival distribution (default: poisson)")
    g.add_argument("--cv", type=float, default=1.0, help="gamma arrivals' coefficient of variation (default: 1)")
    g.add_argument("--kinds", default=None,
                   help="infercept workloads: only these kinds (comma list of math, qa, ve, chatbot, tts, image)")
    g.add_argument("--trace", default=None, help="InferCept trace JSON, plain or .gz (default: the packaged "
                   "merged_exp_uniform.json, or DIR/infercept/ when SEGUE_WORKLOADS=DIR)")
    g.add_argument("--prompt-len", type=int, default=256, help="throughput mix: prompt tokens (default: 256)")
    g.add_argument("--output-len", type=int, default=128, help="throughput mix: output tokens (default: 128)")
    g.add_argument("--seed", type=int, default=0, help="seeds requests, arrivals and token ids (default: 0)")


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def make_requests(spec: WorkloadSpec, max_model_len: int) -> tuple[list[TraceRequest], int]:
    """The workload's requests (the same for every rate and configuration) and how many trace
    requests were left out for not fitting `max_model_len`."""
    rng = np.random.default_rng([spec.seed, 1])
    if spec.name == "throughput":
        from segue.sim.workloads.chat import ThroughputMix

        if spec.prompt_len + spec.output_len >= max_model_len:
            raise ValueError(f"prompt + output ({spec.prompt_len + spec.output_len}) must fit the context "
                             f"({max_model_len})")
        return ThroughputMix(spec.prompt_len, spec.output_len).sample(spec.num_requests), 0
    if spec.name == "chat":
        from segue.sim.workloads.chat import ChatMix

        return ChatMix(max_context=max_model_len - 1).sample(spec.num_requests, rng), 0
    if spec.name not in ("infercept", "infercept-synthetic"):
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    from segue.sim.workloads.infercept import fit_to_context, load_infercept

    trace = load_infercept(spec.trace)
    if spec.kinds:
        trace = [r for r in trace if r.kind in spec.kinds]
    kept, dropped = fit_to_context(trace, max_model_len)
    if not kept:
        raise ValueError("no trace request fits the context window")
    if spec.name == "infercept":
        picks = rng.integers(0, len(kept), size=spec.num_requests)
        return [kept[int(i)] for i in picks], dropped
    from segue.sim.workloads.synthetic import SyntheticInfercept

    synth = SyntheticInfercept(kept)
    out: list[TraceRequest] = []
    # Independent resampling can exceed the context; such draws are redrawn, not truncated.
    while len(out) < spec.num_requests:
        out += [r for r in synth.sample(spec.num_requests - len(out), rng) if r.total_tokens < max_model_len]
    for i, r in enumerate(out):
        r.key = f"syn{i}-{r.kind}"
    return out, dropped


def arrivals_for(spec: WorkloadSpec, rate: float) -> list[float]:
    # One seed for every rate: numpy scales the same standard draws by 1/rate, so the rates of a
    # sweep see the same burst pattern, only compressed (common random numbers).
    process = ArrivalProcess(rate, spec.arrival, spec.cv)  # type: ignore[arg-type]
    return process.times(spec.num_requests, np.random.default_rng([spec.seed, 2]))

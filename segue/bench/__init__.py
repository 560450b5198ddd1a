"""`segue bench <name>`: a registry of benchmarks, one subcommand each.

A benchmark module exposes `BENCHMARK = Benchmark(...)` and is listed in `BUILTIN_MODULES`; code outside
the package can add its own with `register`. Modules are imported when the parser is built, so they must
keep heavy imports (torch, transformers) inside their functions: `segue --help` should stay fast.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass

BUILTIN_MODULES: tuple[str, ...] = ("segue.bench.throughput", "segue.bench.step_profile", "segue.bench.intercept",
                                    "segue.bench.compare", "segue.bench.fidelity", "segue.bench.programs",
                                    "segue.bench.cluster", "segue.bench.structured", "segue.bench.agents",
                                    "segue.bench.kernels", "segue.bench.serving", "segue.bench.bench_model")


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    # Adds the benchmark's own flags; the engine flags are added by add_bench_subparsers.
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


_registry: dict[str, Benchmark] = {}
_builtins_loaded = False


def register(benchmark: Benchmark) -> Benchmark:
    existing = _registry.get(benchmark.name)
    if existing is not None and existing is not benchmark:
        raise ValueError(f"a benchmark named {benchmark.name!r} is already registered")
    _registry[benchmark.name] = benchmark
    return benchmark


def benchmarks() -> dict[str, Benchmark]:
    """All registered benchmarks by name, built-ins first."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            register(importlib.import_module(module).BENCHMARK)
    return dict(_registry)


def add_bench_subparsers(bench_parser: argparse.ArgumentParser,
                         add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    sub = bench_parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for bench in benchmarks().values():
        p = sub.add_parser(bench.name, help=bench.help, description=bench.description or bench.help)
        bench.add_arguments(p)
        add_engine_args(p)


def run_bench(args: argparse.Namespace) -> int:
    name = getattr(args, "benchmark", None)
    bench = benchmarks().get(name) if name else None
    if bench is None:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(benchmarks())}")
    return bench.run(args)

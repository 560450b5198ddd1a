"""What a comparison runs a workload on: named configurations of the simulator, the in-process
engine, or an OpenAI-compatible URL, parsed from `--config NAME=KEY:VALUE,...`.

Keys: `target` (sim | engine; default --target), `url` (implies the url target), `policy`,
`interception`, `model` (the URL's served model), `opt.NAME` (a scheduling policy option). For
example `fcfs=policy:fcfs`, `lamps=policy:lamps,interception:min-waste`,
`vllm=url:http://127.0.0.1:8765/v1`.
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from segue.sim.workloads.trace_request import TraceRequest

TARGETS = ("sim", "engine", "url")


@dataclass
class RunConfig:
    name: str
    target: str = "sim"
    url: str | None = None
    model: str | None = None
    policy: str | None = None
    interception: str | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        if self.target == "url":
            return f"url {self.url}"
        parts = [self.target, self.policy or "", self.interception or ""]
        return " / ".join(p for p in parts if p)


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_config(text: str, default_target: str = "sim") -> RunConfig:
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--config wants NAME=KEY:VALUE,... (got {text!r})")
    cfg = RunConfig(name.strip(), default_target)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, colon, value = item.partition(":")
        if not colon:
            raise argparse.ArgumentTypeError(f"config {cfg.name}: {item!r} is not KEY:VALUE")
        if key == "target":
            if value not in TARGETS:
                raise argparse.ArgumentTypeError(f"config {cfg.name}: target must be one of {TARGETS}")
            cfg.target = value
        elif key == "url":
            cfg.target, cfg.url = "url", value
        elif key in ("policy", "interception", "model"):
            setattr(cfg, key, value)
        elif key.startswith("opt."):
            cfg.policy_options[key[4:]] = _value(value)
        else:
            raise argparse.ArgumentTypeError(f"config {cfg.name}: unknown key {key!r} (target, url, model, "
                                             "policy, interception, opt.NAME)")
    if cfg.target == "url" and not cfg.url:
        raise argparse.ArgumentTypeError(f"config {cfg.name}: the url target needs url:http://HOST:PORT/v1")
    return cfg


def add_sim_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulator (sim target)")
    g.add_argument("--preset", default="gptj-6b-a100",
                   help="cost model: gptj-6b-a100, vicuna-13b-2xa100 or a `segue profile` JSON path")
    g.add_argument("--sim-kv-cache-tokens", type=int, default=None,
                   help="device KV pool in tokens (default: the preset's 0.9 of GPU memory minus weights; "
                        "with a profile JSON: --kv-cache-tokens)")
    g.add_argument("--sim-max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the cost model's saturation point)")
    g.add_argument("--sim-max-num-seqs", type=int, default=256, help="sequences per step (default: 256)")


class Runner:
    """Runs one configuration on one draw of a workload; keeps the loaded model between runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._loaded: Any = None
        self._cost: Any = None

    # ---- context limits, so the workload fits every target --------------------------------
    def max_model_len(self, configs: Sequence[RunConfig]) -> int:
        limits = [self.args.max_model_len or 4096]
        if any(c.target == "engine" for c in configs):
            limits.append(self._probe_engine().max_model_len)
        return min(limits)

    # ---- the simulator -------------------------------------------------------------------
    def sim_cost(self) -> Any:
        if self._cost is None:
            import os

            from segue.sched.cost_model import PRESETS, CostModel

            preset = self.args.preset
            if preset in PRESETS:
                self._cost = PRESETS[preset]
            elif os.path.exists(preset):
                self._cost = CostModel.load(preset)
            else:
                raise SystemExit(f"--preset must be one of {sorted(PRESETS)} or a profile JSON path")
        return self._cost

    def make_sim(self, cfg: RunConfig) -> Any:
        from segue.config import CacheConfig, EngineConfig, SchedulerConfig
        from segue.sim.engine import default_kv_cache_tokens, make_sim_engine

        a, cost = self.args, self.sim_cost()
        kv = a.sim_kv_cache_tokens or default_kv_cache_tokens(a.preset, cost.kv_bytes_per_token, a.block_size) \
            or a.kv_cache_tokens
        sched = SchedulerConfig(max_num_batched_tokens=a.sim_max_num_batched_tokens or cost.saturation_tokens,
                                max_num_seqs=a.sim_max_num_seqs, watermark=a.watermark, policy=cfg.policy or a.policy,
                                policy_options=dict(cfg.policy_options),
                                interception_policy=cfg.interception or a.interception_policy)
        config = EngineConfig(cache=CacheConfig(block_size=a.block_size, swap_space_tokens=a.swap_space_tokens,
                                                enable_prefix_caching=not a.no_prefix_caching), scheduler=sched)
        return make_sim_engine(cost, kv, config, max_model_len=a.max_model_len or 4096)

    # ---- the in-process engine -------------------------------------------------------------
    def _probe_engine(self) -> Any:
        return self.make_engine(RunConfig("probe", "engine"))

    def make_engine(self, cfg: RunConfig) -> Any:
        from segue.bench.intercept import _warm_up
        from segue.engine.args import engine_config_from_args
        from segue.engine.llm_engine import LLMEngine
        from segue.executor.loading import load_model

        base = engine_config_from_args(self.args)
        first = self._loaded is None
        if first:
            self._loaded = load_model(base)
        executor, tokenizer, model_config, model_name, chat_template = self._loaded
        config = copy.deepcopy(base)
        config.scheduler.policy = cfg.policy or config.scheduler.policy
        config.scheduler.interception_policy = cfg.interception or config.scheduler.interception_policy
        config.scheduler.policy_options.update(cfg.policy_options)
        # A fresh scheduler, KV manager and statistics over the same executor: stale KV contents are
        # harmless because no block table points at them.
        engine = LLMEngine(config, executor=executor, tokenizer=tokenizer, model_config=model_config,
                           model_name=model_name, chat_template=chat_template)
        if first:
            _warm_up(engine)
        return engine

    # ---- one run ---------------------------------------------------------------------------
    def run(self, cfg: RunConfig, requests: list[TraceRequest], arrivals: list[float], rate: float,
            progress: bool) -> dict[str, Any]:
        desc = f"{cfg.name} @ {rate:g} req/s"
        deadline = getattr(self.args, "deadline_s", None)
        if cfg.target == "url":
            from segue.bench.client import ClientConfig, drive_sync

            plain = getattr(self.args, "plain_openai", False)
            client = ClientConfig(cfg.url or "", model=cfg.model, api_key=getattr(self.args, "api_key", None),
                                  ignore_eos=not plain, segue_extensions=not plain, seed=self.args.seed)
            result = drive_sync(client, requests, arrivals, progress=progress, desc=desc, deadline_s=deadline)
            row = result.to_dict()
            records = result.records
        else:
            from segue.sim.replay import real_clock_wait, replay

            engine = self.make_sim(cfg) if cfg.target == "sim" else self.make_engine(cfg)
            wait = engine.clock.advance_to if cfg.target == "sim" else real_clock_wait
            res = replay(engine, requests, arrivals, wait, seed=self.args.seed, progress=progress, desc=desc,
                         deadline_s=deadline)
            row = res.to_dict()
            records = res.records
        row["records"] = [[r.arrival_time, r.first_token_time, r.finish_time, r.prompt_tokens, r.output_tokens,
                           r.intercepted_time] for r in records]
        return {"config": cfg.name, "target": cfg.target, "label": cfg.label(), "rate": rate, **row}


"""`segue bench throughput`: offline batch throughput of the in-process engine against HF `generate`.

Three measurements on one random-token workload: the whole batch added at once (throughput, TTFT, TPOT),
one request alone (decode speed without batching), and transformers' `generate` on the same weights as a
reference point. Heavy imports live inside functions so building the CLI parser stays cheap.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from typing import Any, cast

from segue.bench import Benchmark
from segue.sim.metrics import RequestRecord, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64, help="requests, all added at once (default: 64)")
    g.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    g.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per request, EOS ignored (default: 128)")
    g.add_argument("--seed", type=int, default=0, help="seed for the random prompt token ids")
    g.add_argument("--hf-batch-size", type=int, default=32, help="rows per transformers generate() call (default: 32)")
    g.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    g.add_argument("--skip-single", action="store_true", help="skip the single-request decode run")
    g.add_argument("--output-json", default=None, metavar="PATH", help="write all results here")


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform ids from the middle of the vocabulary, away from special and byte tokens at the ends,
    so the prompts exercise ordinary embeddings and never contain an accidental EOS."""
    import numpy as np

    lo, hi = (1000, vocab_size - 1000) if vocab_size > 4000 else (0, vocab_size)
    rng = np.random.default_rng(seed)
    return rng.integers(lo, hi, size=(n, length)).tolist()


def _drain(engine: Any, bar: Any) -> list[Any]:
    finished: list[Any] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        bar.update(len(outputs))  # each output of a step carries exactly one new token
        finished.extend(o for o in outputs if o.finished)
    return finished


def run_segue_batch(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from tqdm import tqdm

    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    steps0, preempt0 = engine.num_steps, engine.scheduler.state.num_preemptions_total
    with tqdm(total=len(prompts) * output_len, desc="segue batch", unit="tok", file=sys.stderr) as bar:
        start = time.monotonic()
        for prompt in prompts:
            engine.add_request(EngineRequest(prompt, params))
        finished = _drain(engine, bar)
        duration = time.monotonic() - start
    records = [RequestRecord.from_output(o) for o in finished]
    result = summarize(records, duration).to_dict()
    result["engine_steps"] = engine.num_steps - steps0
    result["preemptions"] = engine.scheduler.state.num_preemptions_total - preempt0
    return result


def run_segue_single(engine: Any, prompt: list[int], output_len: int) -> dict[str, Any]:
    from tqdm import tqdm

    from segue.engine.engine_request import EngineRequest
    from segue.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with tqdm(total=output_len, desc="segue single", unit="tok", file=sys.stderr) as bar:
        engine.add_request(EngineRequest(prompt, params))
        (out,) = _drain(engine, bar)
    r = RequestRecord.from_output(out)
    decode_s = r.finish_time - r.first_token_time
    return {
        "output_tokens": r.output_tokens,
        "ttft_s": r.first_token_time - r.arrival_time,
        "decode_s": decode_s,
        # The first token comes out of the prefill step, so only the remaining ones measure decoding.
        "decode_tok_per_s": (r.output_tokens - 1) / decode_s if r.output_tokens > 1 and decode_s > 0 else None,
    }


def build_hf_model(ckpt: Any, device: Any) -> Any:
    """A transformers model holding exactly the weights segue loaded, for an apples-to-apples baseline."""
    import torch
    import transformers

    cfg = ckpt.config
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
    )
    if cfg.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(cfg.rope_scaling)
    config: Any  # transformers types each model class with its own config class
    cls: Any
    if cfg.architecture == "qwen2":
        config, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    else:  # llama, and mistral whose sliding window the loader already folded into the context cap
        kwargs.update(head_dim=cfg.head_dim, attention_bias=cfg.attention_bias)
        config, cls = transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    model = cls(config).to(torch.float32)
    result = model.load_state_dict(ckpt.weights, strict=False)
    # A tied checkpoint has no lm_head tensor: the tied parameter was filled through embed_tokens.
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"weights do not fit the transformers model: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    return model.to(device).eval()


def run_hf(model: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> dict[str, Any]:
    import torch
    import transformers
    from tqdm import tqdm

    eos = model.config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])

    def gen_config(new_tokens: int) -> transformers.GenerationConfig:
        # min_new_tokens masks EOS, the transformers way of matching segue's ignore_eos token count.
        return transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                             eos_token_id=eos_ids or None, pad_token_id=eos_ids[0] if eos_ids else 0)

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)

    def generate(batch: torch.Tensor, g: transformers.GenerationConfig) -> torch.Tensor:
        out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), generation_config=g)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out[:, batch.shape[1]:]

    with torch.inference_mode():
        # One-off costs (lazy init, allocator growth) should not count against the baseline.
        generate(ids[:1, : min(16, ids.shape[1])], gen_config(2))
        gen = gen_config(output_len)
        generated = 0
        with tqdm(total=len(prompts) * output_len, desc="hf generate", unit="tok", file=sys.stderr) as bar:
            start = time.monotonic()
            for i in range(0, len(prompts), batch_size):
                new = generate(ids[i:i + batch_size], gen)
                generated += new.numel()
                bar.update(new.numel())
            duration = time.monotonic() - start
    return {
        "batch_size": batch_size, "dtype": "float32", "duration_s": duration, "output_tokens": generated,
        "output_throughput": generated / duration,
        "total_throughput": (generated + ids.numel()) / duration,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


def describe_device(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu ({cpu}, {os.cpu_count()} logical cores)"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def render_markdown(res: dict[str, Any]) -> str:
    env, w, s = res["environment"], res["workload"], res["segue"]
    ttft, tpot = s["ttft"] or {}, s["tpot"] or {}
    rows = [
        ("model", env["model"]),
        ("device / dtype / weights", f"{env['device']} / {env['dtype']} / {env.get('quantization', 'none')}"),
        ("torch threads", str(env["torch_threads"])),
        ("workload", f"{w['num_requests']} requests × {w['prompt_len']} prompt + {w['output_len']} output "
                     f"tokens (seed {w['seed']})"),
        ("segue output tok/s", _num(s["output_throughput"])),
        ("segue total tok/s", _num(s["total_throughput"])),
        ("segue requests/s", _num(s["request_throughput"], "{:.2f}")),
        ("segue wall time (s)", _num(s["duration_s"], "{:.2f}")),
        ("TTFT mean / p50 / p99 (ms)", f"{_ms(ttft.get('mean'))} / {_ms(ttft.get('p50'))} / {_ms(ttft.get('p99'))}"),
        ("TPOT mean (ms)", _ms(tpot.get("mean"))),
        ("engine steps / preemptions", f"{s['engine_steps']} / {s['preemptions']}"),
    ]
    if res.get("single") is not None:
        rows.append(("single-request decode tok/s", _num(res["single"]["decode_tok_per_s"])))
    if res.get("hf") is not None:
        hf = res["hf"]
        rows.append((f"HF generate output tok/s (fp32, batch {hf['batch_size']})", _num(hf["output_throughput"])))
        rows.append(("segue / HF output tok/s", _num(res["ratio_vs_hf"], "{:.2f}×")))
    lines = ["## segue bench throughput", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", f"command: `{res['command']}`"]
    return "\n".join(lines)


def _plain_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


def run(args: argparse.Namespace) -> int:
    import gc

    import torch

    from segue.engine.args import engine_config_from_args
    from segue.engine.llm_engine import LLMEngine
    from segue.executor.model_executor import ModelExecutor

    n, p_len, o_len = args.num_requests, args.prompt_len, args.output_len
    if min(n, p_len, o_len, args.hf_batch_size) < 1:
        raise SystemExit("--num-requests, --prompt-len, --output-len and --hf-batch-size must be >= 1")
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    if p_len + o_len > engine.max_model_len:
        raise SystemExit(f"--prompt-len + --output-len = {p_len + o_len} exceeds the engine's context "
                         f"window of {engine.max_model_len} tokens")
    vocab = engine.model_config.vocab_size
    # Distinct seeds per phase so no prompt shares a cached prefix with another phase's.
    prompts = random_prompts(n, p_len, vocab, args.seed)
    single_prompt = random_prompts(1, p_len, vocab, args.seed + 1)[0]
    warmup_prompt = random_prompts(1, min(p_len, 16), vocab, args.seed + 2)[0]
    executor = cast(ModelExecutor, engine.executor)  # LLMEngine(config) builds the model's executor
    device = executor.device
    results: dict[str, Any] = {
        "command": shlex.join([os.path.basename(sys.argv[0]) or "segue", *sys.argv[1:]]),
        "args": _plain_args(args),
        "environment": {
            "model": engine.model_name, "device": describe_device(device),
            "dtype": str(executor.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(executor.kv_dtype).removeprefix("torch."),
            "quantization": executor.quantization.value,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "workload": {"num_requests": n, "prompt_len": p_len, "output_len": o_len, "seed": args.seed},
        "segue": None, "single": None, "hf": None, "ratio_vs_hf": None,
    }
    run_segue_single(engine, warmup_prompt, 2)  # one-off costs (kernel load, allocator) stay out of the timing
    results["segue"] = run_segue_batch(engine, prompts, o_len)
    if not args.skip_single:
        results["single"] = run_segue_single(engine, single_prompt, o_len)
    del engine
    gc.collect()  # the baseline gets the memory back before it loads its own copy of the weights

    if not args.skip_hf:
        from segue.model.loader import load_checkpoint

        ckpt = load_checkpoint(config.model.model, dtype=torch.float32)
        model = build_hf_model(ckpt, device)
        del ckpt
        results["hf"] = run_hf(model, prompts, o_len, args.hf_batch_size)
        results["ratio_vs_hf"] = results["segue"]["output_throughput"] / results["hf"]["output_throughput"]
        del model
        gc.collect()

    print(render_markdown(results))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


BENCHMARK = Benchmark(
    name="throughput",
    help="offline batch throughput, TTFT/TPOT, single-request decode, and a transformers baseline",
    add_arguments=add_arguments,
    run=run,
)

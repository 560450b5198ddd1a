"""Engine flags shared by `segue serve/generate/profile` and the benchmarks, and the EngineConfig
they describe (vLLM's EngineArgs). Lives beside config, below the cli and bench that use it."""
from __future__ import annotations

import argparse

from segue.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    ModelLoadConfig,
    SchedulerConfig,
)


def seconds_or_none(text: str) -> float | None:
    """A flag's seconds, or none/off for no bound."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or none, got {text!r}") from None


def add_newcomer_wait_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument("--max-newcomer-wait-s", type=seconds_or_none, default=SchedulerConfig.max_newcomer_wait_s,
                   metavar="S|none",
                   help="the longest a new agent's first turn waits behind running agents' retained histories "
                        "before it goes ahead of their later turns and may release them "
                        f"(default: {SchedulerConfig.max_newcomer_wait_s:g}; none: no bound; segue/sched/newcomers.py)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="a .gguf file or Hugging Face checkpoint directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None, help="the model name the API reports (default: from --model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype (auto: the kernel plan's choice for the device)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="weight-only quantization of the linear layers (auto: on CPU, a format that holds "
                        "the checkpoint exactly, e.g. a GGUF Q4_1 / Q8_0 file's, for the batch sizes where "
                        "this machine's kernel table measured it faster; never a lossy re-quantization of "
                        "float weights; none on CUDA)")
    g.add_argument("--weights-memory", default="packed", choices=["packed", "dense"],
                   help="a GGUF file's quantized weights: packed (default) keeps only the file's blocks, "
                        "computed on by native kernels, so resident weights are the file's tensor bytes; "
                        "dense also keeps a dense copy in the compute dtype for the batch sizes where this "
                        "machine's measured table says a GEMM over it is faster (~3-4x the memory)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="the same kernels at every batch size, so a request's output does not depend on "
                        "the load (CPU, native kernels; int8 unless --quantization int4; slower prefill)")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="attention kernels (auto: on CPU, per kind and length the fastest of the native "
                        "kernels and torch's SDPA as measured on this machine; see `segue bench kernels`)")
    g.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                   help="sampling settings for fields a request leaves out: the model's recommended "
                        "ones (auto), the OpenAI API defaults (none), or a directory's "
                        "generation_config.json")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help=f"tokens per KV cache block (default: {CacheConfig.block_size})")
    g.add_argument("--kv-cache-tokens", type=int, default=CacheConfig.kv_cache_tokens,
                   help="device KV pool size in tokens")
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="device KV pool size in bytes (overrides tokens)")
    g.add_argument("--swap-space-tokens", type=int, default=CacheConfig.swap_space_tokens,
                   help=f"host KV pool size in tokens, for swapped-out KV (default: {CacheConfig.swap_space_tokens})")
    g.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache storage dtype (auto: the model's; bfloat16 under a float32 model halves "
                        "KV memory and attention reads)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached KV of shared prompt prefixes")
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help=f"token budget per step (default: {SchedulerConfig.max_num_batched_tokens})")
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help=f"sequences per step (default: {SchedulerConfig.max_num_seqs})")
    g.add_argument("--watermark", type=float, default=SchedulerConfig.watermark,
                   help="fraction of the KV pool kept free when admitting new requests (default: 0)")
    g.add_argument("--latency-capacity-tokens", type=int, default=None,
                   help="Parrot's latency capacity: while a latency-sensitive request runs (plain API requests "
                        "are), the running requests hold at most this many tokens; a program's throughput "
                        "task group alone may fill the pool (default: no cap)")
    g.add_argument("--no-agent-retention", action="store_true",
                   help="turn off agent-aware retention and admission: finished turns' histories go straight "
                        "to the LRU prefix cache and admission does not protect them (segue/sched/agents.py)")
    add_newcomer_wait_arg(g)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens (default: the model's)")
    g.add_argument("--policy", default=SchedulerConfig.policy, help="scheduling policy name")
    g.add_argument("--interception-policy", default=SchedulerConfig.interception_policy,
                   help="discard, improved-discard, preserve, swap, ttl or min-waste")
    g.add_argument("--profile", dest="profile_path", default=None, help="a `segue profile` JSON")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=args.model, dtype=args.dtype, device=args.device,
                              served_model_name=args.served_model_name, quantization=args.quantization,
                              generation_config=args.generation_config,
                              weights_memory=getattr(args, "weights_memory", "packed"),
                              batch_invariant=getattr(args, "batch_invariant", False),
                              attention_backend=getattr(args, "attention_backend", "auto")),
        cache=CacheConfig(block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens,
                          kv_cache_bytes=args.kv_cache_bytes, swap_space_tokens=args.swap_space_tokens,
                          kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  watermark=args.watermark, latency_capacity_tokens=args.latency_capacity_tokens,
                                  policy=args.policy, interception_policy=args.interception_policy,
                                  profile_path=args.profile_path,
                                  agent_retention=not getattr(args, "no_agent_retention", False),
                                  max_newcomer_wait_s=getattr(args, "max_newcomer_wait_s",
                                                              SchedulerConfig.max_newcomer_wait_s)),
        num_threads=args.threads,
    ).validate()

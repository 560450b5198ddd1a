"""Every engine knob in one validated dataclass tree."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    pass


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class CacheConfig:
    block_size: int = 16
    # Size of the device KV pool. Small by default so memory pressure is realistic for the
    # 135M default model; `kv_cache_bytes` overrides it when set.
    kv_cache_tokens: int = 16384
    kv_cache_bytes: int | None = None
    # Host pool for swapped-out KV, in tokens (0 disables swapping).
    swap_space_tokens: int = 65536
    enable_prefix_caching: bool = True
    # Storage dtype of the KV cache: "auto" = the model's dtype. "bfloat16" under a float32 model
    # halves the KV bytes, so the pool holds twice the tokens and decode attention (memory-bound:
    # it reads every cached K/V row each step) reads half; scores still accumulate in fp32.
    kv_cache_dtype: str = "auto"
    # Salt mixed into block hashes; tenants with different salts never share cached blocks.
    prefix_cache_salt: int = 0

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"kv_cache_tokens ({self.kv_cache_tokens}) is smaller than one block")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError("kv_cache_bytes must be positive")
        if self.swap_space_tokens < 0:
            raise ConfigError("swap_space_tokens must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")


@dataclass
class SchedulerConfig:
    # Tokens per step shared by prefill chunks and decodes. Large prefill chunks run the GEMMs
    # more efficiently (measured on 2 CPU cores: 191 vs 165 output tok/s against 512 on the
    # throughput benchmark) at the cost of longer steps while prompts are being prefilled.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Fraction of the device KV pool that admitting a request without KV may not dip into while
    # others run (vLLM v0's watermark), so running requests can grow without preempting each
    # other. 0 fills the pool (vLLM v1). On the simulated InferCept trace 0.05 removes nearly
    # all preemptions but raises latency (requests wait longer to start; BENCHMARKS.md).
    watermark: float = 0.0
    policy: str = "fcfs"
    # Per-policy knobs (e.g. {"starvation_threshold": 100}); each policy documents its own.
    policy_options: dict[str, Any] = field(default_factory=dict)
    # What a paused request's KV does while it waits: discard, improved-discard, preserve, swap,
    # ttl or min-waste (see segue/sched/interception).
    interception_policy: str = "min-waste"
    # A `segue profile` JSON with measured T_fwd and swap bandwidth; None: the device's cached
    # profile if one exists, else defaults.
    profile_path: str | None = None
    # None: the model's context window, capped by what the device pool can hold.
    max_model_len: int | None = None
    # Parrot's latency capacity: while a latency-sensitive request runs (every plain API request
    # is), admission keeps the running requests' tokens within this many, because a decode step's
    # time grows with the tokens in the batch. Throughput work (a program's task group) alone may
    # fill the pool. None: no cap.
    latency_capacity_tokens: int | None = None
    # Eviction order of finished requests' cached blocks: "lru" (least recently freed first) or
    # "reuse" (LRU shifted by each block's expected reuse distance, segue/kv/reuse.py; ahead of
    # LRU at every capacity on the Mooncake traces, BENCHMARKS.md).
    prefix_eviction: str = "lru"
    # Agents (segue/sched/agents.py): a finished turn whose agent is likely back keeps its history
    # on the device across the tool gap, and admission gives a newcomer only the memory that the
    # retained histories and the running requests' prompts leave (thrashing avoidance, issue 25).
    agent_retention: bool = True
    # The longest a new agent's first turn waits behind running agents' histories (seconds of the
    # scheduler's clock; sched/newcomers.py): past it, it goes ahead of later turns sent after it
    # and may release retained histories. None: no bound (only thrashing.py's recompute-time one).
    # 2.5 s, measured on the pressure preset (BENCHMARKS.md, "How long a newcomer waits"): on the
    # real engine (seeds 1-4, 2-core EPYC) a first token's p90 was 4.1 s (FCFS 5.0, 10 s bound
    # 11.2, none 36.5) with agent time within 1 % of the 10 s bound's and 13 % ahead of FCFS; the
    # simulator (8 seeds, this machine's profile at 1x and 2x step time) agrees: agent time moves
    # < 1.5 % between 0 and 20 s while the first-turn p90 follows the bound. What a lower bound
    # gives up is later turns' TTFT (mean 7.5 s against 7.0 s at 10 s; FCFS 8.8 s).
    max_newcomer_wait_s: float | None = 2.5

    def validate(self) -> None:
        if self.prefix_eviction not in ("lru", "reuse"):
            raise ConfigError("prefix_eviction must be lru or reuse")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark must be in [0, 1)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.latency_capacity_tokens is not None and self.latency_capacity_tokens < 1:
            raise ConfigError("latency_capacity_tokens must be >= 1")
        if self.max_newcomer_wait_s is not None and not self.max_newcomer_wait_s >= 0:
            raise ConfigError("max_newcomer_wait_s must be >= 0 (None: no bound)")


QUANTIZATIONS = ("auto", "none", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "native", "sdpa", "sdpa-mask")


@dataclass
class ModelLoadConfig:
    # Path to a .gguf file or a Hugging Face checkpoint directory; None: the embedded default.
    model: str | None = None
    # "auto": bfloat16 on CUDA; on CPU the dtype whose GEMMs this machine runs fastest (its
    # measured kernel table, segue/model/kernel_table.py): bf16 where it has bf16 matrix
    # instructions, float32 where bf16 is emulated.
    dtype: str = "auto"
    device: str = "auto"
    served_model_name: str | None = None
    # Weight-only quantization of the linear layers: "auto" (on CPU, a format that holds the
    # checkpoint exactly, e.g. a GGUF Q4_1 / Q8_0 file's, for the batch sizes where the kernel
    # table measured it faster; never a lossy re-quantization; none on CUDA), "none", "int8" or
    # "int4", both with a scale per group of 32 weights along the input (segue/model/quant.py).
    quantization: str = "auto"
    # Bitwise: a request's logits do not depend on the load. Every batch size runs the quantized
    # native GEMMs and every row, decodes included, one native attention kernel in position order
    # (segue/executor/model_executor.py), with no measured switching; prefill and decode are
    # slower. Off by default, as in vLLM: then batches above the quantized range run a GEMM over
    # the same dequantized weights, and only the summation order differs.
    batch_invariant: bool = False
    # Attention backend per kind of work (decode, prefill from 0, extend over cached context):
    # "auto" is measured on CPU among the native kernels and torch's (segue/model/attention_table.py);
    # "native", "sdpa" or "sdpa-mask" force one wherever it is correct.
    attention_backend: str = "auto"
    # Sampling settings for the fields a request leaves out: "auto" the model's recommended ones
    # (segue/engine/generation_defaults.py), "none" the OpenAI API's (temperature 1, top_p 1), or a
    # directory holding a generation_config.json — vLLM's --generation-config.
    generation_config: str = "auto"
    # What a GGUF file's quantized matrices may cost in memory (segue/model/gguf_blocks.py):
    # "packed" keeps only the file's blocks, which the native kernels compute on; "dense" also
    # keeps a dense copy in the compute dtype, used for the batch sizes where this machine's
    # measured table says a GEMM over it beats the block kernels (prefill chunks, large batches).
    weights_memory: str = "packed"

    def validate(self) -> None:
        if self.weights_memory not in ("packed", "dense"):
            raise ConfigError(f"unknown weights memory {self.weights_memory!r} (packed, dense)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"unknown dtype {self.dtype!r} (auto, float32, bfloat16, float16)")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r} ({', '.join(QUANTIZATIONS)})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"unknown attention backend {self.attention_backend!r} ({', '.join(ATTENTION_BACKENDS)})")


@dataclass
class PredictorConfig:
    """Online predictors (segue/predict): output lengths and tool durations for the policies."""
    enabled: bool = True
    # "hidden": once a segment's prefill completes, refine the prompt-feature guess with the served
    # model's final hidden state of its last prompt token (TRAIL); executors without hidden states
    # (the simulator) fall back to prompt features. "prompt": prompt features only.
    feature_source: str = "hidden"
    # Relative sigma of Gaussian noise added to every prediction (LAMPS §6.4 sensitivity studies).
    noise_sigma: float = 0.0
    seed: int = 0
    # Finished segments the output-length regressors refit on (recent traffic, bounded cost).
    window: int = 512
    ridge_alpha: float = 1.0
    # The hidden state is randomly projected to this many dimensions before regression.
    hidden_dims: int = 32
    # Which quantile of a tool's observed durations predicts its next call (0.5: the median).
    tool_quantile: float = 0.5
    # Cap output-length predictions at what max_tokens still allows. Right for real clients; in
    # trace replay max_tokens is the script's exact total, so the cap leaks the truth into the last
    # segment's prediction (InferCept trace, 300 requests: MAE 33 capped vs 36 uncapped).
    clip_to_max_tokens: bool = True
    # Trace replay only (benchmarks, simulator): predictions are the script's true segment length
    # and pause duration, plus `noise_sigma` noise (LAMPS §6.4's oracle and sensitivity runs).
    # The online predictors still learn and report their own accuracy beside it.
    oracle: bool = False

    def validate(self) -> None:
        if self.feature_source not in ("hidden", "prompt"):
            raise ConfigError(f"unknown predictor feature_source {self.feature_source!r} (hidden, prompt)")
        if not self.noise_sigma >= 0:
            raise ConfigError("predictor noise_sigma must be >= 0")
        if self.window < 1 or self.hidden_dims < 1:
            raise ConfigError("predictor window and hidden_dims must be >= 1")
        if not self.ridge_alpha > 0:
            raise ConfigError("predictor ridge_alpha must be > 0")
        if not 0.0 <= self.tool_quantile <= 1.0:
            raise ConfigError("predictor tool_quantile must be in [0, 1]")


@dataclass
class EngineConfig:
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    # Torch threads for the executor; None leaves torch's default.
    num_threads: int | None = None

    def validate(self) -> "EngineConfig":
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.predictor.validate()
        return self

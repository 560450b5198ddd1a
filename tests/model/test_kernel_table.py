"""Kernels chosen by measurement: the table's decisions, the plan an executor gets from it, and
the on-disk cache that must never hand a table to another machine."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from segue.config import ModelLoadConfig
from segue.executor import kernel_plan
from segue.model import kernel_table as kt
from segue.model import table_cache
from segue.model.config import ModelConfig
from segue.model.quant import Quantization

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=128)


def table(int8: dict[int, float], fp32: dict[int, float], bf16: dict[int, float],
          head_int8: dict[int, float] | None = None) -> kt.KernelTable:
    head_int8 = int8 if head_int8 is None else head_int8
    return kt.KernelTable({"cpu": "test"}, {
        "layers": {"float32": fp32, "bfloat16": bf16, "int8": int8},
        "lm_head": {"float32": fp32, "bfloat16": bf16, "int8": head_int8}})


# A CPU where bf16 GEMMs are fast and int8 wins only at 1-8 rows.
ROWS = (1, 8, 16, 32, 2048)
BF16_CPU = table(int8={1: 1.0, 8: 1.5, 16: 4.0, 32: 9.0}, fp32={1: 3.0, 8: 3.2, 16: 3.5, 32: 4.0, 2048: 200.0},
                 bf16={1: 2.0, 8: 2.1, 16: 2.2, 32: 2.5, 2048: 60.0})
# An AVX2-like CPU: bf16 emulated (slow), int8 wins up to 16 rows against fp32.
AVX2_CPU = table(int8={1: 1.0, 8: 1.5, 16: 2.9, 32: 9.0}, fp32={1: 3.0, 8: 3.2, 16: 3.5, 32: 4.0, 2048: 100.0},
                 bf16={1: 9.0, 8: 9.5, 16: 10.0, 32: 12.0, 2048: 400.0})


def test_decisions_follow_the_timings():
    assert BF16_CPU.dense_dtype() == "bfloat16"
    assert AVX2_CPU.dense_dtype() == "float32"
    assert BF16_CPU.quantized_up_to("layers", "int8", "bfloat16") == 8
    assert AVX2_CPU.quantized_up_to("layers", "int8", "float32") == 16
    assert BF16_CPU.best("layers", 5, ("bfloat16", "int8")) == "int8"     # 5 rows: timed at 8
    assert BF16_CPU.best("layers", 9, ("bfloat16", "int8")) == "bfloat16"  # 9 rows: timed at 16
    assert BF16_CPU.best("layers", 5000, ("bfloat16", "int8")) == "bfloat16"  # past the ladder: its end
    # Past 512 rows only the leading dtype is timed: 2,048 rows are judged at 2,048, not at 512.
    bf16_only = table(int8={1: 1.0}, fp32={1: 3.0, 512: 90.0}, bf16={1: 2.0, 512: 100.0, 2048: 200.0})
    assert bf16_only.best("layers", 2048, ("float32", "bfloat16")) == "bfloat16"
    never = table(int8={1: 5.0}, fp32={1: 1.0, 2048: 9.0}, bf16={1: 1.0, 2048: 9.0})
    assert never.quantized_up_to("layers", "int8", "float32") == 0


def test_round_trip_and_format():
    again = kt.KernelTable.from_json(BF16_CPU.to_json())
    assert again == BF16_CPU
    text = BF16_CPU.format()
    assert "layers" in text and "lm_head" in text and "int8" in text


@pytest.fixture
def fake_table(monkeypatch):
    current = {}
    monkeypatch.setattr(kt, "kernel_table", lambda config, kernels, **kw: current["table"])
    return current


def test_plan_on_cpu_follows_the_table(fake_table):
    cpu, kernels = torch.device("cpu"), object()
    fake_table["table"] = BF16_CPU
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, cpu, kernels)
    # bf16 wins, and "auto" does not put int8 weights under bf16 activations (quality bar).
    assert (plan.dtype, plan.quantization, plan.quantized_rows) == (torch.bfloat16, Quantization.NONE, 0)
    # An explicit int8 under bf16 runs int8 where it beats the bf16 GEMM.
    plan = kernel_plan.plan_kernels(ModelLoadConfig(quantization="int8"), TINY, cpu, kernels)
    assert (plan.dtype, plan.quantization, plan.quantized_rows, plan.head_quantized_rows) == \
        (torch.bfloat16, Quantization.INT8, 8, 8)
    fake_table["table"] = AVX2_CPU
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, cpu, kernels)
    # int8 wins up to 16 rows there, but "auto" never changes a float checkpoint's numbers.
    assert (plan.dtype, plan.quantization, plan.head_quantization) == (torch.float32, Quantization.NONE,
                                                                      Quantization.NONE)
    plan = kernel_plan.plan_kernels(ModelLoadConfig(quantization="int8"), TINY, cpu, kernels)
    assert (plan.dtype, plan.quantization, plan.quantized_rows) == (torch.float32, Quantization.INT8, 16)
    # An explicit dtype keeps it; the quantized row range is measured against that dtype's GEMM
    # (emulated bf16 is slow, so int8 wins further).
    plan = kernel_plan.plan_kernels(ModelLoadConfig(dtype="bfloat16", quantization="int8"), TINY, cpu, kernels)
    assert (plan.dtype, plan.quantized_rows) == (torch.bfloat16, 32)
    # Where int8 never wins, not even an explicit int8 quantizes.
    fake_table["table"] = table(int8={1: 5.0}, fp32={1: 1.0, 2048: 9.0}, bf16={1: 2.0, 2048: 19.0})
    assert kernel_plan.plan_kernels(ModelLoadConfig(quantization="int8"), TINY, cpu, kernels).quantized_rows == 0


def test_no_native_kernels_means_no_auto_quantization(fake_table):
    fake_table["table"] = AVX2_CPU
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, torch.device("cpu"), None)
    assert plan.quantization is Quantization.NONE and plan.quantized_rows == 0


def test_cuda_needs_no_table(fake_table):
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, torch.device("cuda"), None)
    assert (plan.dtype, plan.quantization) == (torch.bfloat16, Quantization.NONE)
    plan = kernel_plan.plan_kernels(ModelLoadConfig(dtype="float32", quantization="int8"), TINY,
                                    torch.device("cuda"), None)
    assert (plan.dtype, plan.quantization) == (torch.float32, Quantization.INT8)


def test_measured_once_then_cached_under_this_machines_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path))
    measured = []
    real = kt.measure

    def counting(config, kernels, key, quants=kt.ALL_QUANTS, noisy=False):
        measured.append(key)
        table = real(config, kernels, key, quants)
        table.noisy = noisy  # as if measured while the process waited for its CPUs (or not)
        return table

    monkeypatch.setattr(kt, "measure", functools.partial(counting, noisy=True))
    # Whatever else runs on this machine now, every point records its intervals.
    monkeypatch.setattr(kt.timing.contention, "disturbed", lambda before, after, threads: None)
    table_cache.clear_memo()
    first = kt.kernel_table(TINY, None)
    assert kt.kernel_table(TINY, None) is first and len(measured) == 1   # this process keeps its own
    table_cache.clear_memo()
    # The next start reuses it, noisy or not: measuring again would only follow the day's noise.
    assert kt.kernel_table(TINY, None) == first and len(measured) == 1
    assert set(first.timings_ms) == {"layers", "lm_head"}
    # Both dtypes up to the quantized range; past it only the one that leads by then.
    layers = first.timings_ms["layers"]
    assert set(layers[first.dense_dtype()]) == set(kt.ROWS)
    assert all(set(layers[d]) >= {r for r in kt.ROWS if r <= kt.QUANT_MAX_ROWS} for d in kt.DTYPES)
    # Every point holds the paired intervals its decisions read, padding included.
    assert set(first.ratios["layers"]) == {str(r) for r in kt.ROWS}
    assert kt.padded_name(first.dense_dtype(), 2) + "/" + first.dense_dtype() in first.ratios["layers"]["1"]
    table_cache.clear_memo()
    assert kt.kernel_table(TINY, None, remeasure=True) is not first and len(measured) == 2   # when asked
    # A file whose key is another machine's is never used, even under this machine's name.
    (path,) = (tmp_path / "kernel_tables").glob("*.json")
    raw = json.loads(path.read_text())
    raw["key"]["flags"] = "another-cpu"
    path.write_text(json.dumps(raw))
    table_cache.clear_memo()
    assert kt.kernel_table(TINY, None).key == first.key and len(measured) == 3


def test_the_compiled_module_is_named_by_cpu_and_compiler_flags(monkeypatch):
    from segue.model import cpu_kernels
    name = cpu_kernels._module_name()
    monkeypatch.setattr(cpu_kernels, "cpu_identity", lambda: {"cpu": "x", "machine": "y", "flags": "other"})
    assert cpu_kernels._module_name() != name


def test_batch_invariant_plan_runs_the_quantized_kernels_at_every_size(fake_table):
    from segue.config import ConfigError
    load = ModelLoadConfig(batch_invariant=True)
    plan = kernel_plan.plan_kernels(load, TINY, torch.device("cpu"), object())
    assert plan.quantization is Quantization.INT8 and plan.dtype == torch.float32
    assert plan.quantized_rows >= 1 << 20 and plan.head_quantized_rows >= 1 << 20
    with pytest.raises(ConfigError, match="native CPU kernels"):
        kernel_plan.plan_kernels(load, TINY, torch.device("cpu"), None)
    with pytest.raises(ConfigError, match="quantization"):
        kernel_plan.plan_kernels(ModelLoadConfig(batch_invariant=True, quantization="none"), TINY,
                                 torch.device("cpu"), object())


def q4_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """A matrix already in Q4_1 groups (what a Q4_1 GGUF file dequantizes to)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    scale, lo = torch.rand(n, k // 32, 1, generator=g) * 0.01, torch.randn(n, k // 32, 1, generator=g) * 0.01
    return (q.float() * scale + lo).view(n, k)


def tiny_weights(layer_weights) -> dict[str, torch.Tensor]:
    names = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
             "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
             "mlp.down_proj": (64, 128)}
    out = {f"model.layers.{i}.{n}.weight": layer_weights(*shape, seed=i)
           for i in range(2) for n, shape in names.items()}
    out["lm_head.weight"] = torch.randn(256, 64)
    return out


def test_a_format_that_holds_the_checkpoint_exactly_is_used_under_bf16(fake_table):
    assert kernel_plan.lossless_formats(tiny_weights(q4_weights), TINY) == ({"int4"}, set())
    random = tiny_weights(lambda n, k, seed: torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    assert kernel_plan.lossless_formats(random, TINY) == (set(), set())
    times = {1: 1.0, 8: 1.5, 16: 4.0, 32: 9.0}
    fake_table["table"] = kt.KernelTable({"cpu": "test"}, {
        "layers": {**BF16_CPU.timings_ms["layers"], "int4": times},
        "lm_head": BF16_CPU.timings_ms["lm_head"]})
    cpu, kernels = torch.device("cpu"), object()
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, cpu, kernels, tiny_weights(q4_weights))
    # int4 holds these layers exactly: used where it wins; the (full-precision) head is not quantized.
    assert (plan.dtype, plan.quantization, plan.quantized_rows) == (torch.bfloat16, Quantization.INT4, 8)
    assert plan.head_quantization is Quantization.NONE and plan.head_quantized_rows == 0
    plan = kernel_plan.plan_kernels(ModelLoadConfig(), TINY, cpu, kernels, random)
    assert plan.quantization is Quantization.NONE


def test_one_disturbed_measurement_does_not_decide_the_dtype():
    # bf16 ~4x faster everywhere but one tiny bucket, where another process's time slice landed
    # on it (the measured case that once picked float32 on an AVX512-BF16 CPU).
    noisy = table(int8={1: 2.3}, fp32={1: 0.86, 8: 1.1, 64: 3.6, 512: 19.0, 2048: 75.0},
                  bf16={1: 2.48, 8: 0.5, 64: 0.9, 512: 4.9, 2048: 18.3})
    assert noisy.dense_dtype() == "bfloat16"


def test_the_dtype_follows_the_counts_timed_undisturbed():
    """Counts timed while the process waited for its CPUs (no intervals) do not vote when others
    were timed undisturbed; when none were, all of them do."""
    t = table(int8={1: 1.0}, fp32={1: 0.5, 8: 0.6, 64: 9.0, 512: 90.0}, bf16={1: 5.0, 8: 6.0, 64: 3.0, 512: 30.0})
    t.ratios = {"layers": {"1": {}, "8": {}, "64": {"bfloat16/float32": (0.33, 0.3, 0.36)},
                           "512": {"bfloat16/float32": (0.33, 0.3, 0.36)}}}
    assert t.dense_dtype() == "bfloat16"
    t.ratios = {"layers": {"1": {}, "8": {}, "64": {}, "512": {}}}
    assert t.dense_dtype() == _leading(t)


def _leading(t: kt.KernelTable) -> str:
    return kt._leading_dtype(t.timings_ms["layers"])


def test_nothing_is_measured_when_the_configuration_decides_everything(monkeypatch):
    def refuse(config, kernels):
        raise AssertionError("no kernel table should be measured")

    monkeypatch.setattr(kt, "kernel_table", refuse)
    plan = kernel_plan.plan_kernels(ModelLoadConfig(dtype="float32", quantization="none"), TINY,
                                    torch.device("cpu"), object())
    assert (plan.dtype, plan.quantization) == (torch.float32, Quantization.NONE)


def test_cpu_identity_follows_what_the_compiler_targets(monkeypatch):
    """Two CPUs the compiler builds different code for never share a key, whatever /proc says
    (on aarch64 /proc/cpuinfo has no model name or flags line)."""
    kt.cpu_identity.cache_clear()
    monkeypatch.setattr(kt, "_compiler_target", lambda: "sve2-neon")
    arm = kt.cpu_identity()
    kt.cpu_identity.cache_clear()
    monkeypatch.setattr(kt, "_compiler_target", lambda: "neon")
    assert kt.cpu_identity()["flags"] != arm["flags"]
    kt.cpu_identity.cache_clear()


def test_cpu_identity_without_compiler_or_proc_uses_torchs_dispatch_level(monkeypatch):
    import builtins
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path) == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(kt, "_compiler_target", lambda: None)
    kt.cpu_identity.cache_clear()
    with_proc = kt.cpu_identity()
    monkeypatch.setattr(builtins, "open", no_proc)
    kt.cpu_identity.cache_clear()
    without = kt.cpu_identity()
    kt.cpu_identity.cache_clear()
    assert without["flags"] and without["flags"] != with_proc["flags"]


def test_measured_decisions_need_the_paired_interval_beyond_the_margin():
    """Medians alone would pad 2 -> 4 and run int8 at 8 rows here; the paired intervals say the
    first is within the noise (hi 0.99) and the second is a clear win, so only 4 -> 8 pads."""
    t = table(int8={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, fp32={1: 3.0, 2: 2.0, 4: 3.0, 8: 2.0},
              bf16={1: 9.0, 2: 9.0, 4: 9.0, 8: 9.0})
    t.ratios = {"layers": {
        "1": {"float32@2/float32": (0.67, 0.6, 1.2), "int8/float32": (0.33, 0.3, 0.4)},
        "2": {"float32@4/float32": (0.9, 0.8, 0.99), "int8/float32": (0.5, 0.45, 0.55)},
        "4": {"float32@8/float32": (0.67, 0.6, 0.7), "int8/float32": (0.33, 0.2, 0.96)},
        "8": {"int8/float32": (0.5, 0.4, 0.6)}}}
    assert t.padded_rows("layers", "float32") == {1: 1, 2: 2, 4: 8, 8: 8}
    # At 4 rows int8's interval reaches past 1 - MARGIN: not a clear win, so the range ends at 2.
    assert t.quantized_up_to("layers", "int8", "float32") == 2
    # A chain of confident steps pads through: 2 -> 4 -> 8.
    t.ratios["layers"]["2"]["float32@4/float32"] = (0.9, 0.85, 0.9)
    assert t.padded_rows("layers", "float32") == {1: 1, 2: 8, 4: 8, 8: 8}
    # A dtype never timed padded (not the leading one) is never padded.
    assert t.padded_rows("layers", "bfloat16") == {1: 1, 2: 2, 4: 4, 8: 8}
    again = kt.KernelTable.from_json(t.to_json())
    assert again.padded_rows("layers", "float32") == t.padded_rows("layers", "float32")
    # A point timed while the process waited for its CPUs holds no intervals: the default there.
    t.ratios["layers"]["1"] = {}
    assert t.quantized_up_to("layers", "int8", "float32") == 0
    assert t.padded_rows("layers", "float32")[1] == 1


def test_rows_pad_to_a_faster_timed_count():
    # An AMX-like CPU: bf16 GEMMs tile rows in blocks, so 8 rows beat 2 and 4.
    amx = table(int8={1: 9.0}, fp32={1: 3.0, 2: 3.0, 4: 3.1, 8: 3.2, 16: 3.5},
                bf16={1: 0.7, 2: 1.0, 4: 1.06, 8: 0.73, 16: 1.4})
    assert amx.padded_rows("layers", "bfloat16") == {1: 1, 2: 8, 4: 8, 8: 8, 16: 16}
    assert amx.padded_rows("layers", "float32") == {1: 1, 2: 2, 4: 4, 8: 8, 16: 16}   # within the margin


def test_a_padded_gemm_computes_the_same_rows(monkeypatch):
    from segue.model import quant
    seen = []
    real = quant.F.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return real(x, w, b)

    lw = quant.LinearWeights(torch.randn(48, 32), torch.randn(48), Quantization.NONE, torch.float32,
                             padded_rows={1: 1, 2: 8, 4: 8, 8: 8, 16: 16})
    x = torch.randn(3, 32)
    monkeypatch.setattr(quant.F, "linear", spy)
    out = lw(x)
    assert seen == [8] and out.shape == (3, 48)
    torch.testing.assert_close(out, real(x, lw.dense, lw.bias))
    lw(torch.randn(1, 32))
    lw(torch.randn(6, 32))
    lw(torch.randn(40, 32))   # beyond the ladder: as it is
    assert seen == [8, 1, 6, 40]

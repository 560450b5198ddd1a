"""Where `segue profile` saves its profile and which one an engine loads: keyed like the kernel
table (CPU model and flags, the model, its dtype and quantization, threads) under
SEGUE_CACHE_DIR, so a profile measured on another machine, model or thread count is never
charged for this engine's steps."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from segue.config import EngineConfig, ModelLoadConfig
from segue.model import kernel_table
from segue.model.config import ModelConfig
from segue.model.quant import Quantization
from segue.sched.cost_model import CostModel

SHAPES = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512)
OTHER_SHAPES = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32, max_position_embeddings=512)


def executor(config: ModelConfig = SHAPES, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """What engine_cost_model reads of a model executor."""
    return SimpleNamespace(device_name="cpu", config=config, dtype=dtype, quantization=Quantization.NONE,
                           kv_bytes_per_token=512)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_path_is_keyed_by_cpu_model_dtype_and_threads_under_the_cache_dir(cache: Path, threads,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from segue.executor.loading import profile_key, profile_path

    config = EngineConfig(model=ModelLoadConfig(model="m"))
    path = profile_path(profile_key(config, executor()))
    assert path.parent.parent == cache / "cache" and path.name.startswith("profile-cpu-")
    assert profile_path(profile_key(config, executor())) == path  # stable
    others = [profile_path(profile_key(EngineConfig(model=ModelLoadConfig(model="n")), executor())),
              profile_path(profile_key(config, executor(OTHER_SHAPES))),
              profile_path(profile_key(config, executor(dtype=torch.bfloat16)))]
    n = torch.get_num_threads()
    torch.set_num_threads(1 if n > 1 else 2)
    others.append(profile_path(profile_key(config, executor())))
    torch.set_num_threads(n)
    identity = kernel_table.cpu_identity()
    monkeypatch.setattr(kernel_table, "cpu_identity", lambda: {k: f"another {v}" for k, v in identity.items()})
    others.append(profile_path(profile_key(config, executor())))
    assert len({path, *others}) == len(others) + 1


def test_the_key_names_kv_dtype_block_size_batch_invariance_and_attention_backend(cache: Path) -> None:
    """Each changes what a step costs (decode attention reads every cached row; batch-invariant
    runs other kernels; a forced backend replaces the measured one): none may load another's."""
    from segue.config import CacheConfig
    from segue.executor.loading import profile_key, profile_path

    def path(cache_config: CacheConfig | None = None, kv_dtype: torch.dtype = torch.float32, block_size: int = 16,
             **model: object) -> Path:
        config = EngineConfig(model=ModelLoadConfig(model="m", **model), cache=cache_config or CacheConfig())
        ex = executor()
        ex.kv_dtype, ex.block_size = kv_dtype, block_size
        return profile_path(profile_key(config, ex))

    base = path()
    variants = [path(kv_dtype=torch.bfloat16), path(block_size=32), path(batch_invariant=True),
                path(attention_backend="sdpa")]
    assert len({base, *variants}) == len(variants) + 1
    # Without an executor's own values, the configured ones stand in.
    plain = EngineConfig(model=ModelLoadConfig(model="m"))
    assert profile_key(plain, executor())["block_size"] == "16"
    assert profile_key(EngineConfig(model=ModelLoadConfig(model="m"), cache=CacheConfig(block_size=32)),
                       executor())["block_size"] == "32"


def test_an_engine_loads_only_a_profile_of_its_own_key(cache: Path, threads) -> None:
    from segue.executor.loading import engine_cost_model, profile_key, profile_path

    config = EngineConfig(model=ModelLoadConfig(model="m"))
    measured = CostModel(fwd_ms_per_token=3.25, fwd_base_ms=41.0, device="cpu", source="profiled here")
    # What an earlier version saved, keyed by nothing but the device: from any machine or model.
    legacy = cache / "home" / ".cache" / "segue" / "profile-cpu.json"
    legacy.parent.mkdir(parents=True)
    measured.save(legacy)
    # A profile of the same model at another thread count.
    n = torch.get_num_threads()
    torch.set_num_threads(1 if n > 1 else 2)
    elsewhere = profile_path(profile_key(config, executor()))
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    measured.save(elsewhere)
    torch.set_num_threads(n)
    assert engine_cost_model(config, executor()).source != measured.source
    mine = profile_path(profile_key(config, executor()))
    assert mine != elsewhere
    measured.save(mine)
    loaded = engine_cost_model(config, executor())
    assert loaded.source == measured.source and loaded.fwd_ms_per_token == measured.fwd_ms_per_token


def test_segue_profile_saves_where_the_same_engine_looks(cache: Path, tmp_path: Path) -> None:
    from conftest import make_tiny_checkpoint
    from segue.cli import main
    from segue.config import CacheConfig
    from segue.engine.llm_engine import LLMEngine

    ckpt = str(make_tiny_checkpoint(tmp_path / "tiny"))
    assert main(["--log-level", "WARNING", "profile", "--model", ckpt, "--grid", "tiny",
                 "--kv-cache-tokens", "2048", "--swap-space-tokens", "256"]) == 0
    [saved] = (cache / "cache" / "profiles").glob("profile-cpu-*.json")
    assert json.loads(saved.read_text())["key"]["checkpoint"] == str(Path(ckpt).resolve())
    engine = LLMEngine(EngineConfig(model=ModelLoadConfig(model=ckpt),
                                    cache=CacheConfig(kv_cache_tokens=2048, swap_space_tokens=256)).validate())
    assert engine.cost_model.source == CostModel.load(saved).source
    assert engine.cost_model.fwd_curve_ms == CostModel.load(saved).fwd_curve_ms

"""`segue bench kernels` (what `make setup` runs) on a machine where torch sees a GPU: `--device auto`
resolves to CUDA, whose plan is fixed, so it measures the CPU's tables and says so instead of
exiting 1 (issue 45). torch's CUDA availability is faked; the tables are measured for real, on a
tiny checkpoint, into a cache directory of the test's own."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_checkpoint
from segue.bench.kernels import table_device
from segue.cli import main


@pytest.fixture
def gpu_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_on_a_gpu_host_measures_the_cpu_tables_and_says_so(gpu_seen: None) -> None:
    device, note = table_device("auto")
    assert device == "cpu"
    assert note is not None and "cuda" in note and "CPU's tables" in note and "--device cpu" in note


def test_auto_on_a_cpu_host_says_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert table_device("auto") == ("cpu", None)
    assert table_device("cpu") == ("cpu", None)


@pytest.mark.slow
def test_make_setups_command_exits_0_on_a_gpu_host(gpu_seen: None, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    out_json = tmp_path / "tables.json"
    # The Makefile's command, on the tiny model: `segue bench kernels` with --device left at auto.
    assert main(["bench", "kernels", "--model", str(ckpt), "--output-json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "runs on cuda here" in printed and "CPU tables:" in printed and "CPU plan for" in printed
    plan = json.loads(out_json.read_text())["plan"]
    assert plan["dtype"] in ("float32", "bfloat16")

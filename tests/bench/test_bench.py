"""Benchmark metrics on hand-made numbers, and a tiny end-to-end `segue bench throughput` run."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from conftest import make_tiny_checkpoint
from segue.bench import benchmarks
from segue.cli import build_parser, main
from segue.sim.metrics import (
    Distribution,
    RequestRecord,
    e2e_latency,
    normalized_latency,
    output_throughput,
    percentiles,
    request_throughput,
    span,
    summarize,
    total_throughput,
    tpot,
    ttft,
)


def record(arrival: float, first: float, finish: float, prompt: int = 10, output: int = 5,
           intercepted: float = 0.0) -> RequestRecord:
    return RequestRecord(arrival, first, finish, prompt, output, intercepted)


# ---- metric definitions ------------------------------------------------------------------------

def test_request_level_metrics():
    r = record(10.0, 10.5, 12.5, prompt=100, output=5, intercepted=0.5)
    assert ttft(r) == pytest.approx(0.5)
    assert tpot(r) == pytest.approx(2.0 / 4)  # four gaps between five tokens
    assert e2e_latency(r) == pytest.approx(2.5)
    assert normalized_latency(r) == pytest.approx((2.5 - 0.5) / 5)


def test_tpot_undefined_for_single_token():
    r = record(0.0, 1.0, 1.0, output=1)
    assert tpot(r) is None
    assert normalized_latency(r) == pytest.approx(1.0)


def test_record_rejects_inconsistent_times():
    with pytest.raises(ValueError):
        record(1.0, 0.5, 2.0)
    with pytest.raises(ValueError):
        record(0.0, 1.0, 2.0, output=0)


def test_percentiles_linear_interpolation():
    p = percentiles(range(1, 101))
    assert p == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([4.0, 1.0, 2.0, 3.0], qs=(0, 100)) == {"p0": 1.0, "p100": 4.0}
    with pytest.raises(ValueError):
        percentiles([])


def test_throughput_over_span_and_explicit_duration():
    records = [record(0.0, 1.0, 2.0, prompt=10, output=5), record(1.0, 2.0, 4.0, prompt=20, output=3)]
    assert span(records) == pytest.approx(4.0)
    assert output_throughput(records) == pytest.approx(8 / 4)
    assert total_throughput(records) == pytest.approx(38 / 4)
    assert request_throughput(records) == pytest.approx(2 / 4)
    assert output_throughput(records, duration=2.0) == pytest.approx(4.0)
    assert math.isnan(output_throughput([]))


def test_summary_is_json_ready():
    records = [record(0.0, 0.1, 1.1, output=11), record(0.0, 0.3, 0.3, output=1)]
    s = summarize(records, duration=2.0)
    assert s.output_tokens == 12 and s.num_requests == 2
    assert s.ttft == Distribution(mean=pytest.approx(0.2), p50=pytest.approx(0.2),
                                  p90=pytest.approx(0.28), p99=pytest.approx(0.298))
    assert s.tpot.mean == pytest.approx(0.1)  # the 1-token request has no TPOT and is left out
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["output_throughput"] == pytest.approx(6.0)
    assert d["tpot"]["p99"] == pytest.approx(0.1)
    empty = summarize([]).to_dict()
    assert empty["ttft"] is None and empty["output_throughput"] is None  # NaN must not reach the JSON


# ---- CLI wiring ----------------------------------------------------------------------------------

def test_bench_parser_has_throughput_with_engine_flags():
    assert "throughput" in benchmarks()
    args = build_parser().parse_args(["bench", "throughput", "--max-num-seqs", "8"])
    assert (args.benchmark, args.num_requests, args.prompt_len, args.output_len) == ("throughput", 64, 256, 128)
    assert args.hf_batch_size == 32 and args.max_num_seqs == 8 and not args.skip_hf
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench"])  # a benchmark must be named


# ---- the HF baseline model and an end-to-end run ------------------------------------------------

@pytest.fixture
def restore_torch_threads():
    # The engine applies --threads process-wide; other tests in this process must not inherit it.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_baseline_model_matches_checkpoint(tmp_path, tie):
    from segue.bench.throughput import build_hf_model
    from segue.model.loader import load_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", tie=tie)
    ours = build_hf_model(load_checkpoint(path), torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1200, 3400, 5600, 7800, 9000]])
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits)


def test_throughput_end_to_end(tmp_path, restore_torch_threads):
    path = make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", str(path), "--device", "cpu",
               "--num-requests", "4", "--prompt-len", "16", "--output-len", "8", "--hf-batch-size", "3",
               "--threads", "1", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    seg = res["segue"]
    assert seg["num_requests"] == 4
    assert seg["output_tokens"] == 4 * 8
    assert seg["prompt_tokens"] == 4 * 16
    assert seg["output_throughput"] > 0 and seg["total_throughput"] > seg["output_throughput"]
    assert 0 < seg["ttft"]["p50"] <= seg["ttft"]["p99"] and seg["tpot"]["mean"] > 0
    assert res["single"]["output_tokens"] == 8 and res["single"]["decode_tok_per_s"] > 0
    # Batches of 3 over 4 prompts exercise the uneven last group.
    assert res["hf"]["output_tokens"] == 4 * 8 and res["hf"]["output_throughput"] > 0
    assert res["ratio_vs_hf"] == pytest.approx(seg["output_throughput"] / res["hf"]["output_throughput"])
    assert res["environment"]["torch_threads"] == 1

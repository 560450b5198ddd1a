"""Tool calls pause a request inside the engine and a resume continues it (scripted model)."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import pytest

import engine_helpers
from conftest import make_tiny_checkpoint
from engine_helpers import run_to_completion
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.calls import Abort
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.executor.base import SampledToken
from segue.sampling_params import SamplingParams
from segue.structured import StructuredSpec
from segue.tools.call_format import HERMES
from segue.tools.parser import ToolCallParser


class ScriptedModel:
    """Runs the real forward (so KV is written and checked) but samples a scripted token stream."""

    def __init__(self, engine: LLMEngine, script: list[int]) -> None:
        self.real = engine.executor.execute
        self.script = script
        self.pos: dict[str, int] = {}

    def __call__(self, out):
        sampled = self.real(out)
        for rid in sampled:
            i = self.pos.get(rid, 0)
            self.pos[rid] = i + 1
            sampled[rid] = SampledToken(self.script[min(i, len(self.script) - 1)])
        return sampled


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


make_engine = functools.partial(engine_helpers.make_engine, policy="min-waste", block_size=4, kv_tokens=1024)


def test_tool_call_pauses_and_resume_continues(ckpt):
    engine = make_engine(ckpt)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    answer = "The answer is 5."
    eos = engine.model_config.eos_token_ids[0]
    engine.executor.execute = ScriptedModel(engine, engine.encode(call) + engine.encode(answer) + [eos])
    rid = engine.add_request(EngineRequest(engine.encode("What is 2+3?"), SamplingParams(max_tokens=100),
                                           tool_format=HERMES)).request_id
    paused = None
    while paused is None:
        for out in engine.step():
            if out.paused:
                paused = out
        engine.check_invariants()
    calls = paused.outputs[0].tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+3"})]
    assert paused.outputs[0].text.endswith("</tool_call>") and not paused.finished
    for _ in range(3):  # paused: nothing to run, nothing leaks
        assert engine.step() == []
        engine.check_invariants()
    result = engine.encode("<tool_response>5</tool_response>")
    engine.resume(rid, result)
    final = run_to_completion(engine)[rid]
    completion = final.outputs[0]
    assert completion.text == call + answer
    assert completion.finish_reason == "stop"
    assert completion.num_generated_tokens == len(engine.encode(call)) + len(engine.encode(answer)) + 1
    assert final.metrics.intercepted_time > 0
    assert engine.tool_stats.count("calculator") == 1


def test_async_engine_detach_and_continue(ckpt):
    engine = make_engine(ckpt, policy="swap")
    eos = engine.model_config.eos_token_ids[0]
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    engine.executor.execute = ScriptedModel(engine, engine.encode(call) + engine.encode(" done") + [eos])
    aengine = AsyncLLMEngine(engine)

    async def scenario():
        gen = aengine.generate(EngineRequest(engine.encode("hi there"), SamplingParams(max_tokens=50),
                                             tool_format=HERMES))
        async for out in gen:
            if out.paused:
                aengine.detach(out.request_id)
                rid = out.request_id
                break
        await gen.aclose()
        await asyncio.sleep(0.2)  # the paused request survives its stream closing
        assert await aengine.run_sync(lambda e: rid in e.scheduler.state.paused.paused)
        texts = [o.outputs[0].text async for o in aengine.continue_request(rid, engine.encode(" ok"))]
        assert texts[-1] == call + " done"
        held = await aengine.run_sync(lambda e: (e.check_invariants(), e.scheduler.state.kv.num_held_blocks())[1])
        assert held == 0
        await aengine.shutdown()

    asyncio.run(scenario())


def test_an_end_marker_inside_a_json_string_does_not_end_the_call(ckpt):
    engine = make_engine(ckpt)
    args = {"text": 'say "</tool_call>" \\ then stop'}
    call = '<tool_call>{"name": "echo", "arguments": ' + json.dumps(args) + "}</tool_call>"
    eos = engine.model_config.eos_token_ids[0]
    engine.executor.execute = ScriptedModel(engine, engine.encode(call + " after") + [eos])
    parser = ToolCallParser()
    assert not parser.has_complete_call(call[:call.index("</tool_call>") + len("</tool_call>")])
    engine.add_request(EngineRequest(engine.encode("Echo it"), SamplingParams(max_tokens=100), "r", tool_format=HERMES))
    paused = None
    while paused is None:
        paused = next((o for o in engine.step() if o.paused), None)
    # Paused at the real end marker, with the argument whole.
    assert paused.outputs[0].text == call
    assert [(c.name, c.arguments, c.error) for c in paused.outputs[0].tool_calls] == [("echo", args, None)]
    content, calls = parser.find_calls("a " + call + " b")
    assert content == "a  b" and [(c.arguments, c.error) for c in calls] == [(args, None)]
    engine.abort_request("r")


def test_resume_with_a_new_constraint_compiles_off_the_engine_thread(ckpt):
    engine = make_engine(ckpt)
    eos = engine.model_config.eos_token_ids[0]
    engine.executor.execute = ScriptedModel(engine, engine.encode("Hello.") + [eos])
    aengine = AsyncLLMEngine(engine)
    backend = engine.grammars
    compiled_on: list[threading.Thread] = []
    real_compile = backend.compile

    def spy(spec):
        compiled_on.append(threading.current_thread())
        return real_compile(spec)
    backend.compile = spy
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}

    async def scenario():
        params = SamplingParams(max_tokens=50, pause_on_stop=True)
        gen = aengine.generate(EngineRequest(engine.encode("hi"), params, "s"))
        async for out in gen:
            if out.paused:
                aengine.detach("s")
                break
        await gen.aclose()
        new = SamplingParams(max_tokens=20, structured=StructuredSpec.json_schema(schema), pause_on_stop=True)
        gen = aengine.continue_request("s", engine.encode(" next"), new)
        async for out in gen:
            if out.paused:
                aengine.detach("s")
                break
        await gen.aclose()
        grammar = await aengine.run_sync(lambda e: e.scheduler.state.requests["s"].grammar)
        aengine.call(Abort("s"))
        await aengine.shutdown()
        return grammar

    grammar = asyncio.run(scenario())
    assert grammar is not None and grammar.spec == StructuredSpec.json_schema(schema)
    assert compiled_on and aengine.engine_thread.thread not in compiled_on


def test_the_grammar_backend_is_built_once_under_concurrency(ckpt, monkeypatch):
    import segue.structured.backend as backend_module
    engine = make_engine(ckpt)
    real_init = backend_module.GrammarBackend.__init__

    def slow_init(self, *args):
        time.sleep(0.05)  # widen the window in which a second thread could build its own
        real_init(self, *args)
    monkeypatch.setattr(backend_module.GrammarBackend, "__init__", slow_init)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(engine.grammars)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4 and len({id(b) for b in seen}) == 1
    # Every end-of-turn token of the model's generation config may end a constrained answer.
    assert seen[0].eos_token_ids == tuple(engine.model_config.eos_token_ids)

"""Server pieces without a model: chat rendering for templates with and without tool support, the
session store, and the tool_choice prefill parser."""
from __future__ import annotations

from typing import Any

import pytest

from conftest import default_tokenizer
from segue.program.registry import scoped_program_id
from segue.server.errors import APIError
from segue.server.request_bodies import ChatMessage
from segue.server.sessions import HeldConversation, HeldRequest, OutputMark, SessionStore
from segue.server.templating import ChatRenderer

# A small template written for these tests in the Hermes style: tools in the system turn, calls
# rendered from `tool_calls`, results as user turns wrapped in <tool_response>.
NATIVE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMING = NATIVE.replace("{{ m.content }}{% for", "{{ m.content | trim }}{% for")
TOOL = {"type": "function", "function": {"name": "calc", "description": "math",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
RESULT = [{"role": "tool", "tool_call_id": "call_1", "name": "calc", "content": "5"}]


def renderer(template: str | None) -> ChatRenderer:
    tok = default_tokenizer()
    template = template or tok.chat_template

    def apply(messages: list[dict], add_generation_prompt: bool, tools: Any) -> str:
        return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    return ChatRenderer(apply, template)


def assistant_with_call() -> ChatMessage:
    return ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]})


def test_template_without_tool_support_gets_a_system_prompt() -> None:
    r = renderer(None)  # the default model's (SmolLM2) template ignores tools=
    assert not r.renders_tools() and not r.native_tool_calls
    user = [{"role": "user", "content": "hi"}]
    text = r.render(user, [TOOL])
    assert text.startswith("<|im_start|>system\nYou can call functions") and '"name": "calc"' in text
    with_system = r.render([{"role": "system", "content": "Be brief."}] + user, [TOOL])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert r.continuation(user, CALL, RESULT, [TOOL]) == \
        "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # A call in the history goes back into the content, as the model wrote it.
    assert r.template_message(assistant_with_call())["content"] == \
        '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'


def test_template_with_tool_support() -> None:
    r = renderer(NATIVE)
    assert r.renders_tools() and r.native_tool_calls
    user = [{"role": "user", "content": "hi"}]
    text = r.render(user, [TOOL])
    assert text.startswith("<|im_start|>system\nTools:") and '"name": "calc"' in text and "You can call" not in text
    generated = "Sure. " + CALL
    suffix = r.continuation(user, generated, RESULT, [TOOL])
    assert suffix.startswith("<|im_end|>") and "<tool_response>5</tool_response>" in suffix
    # Held context + suffix is exactly the conversation as the template renders it.
    assert r.render(user, [TOOL]) + generated + suffix == \
        r.render(user + [{"role": "assistant", "content": generated}] + RESULT, [TOOL])
    msg = r.template_message(assistant_with_call())
    assert msg["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"x": 1}}
    # A template that trims content still yields the text after the (held) generated text.
    assert renderer(TRIMMING).continuation(user, "Sure. " + CALL + "\n", RESULT, [TOOL]) == \
        suffix.replace(generated, "")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def held(rid: str) -> HeldRequest:
    return HeldRequest(rid, [1, 2], HeldConversation([], "", []), OutputMark(), None)


def test_session_store() -> None:
    aborted: list[str] = []
    forgotten: list[str] = []
    clock = Clock()
    store = SessionStore(aborted.append, ttl_s=10, max_sessions=2, clock=clock, forget_program=forgotten.append)
    s = store.create("tenant-a")
    store.hold(s, held("r1"))
    store.checkin(s)
    with pytest.raises(APIError) as info:
        store.checkout(s.session_id, "tenant-b")
    assert info.value.status_code == 404 and info.value.code == "session_not_found"
    assert store.checkout(s.session_id, "tenant-a") is s
    with pytest.raises(APIError) as info:
        store.checkout(s.session_id, "tenant-a")
    assert info.value.status_code == 409
    # Closing a busy session aborts the turn's request; a request held afterwards is dropped too.
    s.active_request_id = "r2"
    store.close(s.session_id, "tenant-a")
    store.hold(s, held("r3"))
    store.checkin(s)
    assert aborted == ["r2", "r1", "r3"] and len(store) == 0
    # Unbound from its engine replica, under the program name its tenant's requests used.
    assert scoped_program_id("tenant-a", s.session_id) in forgotten

    idle, busy = store.create(None), store.create(None)
    store.hold(idle, held("r4"))
    store.checkin(idle)
    with pytest.raises(APIError) as info:
        store.check_capacity()
    assert info.value.status_code == 429
    clock.now = 11.0
    store.check_capacity()  # makes room by expiring the idle one; the busy one is kept
    assert aborted[-1] == "r4" and len(store) == 1 and store.counts() == {"held": 0, "idle": 1}
    assert forgotten[-1] == idle.session_id
    store.checkin(busy)
    store.close_all()
    assert len(store) == 0

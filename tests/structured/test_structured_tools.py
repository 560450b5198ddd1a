"""Tool-calling grammars beyond the basics (test_structured.py): schemas with keywords the grammar
library does not enforce, an answer format beside tools, constraints after resumes, every
end-of-turn token, and closing before the context window ends. Tokenizer only, no weights."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import default_tokenizer
from segue.model.sampler import sample
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.structured import StructuredSpec
from segue.structured.backend import GrammarBackend
from segue.structured.bitmask import fill_bitmask
from segue.structured.tool_grammar import auto_grammar, forced_grammar, no_call_grammar

EOS, EOT = 2, 0  # <|im_end|>, and a second end-of-turn token as in a generation config's list
SET_TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                      "uniqueItems": True, "maxItems": 3}},
            "required": ["tags"]}
NOT_NULL = {"type": "object", "properties": {"v": {"not": {"type": "null"}, "type": "integer"}}, "required": ["v"]}
IF_THEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tok = default_tokenizer()
    return GrammarBackend(tok, len(tok), (EOS, EOT))


def encode(text: str) -> list[int]:
    return default_tokenizer().encode(text, add_special_tokens=False)


def accepts(backend: GrammarBackend, spec: StructuredSpec, text: str) -> bool:
    m = backend.matcher(spec, 0).matcher
    return m.consume_tokens(encode(text)) and m.is_accepting()


def allowed(mask: torch.Tensor, row: int = 0) -> set[int]:
    return {t for t in range(mask.shape[1] * 32) if (int(mask[row, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("schema", [SET_TAGS, NOT_NULL, IF_THEN])
def test_schemas_with_unenforced_keywords_compile(backend: GrammarBackend, schema: dict) -> None:
    # pydantic's set[str] is uniqueItems; `not` and if/then are valid JSON Schema as well.
    tools = [tool("t", schema)]
    for spec in (auto_grammar(tools), forced_grammar(tools), StructuredSpec.json_schema(schema)):
        backend.compile(spec)
    assert accepts(backend, StructuredSpec.json_schema(SET_TAGS), '{"tags": ["a", "b"]}')


def test_an_invalid_schema_is_still_refused(backend: GrammarBackend) -> None:
    with pytest.raises(InvalidRequestError):
        backend.compile(forced_grammar([tool("t", {"type": "object", "properties": {"a": {"type": 3}}})]))


def test_answer_format_beside_tools_is_a_call_or_the_format(backend: GrammarBackend) -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = auto_grammar([tool("t", NOT_NULL)], answer)
    assert accepts(backend, spec, '{"ok": true}')
    assert accepts(backend, spec, '<tool_call>{"name": "t", "arguments": {"v": 3}}</tool_call>')
    assert not accepts(backend, spec, "Sure, here it is.")
    assert not accepts(backend, spec, '{"ok": 1}')
    forced = forced_grammar([tool("t", NOT_NULL)], answer=answer)
    assert forced.after_resume == spec and spec.next_after_resume is spec


def test_auto_and_none_hold_after_every_resume(backend: GrammarBackend) -> None:
    tools = [tool("t", NOT_NULL)]
    forced = forced_grammar(tools)
    g = backend.matcher(forced, start=0)
    specs = []
    for round_ in range(1, 4):
        g = g.resumed(start=10 * round_)
        assert g is not None and g.start == 10 * round_ and g.num_consumed == 0
        specs.append(g.spec)
    assert specs == [auto_grammar(tools)] * 3
    assert backend.matcher(no_call_grammar(), 0).resumed(5).spec == no_call_grammar()
    assert backend.matcher(StructuredSpec.json_object(), 0).resumed(5) is None


def test_every_end_of_turn_token_ends_a_finished_answer(backend: GrammarBackend) -> None:
    g = backend.matcher(StructuredSpec.json_schema(NOT_NULL), start=0)
    out = encode('{"v": 12}')
    mask, _ = fill_bitmask([g], [out], len(default_tokenizer()))
    assert {EOS, EOT} <= allowed(mask)
    # The second one is consumed as the end, not as a token the grammar rejects.
    g.sync(out + [EOT])
    assert not g.failed and g.matcher.is_stopped()


def test_failed_and_closing_rows_allow_every_end_token(backend: GrammarBackend) -> None:
    g = backend.matcher(StructuredSpec.json_schema(NOT_NULL), start=0)
    g.failed = True
    mask, _ = fill_bitmask([g], [[]], len(default_tokenizer()))
    assert allowed(mask) == {EOS, EOT}


def _free_string_run(backend: GrammarBackend, output_limit: int, prompt_room: int) -> str:
    """Sample under a schema with an unbounded string, with closing tokens penalized (a small
    model stuck in a string) and max_tokens far away: only the context window ends the answer."""
    tok = default_tokenizer()
    vocab = len(tok)
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    g = backend.matcher(StructuredSpec.json_schema(schema), start=0, output_limit=output_limit)
    gen = torch.Generator().manual_seed(0)
    bias = torch.zeros(vocab)
    bias[[t for t in range(vocab) if any(c in tok.decode([t]) for c in '"}')]] = -8.0
    bias[[EOS, EOT]] = -8.0
    out: list[int] = []
    params = SamplingParams(temperature=0.7, max_tokens=10_000)
    while len(out) < prompt_room:
        mask = fill_bitmask([g], [out], vocab, [10_000 - len(out)])
        token = sample(torch.randn(1, vocab, generator=gen) + bias, [params], [len(out)], mask)[0].token_id
        if token in (EOS, EOT):
            break
        out.append(token)
    return tok.decode(out)


def test_an_answer_the_context_window_cuts_is_steered_to_close(backend: GrammarBackend) -> None:
    assert set(json.loads(_free_string_run(backend, output_limit=40, prompt_room=40))) == {"title"}


def test_a_set_of_enum_values_never_repeats_one(backend: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "array", "uniqueItems": True,
                                                     "items": {"enum": ["uv", "wind", "sun"], "type": "string"}}},
              "required": ["s"]}
    spec = StructuredSpec.json_schema(schema)
    for good in ('{"s": []}', '{"s": ["uv", "wind"]}', '{"s": ["uv", "wind", "sun"]}', '{"s": ["sun"]}'):
        assert accepts(backend, spec, good), good
    for bad in ('{"s": ["wind", "wind"', '{"s": ["uv", "wind", "sun", "uv"'):
        assert not backend.matcher(spec, 0).matcher.consume_tokens(encode(bad)), bad

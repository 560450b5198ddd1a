"""Which keywords of a JSON schema the grammar cannot enforce, asked of llguidance itself.

Schemas are compiled leniently (tool_grammar.JSON_OPTIONS): a keyword llguidance does not implement
(`not`, `if`/`then`, `uniqueItems` beyond a small enum set, `contains`, `oneOf`'s exclusivity, ...)
is left out of the grammar. OpenAI's contract for `strict: true` is that the output matches the
schema, and a schema it cannot guarantee is refused at request time, naming the keyword; so a
strict schema is compiled once more without leniency and the keywords llguidance reports are
refused. Asking llguidance rather than keeping a list here means the answer follows the version
installed. No tokenizer is needed (the check is on the grammar, not on a vocabulary), so this
costs a schema translation, ~1 ms, and it is cached by schema text.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from segue.structured.tool_grammar import with_json_options

# llguidance's messages: 'Unimplemented keys: ["not"]', and oneOf's own.
_KEYS_RE = re.compile(r'Unimplemented keys: (\[[^\]]*\])')
_ONE_OF = "oneOf constraints are not supported"


@functools.lru_cache(maxsize=256)
def _unenforced(schema_text: str) -> tuple[str, ...]:
    from llguidance import LLMatcher

    schema = with_json_options(json.loads(schema_text))
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema["x-guidance"], "lenient": False}}
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except ValueError as e:
        messages = [str(e)]
    else:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
        if not is_error:
            return ()
    keys: list[str] = []
    for message in messages:
        for found in _KEYS_RE.findall(message):
            keys += [k for k in json.loads(found) if k not in keys]
        if _ONE_OF in message and "oneOf" not in keys:
            keys.append("oneOf")
    if not keys:
        # An error that names no keyword: the lenient compile reports it as a 400 of its own.
        return ()
    return tuple(keys)


def unenforced_keywords(schema: dict[str, Any] | bool) -> list[str]:
    """The schema's keywords the grammar leaves out (in llguidance's order), [] when it enforces
    them all. The schema is taken as Segue compiles it (tool_grammar.with_json_options), so a
    small enum set under `uniqueItems`, which is spelled out, counts as enforced."""
    return list(_unenforced(json.dumps(schema, sort_keys=True)))

"""EngineCall values (segue/engine/calls.py): plain data that pickles into a Ray actor and back,
each with the answer a pool gives for a request no replica holds."""
from __future__ import annotations

import asyncio
import math
import pickle

import pytest

from segue.engine.calls import Abandon, Abort, Answered, EngineCall, ExpectResume, GetStats, HeldTokens, RequestCall
from segue.engine.stats import EngineStats

CALLS: list[EngineCall] = [Abort("r"), HeldTokens("r"), ExpectResume("r", 2.5), ExpectResume("r", math.inf),
                           Abandon("r"), GetStats()]


@pytest.mark.parametrize("op", CALLS, ids=repr)
def test_calls_pickle_unchanged(op: EngineCall) -> None:
    again = pickle.loads(pickle.dumps(op))
    assert again == op and type(again) is type(op)


def test_answers_for_a_request_nobody_holds() -> None:
    assert [op.answer_if_absent() for op in CALLS if isinstance(op, RequestCall)] == [None, None, False, False, False]


def test_calls_are_values() -> None:
    assert ExpectResume("r", 1.0) == ExpectResume("r", 1.0) != ExpectResume("r", 2.0)
    assert hash(Abandon("r")) == hash(Abandon("r")) and Abandon("r") != Abort("r")
    with pytest.raises(AttributeError):
        Abandon("r").request_id = "other"  # type: ignore[misc]


def test_answered_needs_no_loop_until_awaited() -> None:
    ready = Answered([1, 2])  # made outside any event loop, and never awaited: no warning

    async def read() -> list[int]:
        return await Answered([1, 2])
    assert ready.value == [1, 2] and asyncio.run(read()) == [1, 2]


def test_stats_answer_crosses_pickle() -> None:
    stats = EngineStats.merge([])
    assert pickle.loads(pickle.dumps(stats)) == stats

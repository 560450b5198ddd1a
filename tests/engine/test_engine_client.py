"""The EngineClient seam: both implementations offer every method of the protocol, with its
parameters; a new request crosses it as one picklable EngineRequest; a pool's stats are its
replicas' merged field by field."""
from __future__ import annotations

import inspect
import pickle

import pytest

from segue.cluster.pool import EnginePool
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.engine_request import EngineRequest, RequestHints
from segue.engine.protocol import EngineClient
from segue.engine.stats import AccuracySnapshot, DurationSummary, EngineStats, PausedKV
from segue.sampling_params import SamplingParams
from segue.tools.call_format import HERMES, ToolCallFormat


def _members(cls: type) -> list[str]:
    return [name for name in vars(cls) if not name.startswith("_")]


@pytest.mark.parametrize("impl", [AsyncLLMEngine, EnginePool])
def test_implements_every_method_with_its_parameters(impl: type) -> None:
    for name in _members(EngineClient):
        wanted, got = inspect.getattr_static(EngineClient, name), inspect.getattr_static(impl, name, None)
        assert got is not None, f"{impl.__name__} lacks EngineClient.{name}"
        if isinstance(wanted, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} must be a property"
            continue
        w, g = inspect.signature(wanted), inspect.signature(got)
        assert list(w.parameters) == list(g.parameters), f"{impl.__name__}.{name}{g} is not EngineClient.{name}{w}"
        assert inspect.iscoroutinefunction(wanted) == inspect.iscoroutinefunction(got), f"{name}: async or not"


def test_a_request_crosses_the_seam_as_one_value() -> None:
    """generate takes one EngineRequest; it pickles (a Ray replica receives it) with its hints and
    its tool-call format by value: no parser object crosses the seam."""
    assert list(inspect.signature(EngineClient.generate).parameters) == ["self", "request"]
    request = EngineRequest([1, 2, 3], SamplingParams(max_tokens=4), "r-1",
                            hints=RequestHints(priority=2, program_id="p", task_group="g"), tool_format=HERMES)
    assert pickle.loads(pickle.dumps(request)) == request
    assert request.tool_format == ToolCallFormat("<tool_call>", "</tool_call>")
    assert EngineRequest("hi", SamplingParams()).hints == RequestHints()


def test_stats_merge_field_by_field() -> None:
    tool = lambda count, mean: DurationSummary("search", count, mean, mean, mean, mean, mean)  # noqa: E731
    a = EngineStats(running=1, device_blocks_used=3, device_blocks_total=10, steps=4,
                    paused_kv={"swap": PausedKV(1, 0, 4)}, waste={"recompute_gbs": 1.5},
                    tools={"search": tool(2, 1.0)},
                    predictors={"output_len": AccuracySnapshot("output_len", 9, 3.0, ((5.0, 0.5),))})
    b = EngineStats(running=2, waiting=5, device_blocks_used=1, device_blocks_total=10, steps=3,
                    paused_kv={"swap": PausedKV(2, 1, 0), "preserve": PausedKV(1, 2, 0)},
                    waste={"recompute_gbs": 0.5}, tools={"search": tool(7, 3.0)})
    merged = EngineStats.merge([a, b])
    assert (merged.running, merged.waiting, merged.steps) == (3, 5, 7)
    assert (merged.device_blocks_used, merged.device_blocks_total) == (4, 20)
    assert merged.paused_kv == {"swap": PausedKV(3, 1, 4), "preserve": PausedKV(1, 2, 0)}
    assert merged.waste == {"recompute_gbs": 2.0}
    assert merged.tools["search"].count == 7  # quantiles do not add: the fuller window speaks
    assert merged.predictors["output_len"].count == 9
    assert EngineStats.merge([]) == EngineStats()

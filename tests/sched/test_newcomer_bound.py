"""The newcomer bound (sched/newcomers.py): a new agent's first turn waits behind running agents'
histories no longer than `max_newcomer_wait_s` of the scheduler's clock; past it, it goes ahead of
later turns and releases retained histories, only as many as let it in. KV invariants every step."""
from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from sched_helpers import BS, SLOW, finish, step, turn
from segue.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from segue.engine.args import add_engine_args, engine_config_from_args
from segue.kv.manager import KVCacheManager
from segue.request import Request, RequestStatus
from segue.sched.cost_model import CostModel
from segue.sched.interception import make_interception_policy
from segue.sched.newcomers import is_later_turn, is_newcomer, is_overdue, newcomers_first
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler
from segue.sim.agent_replay import run_agents
from segue.sim.engine import make_sim_engine
from segue.sim.workloads.agents import AGENT_PRESETS, draw_agents

# SLOW recompute (100 ms a token) puts thrashing.py's own bound (a newcomer waits as long as
# recomputing the history it would take) at seconds, so the newcomer bound is what ends the wait.


def make_scheduler(num_blocks: int, wait: float | None) -> Scheduler:
    kv = KVCacheManager(BS, num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_newcomer_wait_s=wait)
    return Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=num_blocks * BS, cost=SLOW)


# ---- configuration -------------------------------------------------------------------------
def _config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_the_flag_sets_the_bound_in_seconds_or_turns_it_off():
    assert _config().scheduler.max_newcomer_wait_s == SchedulerConfig.max_newcomer_wait_s is not None
    assert _config("--max-newcomer-wait-s", "2.5").scheduler.max_newcomer_wait_s == 2.5
    assert _config("--max-newcomer-wait-s", "none").scheduler.max_newcomer_wait_s is None
    with pytest.raises(ConfigError):
        SchedulerConfig(max_newcomer_wait_s=-1.0).validate()
    with pytest.raises(SystemExit):
        _config("--max-newcomer-wait-s", "soon")


# ---- the scheduler -------------------------------------------------------------------------
def _order(sched: Scheduler, now: float) -> list[str]:
    state = sched.state
    state.now = now
    return [r.request_id for r in newcomers_first(state, state.policy.order(state.waiting, now))]


@pytest.mark.parametrize("wait", [1.0, None])
def test_an_overdue_newcomer_goes_ahead_of_later_turns_sent_after_it(wait):
    sched = make_scheduler(64, wait)
    a0, b0 = turn("a0", list(range(22)), 0.0), turn("b0", list(range(500, 522)), 0.0)
    now = finish(sched, a0, 0.0)                                      # agents A and B, first turns done
    now = finish(sched, b0, now)
    sched.state.now = now
    a1 = turn("a1", a0.all_token_ids + [60, 61], now)                 # A's next turn, before the newcomer
    sched.add_request(a1)
    newcomer = turn("n", list(range(300, 320)), now + 0.1)
    sched.add_request(newcomer)
    sched.state.now = now + 0.5
    b1 = turn("b1", b0.all_token_ids + [60, 61], now + 0.5)          # B's next turn, after it
    sched.add_request(b1)
    assert is_newcomer(sched.state, newcomer) and is_later_turn(sched.state, a1) and is_later_turn(sched.state, b1)
    assert not is_newcomer(sched.state, b1) and not is_later_turn(sched.state, newcomer)
    # Within the bound later turns queue by their agent's arrival (program-level FCFS).
    assert _order(sched, now + 0.5) == ["a1", "b1", "n"] and not is_overdue(sched.state, newcomer)
    # Past it (on the clock the scheduler is given) the newcomer goes ahead of B's turn, sent after
    # it, not of A's, sent before; without a bound, never.
    assert _order(sched, now + 1.1) == (["a1", "n", "b1"] if wait is not None else ["a1", "b1", "n"])
    assert is_overdue(sched.state, newcomer) == (wait is not None)


def test_newcomers_first_reads_the_queue_only_as_far_as_admission_goes():
    # Under overload thousands wait behind a later turn; a step that admits two must not read
    # (nor sort) all of them to find the overdue newcomers.
    sched = make_scheduler(64, 1.0)
    a0 = turn("a0", list(range(22)), 0.0)
    now = finish(sched, a0, 0.0)
    sched.state.now = now
    early = turn("early", list(range(300, 320)), now)                 # overdue by the time below
    sched.add_request(early)
    later = turn("a1", a0.all_token_ids + [60, 61], now + 5.0)        # A's next turn, sent after it
    sched.add_request(later)
    crowd = [turn(f"c{i}", [1000 + i, 2000 + i], now + 5.0 + i * 1e-3) for i in range(500)]
    for req in crowd:
        sched.add_request(req)
    state = sched.state
    state.now = now + 5.5
    ordered = [later, *crowd, early]                                  # the later turn first, by its agent
    pulled = 0

    def counted():
        nonlocal pulled
        for req in ordered:
            pulled += 1
            yield req

    got = newcomers_first(state, counted())
    assert [next(got).request_id, next(got).request_id, next(got).request_id] == ["early", "a1", "c0"]
    assert pulled <= 3, f"read {pulled} of {len(ordered)} queued requests for three"
    # Read to the end, each request comes once.
    assert sorted(r.request_id for r in newcomers_first(state, ordered)) == sorted(r.request_id for r in ordered)


def test_the_index_of_first_turns_stays_within_twice_what_is_live():
    sched = make_scheduler(64, 1.0)
    for i in range(1000):
        req = turn(f"r{i}", [i + 1, i + 2], float(i))
        sched.add_request(req)
        sched.abort_request(req.request_id)
    live = turn("live", [5, 6], 1000.0)
    sched.add_request(live)
    assert len(sched.state.first_turns) <= 2 * 1 + 64
    assert list(sched.state.first_turns.arrived_by(2000.0)) == [live]


def _pressure(sched: Scheduler) -> tuple[float, list[Request]]:
    """Agents A and B finish a turn each (6 blocks retained apiece); a runner keeps the pool busy."""
    now = finish(sched, turn("a0", list(range(22)), 0.0), 0.0)
    now = finish(sched, turn("b0", list(range(500, 522)), now), now)
    assert sched.state.kv.num_retained_blocks == 12
    runner = turn("r", [90, 91], now, max_tokens=200)                 # never alone in the pool
    sched.add_request(runner)
    step(sched, now)
    return now + 0.1, [runner]


@pytest.mark.parametrize("wait", [0.5, None])
def test_an_overdue_newcomer_releases_one_history_and_starts(wait):
    # 20 blocks: 12 retained, the runner's 1-2; the newcomer needs 8 (28 prompt tokens + output).
    sched = make_scheduler(20, wait)
    now, _ = _pressure(sched)
    newcomer = turn("n", list(range(200, 228)), now)
    sched.add_request(newcomer)
    t0 = now
    while newcomer.num_computed_tokens == 0:
        step(sched, now)
        now += 0.1
        assert now - t0 < 10.0, "the newcomer never started"
    waited = now - 0.1 - t0
    if wait is not None:
        # Started at the first step past the bound, on one released history, not both.
        assert wait <= waited <= wait + 0.15
        assert sched.state.kv.num_retained_blocks == 6
    else:
        # Only thrashing.py's bound: the recompute time of what it takes (6 blocks at 100 ms a token).
        assert waited >= 2.0
    run = now
    while not newcomer.is_finished:
        step(sched, run)
        run += 0.1
    assert newcomer.status is RequestStatus.FINISHED_LENGTH and sched.state.num_preemptions_total == 0


@pytest.mark.parametrize("turn_end", [False, True], ids=["tool-call", "session-turn-end"])
def test_a_preserved_paused_context_survives_an_overdue_newcomer(turn_end):
    # The bound is a timer: it may take idle agents' retained histories, never a context the
    # interception policy chose to keep (a tool call's, a session's turn waiting on its client).
    kv = KVCacheManager(BS, 20)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_newcomer_wait_s=0.5)
    sched = Scheduler(cfg, kv, make_policy("fcfs"), max_model_len=20 * BS, cost=SLOW,
                      interception=make_interception_policy("preserve"))
    runner = turn("r", [90, 91], 0.0, max_tokens=200)                # never alone in the pool
    paused = turn("p", list(range(100, 144)), 0.0, max_tokens=20)    # 11 blocks, then a tool call
    for req in (runner, paused):
        sched.add_request(req)
    step(sched, 0.0)
    sched.intercept_request(paused, 0.1, tool="search", turn_end=turn_end)
    private = kv.num_private_blocks_of("p")
    assert private >= 11
    newcomer = turn("n", list(range(200, 228)), 0.1)                  # 8 blocks: more than are free
    sched.add_request(newcomer)
    now = 0.1
    while now < 3.0:                                                 # well past the 0.5 s bound
        step(sched, now)
        now += 0.1
        assert kv.num_private_blocks_of("p") == private, "the newcomer bound released a paused context"
    assert is_overdue(sched.state, newcomer) and newcomer.num_computed_tokens == 0
    assert paused.interception is not None and paused.interception.disposition.value == "preserve"
    # Its whole context is still computed on the device: a resume recomputes nothing.
    assert kv.held("p").device * BS >= paused.num_computed_tokens == paused.num_tokens - 1


# ---- the simulator: pressure preset, small ------------------------------------------------
PRESSURE = AGENT_PRESETS["pressure"]
SMALL_PRESSURE = replace(PRESSURE, num_agents=16, arrival_window_s=16.0, seed=1)
# The default (CPU) cost model run twice as slow, as on a machine whose steps take longer.
SLOW_CPU = CostModel().scaled(2.0)
BUDGET = 2048


def _sim(mode: str, wait: float | None) -> dict:
    config = EngineConfig(cache=CacheConfig(block_size=16, kv_cache_tokens=3072, swap_space_tokens=65536),
                          scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_newcomer_wait_s=wait))
    engine = make_sim_engine(SLOW_CPU, 3072, config, max_model_len=4096)
    res = run_agents(engine, SMALL_PRESSURE, draw_agents(SMALL_PRESSURE), mode, engine.clock.advance_to,
                     check_invariants=True)
    assert len(res.busy_s) == SMALL_PRESSURE.num_agents and not res.stalled
    return res.to_dict()


@pytest.mark.parametrize("mode", ["plain", "sessions"])
def test_no_first_turn_waits_much_past_the_bound_in_the_simulator(mode):
    bound = 1.0
    # A first turn's TTFT is its wait plus the step it waits out and its own prefill step.
    slack = 2 * SLOW_CPU.t_fwd(BUDGET)
    bounded = _sim(mode, bound)
    assert max(bounded["first_turn_ttft_s"]) <= bound + slack
    unbounded = _sim(mode, None)
    assert max(unbounded["first_turn_ttft_s"]) > 3 * (bound + slack)
    for row in (bounded, unbounded):
        assert len(row["first_turn_ttft_s"]) == SMALL_PRESSURE.num_agents
        assert len(row["later_turn_ttft_s"]) == sum(a.num_turns - 1 for a in draw_agents(SMALL_PRESSURE))

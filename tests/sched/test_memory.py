"""Who gives device memory to whom (sched/memory_table.py), and the walk that follows the table
(sched/memory.py): each site's sources in order, the conditions that skip one, the rule that
ends a walk, and on a real scheduler the first source used before the next."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sched_helpers import BS, SLOW, finish, step, turn
from segue.config import SchedulerConfig
from segue.kv.manager import KVCacheManager
from segue.request import RequestStatus
from segue.sched import memory
from segue.sched.interception import make_interception_policy
from segue.sched.memory_table import FIRST_GIVER_ENDS, SOURCES, Ask, Site, Source, When
from segue.sched.output import SchedulerOutput
from segue.sched.policies import make_policy
from segue.sched.scheduler import Scheduler

S, A, W = Source, Ask, When
# The eight orders the scheduler had spread over five files, written out once more by hand: a
# change to who gives memory to whom must change this too.
EXPECTED = {
    Site.RUNNING: [(S.PAUSED, A.NEED, W.ALWAYS), (S.HISTORIES, A.NEED, W.ALWAYS),
                   (S.PREEMPT_RUNNING, A.NEED, W.ALWAYS)],
    Site.ADMISSION: [(S.PAUSED, A.NEED, W.ALWAYS), (S.HISTORIES, A.SHORTFALL, W.IDLE_AND_SHORT),
                     (S.DISCARD_WAITING, A.NEED, W.NOTHING_GIVEN)],
    Site.ADMISSION_PREEMPTIVE: [(S.PAUSED, A.NEED, W.ALWAYS), (S.HISTORIES, A.SHORTFALL, W.IDLE_AND_SHORT),
                                (S.SWAP_BELOW, A.NEED, W.SHORT)],
    Site.HOLDER: [(S.PAUSED, A.NEED, W.ALWAYS), (S.SWAP_BELOW, A.NEED, W.SHORT),
                  (S.DISCARD_BELOW, A.NEED, W.HOST_FULL_AND_SHORT)],
    Site.IDLE_STEP: [(S.DISCARD_WAITING, A.NEED, W.ALWAYS)],
    Site.THRASHING: [(S.PAUSED, A.UNTIL_COVERED, W.ALLOWED), (S.HISTORIES, A.UNTIL_COVERED, W.ALLOWED)],
    Site.SWAP_IN: [(S.HISTORIES, A.SHORTFALL, W.SHORT)],
    Site.RESERVE: [(S.SWAP_LONGEST_WAITING, A.NEED, W.ALWAYS)],
}


@pytest.mark.parametrize("site", list(Site))
def test_each_site_takes_its_sources_in_order(site):
    assert [(s.source, s.ask, s.when) for s in SOURCES[site]] == EXPECTED[site]


def test_every_site_has_a_row_and_every_source_a_taker():
    assert set(SOURCES) == set(Site)
    assert set(memory._TAKE) == set(Source)
    assert {s.source for row in SOURCES.values() for s in row} == set(Source)
    assert FIRST_GIVER_ENDS == {Site.RUNNING}


# ---- the walk, with sources that only record ---------------------------------------------------
def _fake_sched(free: int = 0, host_free: int = 0) -> SimpleNamespace:
    counters = SimpleNamespace(num_free_blocks=free, has_host_tier=host_free > 0, num_free_host_blocks=host_free)
    return SimpleNamespace(kv=SimpleNamespace(counters=lambda: counters))


def _recording(monkeypatch, gives: set[Source] = frozenset(), in_flight: set[Source] = frozenset()) -> list:
    calls: list[tuple[Source, Ask]] = []

    def taker(source):
        def take(claim, ask):
            calls.append((source, ask))
            claim.in_flight = claim.in_flight or source in in_flight
            return source in gives
        return take
    monkeypatch.setattr(memory, "_TAKE", {s: taker(s) for s in Source})
    return calls


@pytest.mark.parametrize("site", list(Site))
def test_the_walk_tries_every_source_of_a_site_in_the_tables_order(monkeypatch, site):
    """Every condition holding and no source giving anything, a walk visits its whole row."""
    calls = _recording(monkeypatch)
    claim = memory.Claim(_fake_sched(), site, None, need=5, idle=True, allowed=frozenset(Source))
    memory._walk(claim)
    assert calls == [(s.source, s.ask) for s in SOURCES[site]]


def test_a_running_request_takes_one_source_at_a_time(monkeypatch):
    calls = _recording(monkeypatch, gives={Source.PAUSED, Source.HISTORIES})
    memory._walk(memory.Claim(_fake_sched(), Site.RUNNING, None, need=5))
    assert calls == [(Source.PAUSED, Ask.NEED)]


def test_admission_discards_only_when_nothing_else_gave(monkeypatch):
    calls = _recording(monkeypatch, gives={Source.PAUSED})
    memory._walk(memory.Claim(_fake_sched(), Site.ADMISSION, None, need=5, idle=True))
    assert [c[0] for c in calls] == [Source.PAUSED, Source.HISTORIES]


def test_admission_takes_histories_only_when_nothing_runs(monkeypatch):
    calls = _recording(monkeypatch)
    memory._walk(memory.Claim(_fake_sched(), Site.ADMISSION_PREEMPTIVE, None, need=5, idle=False))
    assert [c[0] for c in calls] == [Source.PAUSED, Source.SWAP_BELOW]


def test_a_holder_waits_for_swap_outs_instead_of_discarding(monkeypatch):
    calls = _recording(monkeypatch, in_flight={Source.SWAP_BELOW})
    memory._walk(memory.Claim(_fake_sched(), Site.HOLDER, None, need=5))
    assert [c[0] for c in calls] == [Source.PAUSED, Source.SWAP_BELOW]
    calls = _recording(monkeypatch)  # the host can take the rest: a later step's swap-out frees it
    memory._walk(memory.Claim(_fake_sched(free=1, host_free=4), Site.HOLDER, None, need=5))
    assert [c[0] for c in calls] == [Source.PAUSED, Source.SWAP_BELOW]


def test_nothing_is_taken_once_the_need_is_free(monkeypatch):
    calls = _recording(monkeypatch)
    memory._walk(memory.Claim(_fake_sched(free=5), Site.HOLDER, None, need=5))
    assert [c[0] for c in calls] == [Source.PAUSED]


def test_thrashing_takes_only_the_sources_its_caller_allows(monkeypatch):
    calls = _recording(monkeypatch)
    memory._walk(memory.Claim(_fake_sched(), Site.THRASHING, None, need=5, allowed=frozenset({Source.HISTORIES})))
    assert [c[0] for c in calls] == [Source.HISTORIES]


# ---- on a real scheduler -------------------------------------------------------------------------
def _scheduler(num_blocks: int, policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(BS, num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, agent_retention=True)
    return Scheduler(cfg, kv, make_policy(policy), max_model_len=num_blocks * BS, cost=SLOW,
                     interception=make_interception_policy("preserve"))


def test_a_running_request_takes_paused_contexts_then_histories_then_preempts():
    sched = _scheduler(24)
    state, kv = sched.state, sched.state.kv
    now = finish(sched, turn("a0", list(range(22)), 0.0), 0.0)      # a retained history
    runner = turn("r", [90, 91], now, max_tokens=60)
    paused = turn("p", list(range(100, 110)), now, max_tokens=10)
    for req in (runner, paused):
        sched.add_request(req)
    step(sched, now)
    sched.intercept_request(paused, now)
    assert kv.num_retained_blocks and kv.num_device_blocks_of("p")
    grow = state.kv.counters().num_free_blocks * BS + BS             # one block more than is free
    out = SchedulerOutput()
    assert memory.free_for_running(state, runner, grow, [runner], out) is None
    assert kv.num_private_blocks_of("p") == 0 and kv.num_retained_blocks  # paused first, alone
    assert memory.free_for_running(state, runner, grow, [runner], out) is None
    assert kv.num_retained_blocks == 0 and runner.status is RequestStatus.RUNNING  # then the history
    assert memory.free_for_running(state, runner, grow, [runner], out) is runner   # then preemption
    assert out.preempted == [runner] and runner.status is RequestStatus.PREEMPTED


def test_a_blocked_holder_takes_paused_contexts_before_discarding_holders_below():
    sched = _scheduler(16, policy="mlfq")
    state, kv = sched.state, sched.state.kv
    holder = turn("h", list(range(8)), 0.0, max_tokens=40)
    below = turn("b", list(range(50, 58)), 0.1, max_tokens=40)
    paused = turn("p", list(range(100, 108)), 0.2, max_tokens=40)
    for req in (holder, below, paused):
        sched.add_request(req)
    step(sched, 0.3)
    sched.intercept_request(paused, 0.3)
    for req in (holder, below):  # both wait holding their KV, as after losing a preemptive step
        state.running.remove(req)
        req.status = RequestStatus.WAITING
        state.waiting.append(req)
    assert kv.num_device_blocks_of("b") and kv.num_device_blocks_of("p")
    free = kv.counters().num_free_blocks
    out = SchedulerOutput()
    assert memory.free_for_holder(state, holder, (free + 1) * BS, out)
    assert kv.num_private_blocks_of("p") == 0 and kv.num_device_blocks_of("b")  # paused was enough
    free = kv.counters().num_free_blocks
    assert memory.free_for_holder(state, holder, (free + 1) * BS, out)  # no host tier: a discard
    assert kv.num_device_blocks_of("b") == 0 and below.num_preemptions == 1

"""The routers alone (pure Python): stickiness, prefix placement, task groups, load balance."""
from __future__ import annotations

import pytest

from segue.cluster.prefix_index import PrefixIndex, block_hashes
from segue.cluster.router import LoadReport, PlacementReason, RouteRequest
from segue.cluster.routers import make_router

BS = 4  # block size


def req(rid: str, tokens: list[int], **kw) -> RouteRequest:
    return RouteRequest(rid, tokens, **kw)


def distinct(seed: int, n: int = 12) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def affinity(n: int = 2, **kw):
    return make_router("affinity", n, block_size=BS, **kw)


def test_idle_requests_spread_by_load() -> None:
    r = affinity(3)
    picks = [r.route(req(f"r{i}", distinct(i))).replica for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert r.loads() == [2, 2, 2]
    assert r.placements[PlacementReason.LOAD] == 6


def test_reported_load_steers_new_requests() -> None:
    r = affinity(2)
    r.report_load(0, LoadReport(running=5, waiting=3))
    assert r.route(req("a", distinct(1))).replica == 1
    # confirm(): the replica's next report includes the request, so it stops counting twice.
    r.confirm("a")
    r.report_load(1, LoadReport(running=9))
    assert r.route(req("b", distinct(2))).replica == 0


def test_program_affinity_is_sticky_even_when_busy() -> None:
    r = affinity(2)
    first = r.route(req("t1", distinct(1), program_id="agent-7")).replica
    r.report_load(first, LoadReport(running=50))
    for turn in range(2, 6):
        d = r.route(req(f"t{turn}", distinct(turn), program_id="agent-7"))
        assert (d.replica, d.reason) == (first, PlacementReason.AFFINITY)
    other = r.route(req("x", distinct(99))).replica
    assert other != first  # unrelated work avoids the busy replica
    r.forget_program("agent-7")
    assert r.route(req("t9", distinct(9), program_id="agent-7")).reason is PlacementReason.LOAD


def test_shared_prefix_lands_together_and_deepest_match_wins() -> None:
    r = affinity(2)
    system = list(range(100, 108))  # two full blocks
    a = r.route(req("a", system + [1, 2, 3, 4]))
    b = r.route(req("b", list(range(500, 512))))  # unrelated: goes to the other, idle replica
    assert a.replica != b.replica
    c = r.route(req("c", system + [9, 9, 9, 9, 9]))
    assert (c.replica, c.reason, c.prefix_blocks) == (a.replica, PlacementReason.PREFIX, 2)
    # A prompt shorter than one block carries no prefix information.
    assert r.route(req("d", [100, 101])).reason is PlacementReason.LOAD


def test_prefix_yields_to_load_past_the_slack() -> None:
    r = affinity(2, load_slack=2)
    system = list(range(100, 108))
    home = r.route(req("a", system + [1])).replica
    r.report_load(home, LoadReport(running=1))  # load 1 + 1 unconfirmed: within the slack of the idle one
    assert r.route(req("b", system + [2])).reason is PlacementReason.PREFIX
    r.report_load(home, LoadReport(running=5))
    spill = r.route(req("c", system + [3]))
    assert spill.replica != home and spill.reason is PlacementReason.LOAD
    # Both replicas now hold the prefix: the next one picks the less loaded holder.
    d = r.route(req("d", system + [4]))
    assert (d.replica, d.reason) == (spill.replica, PlacementReason.PREFIX)


def test_task_group_stays_together() -> None:
    r = affinity(2)
    r.route(req("busy", distinct(0)))  # replica 0 has one request
    maps = [r.route(req(f"map{i}", distinct(10 + i), task_group="summarize-doc")) for i in range(4)]
    assert {d.replica for d in maps} == {1}
    assert [d.reason for d in maps[1:]] == [PlacementReason.TASK_GROUP] * 3
    # Program affinity outranks the task group.
    r.route(req("p1", distinct(50), program_id="prog"))
    d = r.route(req("p2", distinct(51), program_id="prog", task_group="summarize-doc"))
    assert d.reason is PlacementReason.AFFINITY


def test_salted_prompts_share_no_prefix() -> None:
    r = affinity(2)
    system = list(range(100, 108))
    a = r.route(req("a", system + [1], cache_salt="tenant-a"))
    b = r.route(req("b", system + [2], cache_salt="tenant-b"))
    assert b.reason is PlacementReason.LOAD and b.replica != a.replica
    assert r.route(req("c", system + [3], cache_salt="tenant-a")).replica == a.replica


def test_unavailable_replica_is_skipped_and_forgotten() -> None:
    r = affinity(2)
    system = list(range(100, 108))
    home = r.route(req("a", system, program_id="p")).replica
    r.set_available(home, False)
    for rid in ("b", "c"):
        d = r.route(req(rid, system, program_id="p"))
        assert d.replica != home
    r.set_available(1 - home, False)
    with pytest.raises(RuntimeError, match="no engine replica"):
        r.route(req("d", system))


def test_round_robin_ignores_locality() -> None:
    r = make_router("round_robin", 3)
    system = list(range(100, 108))
    picks = [r.route(req(f"r{i}", system, program_id="p")).replica for i in range(5)]
    assert picks == [0, 1, 2, 0, 1]
    r.set_available(2, False)
    assert [r.route(req(f"s{i}", system)).replica for i in range(3)] == [0, 1, 0]
    with pytest.raises(ValueError):
        make_router("random", 2)


def test_block_hashes_chain_and_stop_at_partial_blocks() -> None:
    a = block_hashes(list(range(10)), 4, 8)
    assert len(a) == 2  # the partial third block is not cached by the engine either
    b = block_hashes(list(range(8)) + [77, 78, 79, 80], 4, 8)
    assert b[:2] == a and len(b) == 3
    assert block_hashes([9] + list(range(1, 12)), 4, 8)[1] != b[1]  # a different first block changes every link
    assert len(block_hashes(list(range(100)), 4, 3)) == 3


def test_prefix_index_is_bounded_lru() -> None:
    index = PrefixIndex(capacity=4)
    old, new = block_hashes(distinct(1), 4, 8), block_hashes(distinct(2), 4, 8)
    index.insert(old, 0)
    index.insert(new, 1)
    assert len(index) == 4
    assert index.match(old, [0, 1]) == {}  # evicted: its first link went first
    assert index.match(new, [0, 1]) == {1: 3}
    assert index.match(new, [0]) == {}
    index.drop_replica(1)
    index.drop_replica(0)
    assert len(index) == 0

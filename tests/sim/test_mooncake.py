"""The Mooncake traces through Segue's KV manager: the packaged copy, the prefix-cache replay
(LRU vs reuse-keyed eviction, device and host tiers) and `segue sim --workload mooncake`."""
from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from segue.kv.manager import KVCacheManager
from segue.kv.reuse import CONTINUED, NEW, ReuseTracker
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sim.prefix_cache import CacheReplay, max_hit_rate, replay_hit_rate
from segue.sim.workloads.mooncake import PACKAGED_DIR, MooncakeRequest, load_mooncake, trace_path


@pytest.fixture(scope="module")
def head() -> list[MooncakeRequest]:
    return load_mooncake("conversation", limit=600)


def test_packaged_traces_match_their_notice(monkeypatch):
    monkeypatch.delenv("SEGUE_WORKLOADS", raising=False)
    notice = (PACKAGED_DIR / "NOTICE").read_text()
    assert (PACKAGED_DIR / "LICENSE").read_text().lstrip().startswith("Apache License")
    for name in ("conversation", "synthetic"):
        path = trace_path(name)
        assert path == PACKAGED_DIR / f"{name}_trace.jsonl.gz"
        assert path.stat().st_size < 2_000_000  # a package, not a data set
        digest = hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()
        assert f"sha256 {digest}  {name}_trace.jsonl" in notice


def test_segue_workloads_and_paths_override_the_packaged_trace(monkeypatch, tmp_path):
    rows = [{"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}]
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "conversation_trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("SEGUE_WORKLOADS", str(tmp_path))
    first, second = load_mooncake()
    assert (first.timestamp_s, second.timestamp_s, second.hash_ids) == (0.0, 1.5, (7, 8))
    assert load_mooncake(str(tmp_path / "mooncake" / "conversation_trace.jsonl"), limit=1)[0].input_length == 600
    with pytest.raises(FileNotFoundError):
        trace_path("synthetic")


def test_block_tokens_follow_the_hash_chain():
    a = MooncakeRequest(0.0, 1000, 1, (3, 4)).block_tokens(16)
    b = MooncakeRequest(0.0, 600, 1, (3, 5)).block_tokens(16)
    assert len(a) == 32 and len(b) == 19  # 1000 and 600 tokens in units of 32
    assert a[:16] == b[:16] and a[16:19] != b[16:19]


def test_replay_hits_are_the_trace_reuse_and_bounded_by_the_maximum(head):
    best = max_hit_rate(head)
    # The infinite cache finds every reusable full block: recount it from the hashes alone.
    seen: set[int] = set()
    hits = 0
    for r in head:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen and (k + 1) * 512 < r.input_length:
            k += 1
        hits += k * 512
        seen.update(r.hash_ids)
    assert best.device_hit_tokens == hits > 0
    for ev in ("lru", "segue"):
        small = replay_hit_rate(head, ev, 300)
        large = replay_hit_rate(head, ev, 3000)
        assert 0 < small.hit_rate <= large.hit_rate <= best.hit_rate


@pytest.mark.parametrize("eviction", ["lru", "segue"])
def test_host_tier_replay_keeps_kv_invariants(head, eviction):
    tiered = replay_hit_rate(head, eviction, 300, 1500, check=True)  # invariants after every request
    assert tiered.host_hit_tokens > 0
    assert tiered.hit_rate >= replay_hit_rate(head, eviction, 300).hit_rate


def test_segue_eviction_not_below_lru_on_a_slice(head):
    for blocks in (300, 1000, 3000):
        assert replay_hit_rate(head, "segue", blocks).hit_rate >= replay_hit_rate(head, "lru", blocks).hit_rate


def test_reuse_tracker_learns_returning_chains_and_shared_blocks():
    t = ReuseTracker(prior_gap_s=10.0)
    assert t.admit([1, 2], 0.0) == NEW
    keys = t.finish([1, 2], 3, NEW, 0.0)
    assert keys == sorted(keys, reverse=True) and max(keys) <= 0.0  # tail before head, all overdue
    assert t.admit([1, 2, 3], 5.0) == CONTINUED  # extends the finished chain ending in block 2
    assert t.reuse_distance(NEW) < 10.0 / 0.5  # one of one new chains came back after 5 s
    keys = t.finish([1, 2, 3], 3, CONTINUED, 5.0)
    # Blocks 1 and 2 were used twice 5 s apart: their own interval (shrunk toward the class's
    # distance) keeps them longer than block 3, which only its class speaks for.
    d = t.reuse_distance(CONTINUED)
    assert keys[0] == keys[1] == pytest.approx(5.0 - (5.0 + d) / 2) and keys[2] == pytest.approx(5.0 - d)
    assert keys[2] < keys[1]


def test_keyed_free_evicts_by_key_and_lru_free_by_age():
    kv = KVCacheManager(block_size=2, num_device_blocks=4)
    reqs = [Request(f"r{i}", [10 * i, 10 * i + 1], SamplingParams(), 0.0) for i in range(3)]
    for r in reqs:
        assert kv.allocate_slots(r, 2)
        r.num_computed_tokens = 2
        kv.cache_full_blocks(r)
    kv.set_clock(10.0)
    kv.free(reqs[0], [9.0])   # freed first, but expected back soonest
    kv.free(reqs[1], [1.0])
    kv.free(reqs[2], [5.0])
    # Three blocks: the free one, then two of the three cached, the furthest expected use first.
    assert kv.allocate_slots(Request("x", [99] * 6, SamplingParams(), 0.0), 6)
    assert [kv.device.lookup(*kv._hasher.key(r, 0)) is not None for r in reqs] == [True, False, False]
    kv.check_invariants()


def test_cache_replay_rejects_unknown_evictions():
    with pytest.raises(ValueError, match="eviction"):
        CacheReplay("fifo", 10)


def test_sim_mooncake_command(capsys):
    from segue.sim.run import main

    assert main(["--workload", "mooncake", "--num-requests", "120", "--capacities", "128k,512k",
                 "--latency-requests", "8", "--time-scale", "20", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Infinite cache" in out and "| 512k | device + host |" in out
    assert "| lru | 8/8 |" in out and "| reuse | 8/8 |" in out

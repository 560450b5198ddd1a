"""The measured tables' cache: processes on one machine (`--engines N` replicas) measure a key
once between them, and a table is reused at later starts until its key changes."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from segue.model import table_cache
from segue.model.table_cache import MeasuredTable

REPO = Path(__file__).resolve().parents[2]

# A replica's start: looks the table up, measuring it (slowly, noting that it did) when missing.
REPLICA = textwrap.dedent("""
    import logging, os, sys, time
    from segue.model import table_cache
    logging.basicConfig(level=logging.INFO)
    def measure(stale):
        with open(os.path.join(sys.argv[1], f"measured-{os.getpid()}"), "w"):
            pass
        time.sleep(3.0)  # long enough for the other replicas to arrive while it measures
        return table_cache.MeasuredTable({"k": "v"}, {"op": {"a": {"1": 1.0}}}, noisy=True)
    table = table_cache.cached_table("test", {"k": "v"}, table_cache.MeasuredTable, measure)
    print(table.timings_ms["op"]["a"]["1"])
""")


def test_replicas_starting_together_measure_once(tmp_path: Path) -> None:
    env = {"SEGUE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    replicas = [subprocess.Popen([sys.executable, "-c", REPLICA, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [r.communicate(timeout=120) for r in replicas]
    assert all(r.returncode == 0 for r in replicas), outs
    assert [o.strip() for o, _ in outs] == ["1.0"] * 3          # every replica has the table
    assert len(list(tmp_path.glob("measured-*"))) == 1          # one of them measured it
    assert sum("waiting for it" in err for _, err in outs) >= 1     # the others waited, not timed beside it


def test_threads_of_one_process_measure_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path))
    table_cache.clear_memo()
    measured = []

    def measure(stale: MeasuredTable | None) -> MeasuredTable:
        measured.append(stale)
        time.sleep(0.2)
        return MeasuredTable({"k": "v"}, {"op": {}})

    got: list[MeasuredTable] = []
    threads = [threading.Thread(target=lambda: got.append(
        table_cache.cached_table("test", {"k": "v"}, MeasuredTable, measure))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(measured) == 1 and len(got) == 4 and all(g is got[0] for g in got)
    table_cache.clear_memo()


def test_a_noisy_table_is_reused_until_its_key_changes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path))
    measured = []

    def measure(stale: MeasuredTable | None) -> MeasuredTable:
        measured.append(stale)
        return MeasuredTable({"k": str(len(measured))}, {"op": {}}, noisy=True,
                             ratios={"op": {"1": {"a/b": (0.5, 0.4, 0.6)}}})

    for _start in range(5):   # five starts, each a fresh process as far as the cache knows
        table_cache.clear_memo()
        table = table_cache.cached_table("test", {"k": "1"}, MeasuredTable, measure)
    assert len(measured) == 1 and table.noisy and table.ratios_at("op", 1) == {"a/b": (0.5, 0.4, 0.6)}
    table_cache.clear_memo()
    table_cache.cached_table("test", {"k": "2"}, MeasuredTable, measure)   # another key: measured
    assert len(measured) == 2
    table_cache.clear_memo()


def test_a_disturbed_table_is_checked_again_in_the_background_never_before_answering(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """A server's table with points timed while its CPUs were taken is served at once; a thread
    times it again later and saves it for the next start when it decides more points."""
    monkeypatch.setenv("SEGUE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(table_cache.RECHECK_ENV, "1")
    monkeypatch.setattr(table_cache, "RECHECK_DELAY_S", 0.05)
    table_cache.clear_memo()
    disturbed = MeasuredTable({"k": "v"}, {"op": {}}, noisy=True, ratios={"op": {"1": {}, "2": {"a/b": (1, 1, 1)}}})
    settled = MeasuredTable({"k": "v"}, {"op": {}}, ratios={"op": {"1": {"a/b": (0.5, 0.4, 0.6)},
                                                                    "2": {"a/b": (1, 1, 1)}}})
    results = [disturbed, settled]
    threads_seen: list[str] = []

    def measure(stale: MeasuredTable | None) -> MeasuredTable:
        threads_seen.append(threading.current_thread().name)
        return results.pop(0)

    first = table_cache.cached_table("test", {"k": "v"}, MeasuredTable, measure)
    assert first is disturbed and threads_seen == [threading.current_thread().name]
    deadline = time.time() + 30
    while results and time.time() < deadline:
        time.sleep(0.05)
    assert threads_seen[1] == "segue-recheck-test"   # off the caller's thread
    for _ in range(100):   # the save follows the measurement
        table_cache.clear_memo()
        again = table_cache.cached_table("test", {"k": "v"}, MeasuredTable, measure)
        if again.ratios_at("op", 1):
            break
        time.sleep(0.05)
    assert again.ratios_at("op", 1) == {"a/b": (0.5, 0.4, 0.6)} and table_cache.disturbed_points(again) == 0
    table_cache.clear_memo()
    table_cache._rechecking.clear()


def test_a_re_check_takes_only_the_points_the_earlier_timing_left_undecided() -> None:
    current = MeasuredTable({"k": "v"}, {"op": {"a": {"1": 1.0, "2": 2.0}, "b": {"1": 1.0, "2": 2.0}}}, noisy=True,
                            ratios={"op": {"1": {"a/b": (1.0, 0.9, 1.1)}, "2": {}}})
    fresh = MeasuredTable({"k": "v"}, {"op": {"a": {"1": 0.5, "2": 1.0}, "b": {"1": 1.0, "2": 2.0}}},
                          ratios={"op": {"1": {"a/b": (0.5, 0.4, 0.6)}, "2": {"a/b": (0.5, 0.45, 0.55)}}})
    merged = table_cache.merge_settled(current, fresh)
    assert merged.ratios == {"op": {"1": {"a/b": (1.0, 0.9, 1.1)}, "2": {"a/b": (0.5, 0.45, 0.55)}}}
    assert merged.timings_ms["op"]["a"] == {"1": 1.0, "2": 1.0} and not merged.noisy
    assert current.ratios["op"]["2"] == {}   # the held table is not changed under the running plan

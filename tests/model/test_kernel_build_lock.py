"""A killed kernel build must not hang the next start: the lock file it left is removed once no
live builder holds the build's flock; a live builder is waited for."""
import fcntl
import logging
import os
import threading
import time

import pytest
import torch.utils.cpp_extension as cpp_extension

from segue.model import cpu_kernels


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose=False: str(tmp_path))
    return tmp_path


def fake_load(build_dir, seen):
    def load(**kwargs):
        seen.append((build_dir / "lock").exists())
        return "module"
    return load


def test_a_lock_left_by_a_killed_build_is_removed(build_dir, monkeypatch):
    (build_dir / "lock").touch()  # fresh: the old age rule would have waited 20 minutes on it
    seen: list[bool] = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(build_dir, seen))
    assert cpu_kernels._build("segue_test_kernels", [], []) == "module"
    assert seen == [False]


def test_a_live_builder_is_waited_for(build_dir, monkeypatch, caplog):
    holder = os.open(build_dir / "segue-build.flock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    (build_dir / "lock").touch()  # the live builder's own lock: must stay while it builds
    seen: list[bool] = []
    monkeypatch.setattr(cpp_extension, "load", fake_load(build_dir, seen))
    released_at: list[float] = []

    def finish_build() -> None:
        time.sleep(0.3)
        (build_dir / "lock").unlink()
        released_at.append(time.monotonic())
        os.close(holder)

    threading.Thread(target=finish_build).start()
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        cpu_kernels._build("segue_test_kernels", [], [])
    assert released_at and seen == [False]
    assert "waiting for it" in caplog.text

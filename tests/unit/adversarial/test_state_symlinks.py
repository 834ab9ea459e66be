"""Symbolic links in the state and runtime directories were followed as root
(history.jsonl, its temporary file, the lock files), so whoever could plant one could make the
daemon append to, truncate or create any file on the host. Now the last component is opened
with O_NOFOLLOW and temporaries are created exclusively under unpredictable names."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gpuguardd.daemon.history import FILE_NAME, History
from gpuguardd.engine.locks import GpuLocks
from gpuguardd.records.report import Report

VICTIM_TEXT = "root:x:0:0:precious, not the daemon's:/root:/bin/bash\n"


def report(n: int) -> Report:
    return Report.from_dict({"id": f"{n:032x}", "started_usec": 1_700_000_000_000_000 + n,
                             "outcome": "freed"})


def loaded(directory: Path, max_entries: int) -> History:
    history = History(str(directory), max_entries)
    history.load()
    return history


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "passwd"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def test_history_file_symlink_is_not_followed(tmp_path: Path, victim: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / FILE_NAME).symlink_to(victim)
    history = History(str(state), 1000)
    with caplog.at_level(logging.ERROR, "gpuguard.history"):
        history.load()
    assert "is a symbolic link: not followed" in caplog.text
    history.append(report(1))
    history.append(report(2))
    assert victim.read_text() == VICTIM_TEXT
    # The link itself was replaced by a real history file holding both reports.
    assert not (state / FILE_NAME).is_symlink()
    lines = (state / FILE_NAME).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [report(1).id, report(2).id]
    assert loaded(state, 1000).newest(0)[0]["id"] == report(2).id


def test_an_empty_victim_behind_the_link_is_not_appended_to(tmp_path: Path) -> None:
    """The case that needs no rewrite: an empty file behind the link used to take appends."""
    state = tmp_path / "state"
    state.mkdir()
    victim = tmp_path / "empty-victim"
    victim.write_text("")
    (state / FILE_NAME).symlink_to(victim)
    history = History(str(state), 1000)
    history.load()
    history.append(report(1))
    assert victim.read_text() == ""
    assert json.loads((state / FILE_NAME).read_text())["id"] == report(1).id


def test_predictable_temporary_names_are_gone(tmp_path: Path, victim: Path) -> None:
    """Rewrites (compaction here) went through history.jsonl.tmp-<pid>, opened with O_TRUNC:
    a link planted at every name a PID could give was followed and the victim truncated."""
    state = tmp_path / "state"
    state.mkdir()
    (state / f"{FILE_NAME}.tmp-{os.getpid()}").symlink_to(victim)
    history = History(str(state), 2)
    history.load()
    for n in range(40):  # several compactions
        history.append(report(n))
    assert victim.read_text() == VICTIM_TEXT
    left = sorted(p.name for p in state.iterdir())
    assert left == [FILE_NAME, f"{FILE_NAME}.tmp-{os.getpid()}"], left  # no temporary left over
    assert [e["id"] for e in loaded(state, 2).newest(0)] == [report(39).id, report(38).id]


def test_lock_file_symlink_is_not_followed(tmp_path: Path) -> None:
    locks_dir = tmp_path / "locks"
    locks_dir.mkdir()
    target = tmp_path / "etc" / "ld.so.preload"  # would be created, as root, by O_CREAT
    target.parent.mkdir()
    (locks_dir / "gpu-0.lock").symlink_to(target)
    locks = GpuLocks(str(locks_dir))
    problem = locks.acquire([0, 1])
    try:
        assert problem is not None and "a symbolic link, not followed" in problem
        assert str(locks_dir / "gpu-0.lock") in problem
        assert not target.exists()
    finally:
        locks.release()



"""gpuguard-notify's rules (gpuguardd/notify/events.py), without a bus."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuguardd.notify.events import CRITICAL, Events, Notice, own_processes


def fake_proc(root: Path, processes: dict[int, str]) -> str:
    for pid, comm in processes.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(comm + "\n")
    (root / "self").mkdir()  # not a pid: skipped
    return str(root)


def report(**fields: Any) -> dict[str, Any]:
    return {"outcome": "freed", "dry_run": False, "terminated": [], "survived": [],
            "requested_by": "uid 1000 (alice) :1.42", **fields}


def test_own_processes_by_uid(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {10: "python3", 11: "vllm"})
    assert own_processes(os.getuid(), proc) == {10: "python3", 11: "vllm"}
    assert own_processes(os.getuid() + 1, proc) == {}
    assert own_processes(os.getuid(), str(tmp_path / "none")) == {}


def test_a_sweep_that_ended_mine_names_them_and_who_asked(tmp_path: Path) -> None:
    events = Events(os.getuid(), fake_proc(tmp_path, {10: "train\u202egnp", 11: "other"}))
    assert events.signal("SweepStarted", {"id": "s1", "scope": {}}) == []
    notices = events.signal("SweepFinished", {"id": "s1", "outcome": "freed", "report": report(
        terminated=[{"pid": 10, "comm": "train\u202egnp"},   # mine
                    {"pid": 11, "comm": "reused"},            # that pid, another command now
                    {"pid": 12, "comm": "theirs"}])})         # not mine
    assert notices == [Notice("Your GPU processes were ended",
                              "train\\u202egnp (10), by a sweep asked by uid 1000 (alice) :1.42")]


def test_the_reports_uid_decides_where_it_has_one(tmp_path: Path) -> None:
    me = os.getuid()
    events = Events(me, fake_proc(tmp_path, {10: "train"}))
    events.signal("SweepStarted", {"id": "s1", "scope": {}})
    notices = events.signal("SweepFinished", {"id": "s1", "outcome": "freed", "report": report(
        terminated=[{"pid": 10, "comm": "train", "uid": me + 1},  # seen at the start, not mine
                    {"pid": 20, "comm": "fast", "uid": me}])})    # gone before SweepStarted
    assert [n.body for n in notices] == ["fast (20), by a sweep asked by uid 1000 (alice) :1.42"]


def test_what_is_said_of_leaks_and_sweeps_left_behind() -> None:
    events = Events(os.getuid(), "/nonexistent")
    leak = events.signal("LeakSuspected", {"gpu": 1, "uuid": "GPU-x", "bytes": 3 << 30})
    assert leak == [Notice("GPU 1: memory leaked", "3.0 GiB in use with no process holding the GPU.",
                           CRITICAL)]
    # Named by vendor and product once the daemon's GPU list was read; escaped, then as markup.
    events.titles = {1: "amd AMD Instinct MI300X", 2: "nvidia <b>\x1b[2J"}
    (named,) = events.signal("LeakSuspected", {"gpu": 1, "uuid": "GPU-x", "bytes": 3 << 30})
    assert named.body == "3.0 GiB in use with no process holding the GPU (amd AMD Instinct MI300X)."
    (hostile,) = events.signal("LeakSuspected", {"gpu": 2, "uuid": "GPU-y", "bytes": 1 << 30})
    assert hostile.body == "1.0 GiB in use with no process holding the GPU (nvidia <b>\\x1b[2J)."
    assert hostile.for_server(markup=True)[1].endswith("(nvidia &lt;b&gt;\\x1b[2J).")
    events.titles = {}
    survivors = report(outcome="survivors", survived=[{"pid": p, "comm": f"<b>{p}"} for p in range(7)])
    (left,) = events.signal("SweepFinished", {"id": "s2", "outcome": "survivors", "report": survivors})
    assert left.body == "Still running: <b>0 (0), <b>1 (1), <b>2 (2), <b>3 (3), <b>4 (4) and 2 more"
    # A server that renders markup gets the body escaped as markup too.
    assert left.for_server(markup=True)[1].startswith("Still running: &lt;b&gt;0 (0)")
    assert events.signal("SweepFinished", {"id": "s3", "outcome": "memory-not-released",
                                           "report": report(outcome="memory-not-released")})
    # Dry runs and fine sweeps say nothing; nor do other signals.
    assert events.signal("SweepFinished", {"id": "s4", "outcome": "dry-run",
                                           "report": report(outcome="survivors", dry_run=True)}) == []
    assert events.signal("SweepFinished", {"id": "s5", "outcome": "freed", "report": report()}) == []
    assert events.signal("ProcessTerminated", {"id": "s5", "pid": 1}) == []

"""A process handle (pidfd) refuses a process that is not the one it opened; how a process
ended and why a survivor survived are decided as facts, worded only for the report (sweeps
against real processes: tests/host/test_sweep.py)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gpuguardd.engine import procfs
from gpuguardd.engine.process import ExitStatus, ProcessHandle, ended_by, exit_status, survivor_reason
from gpuguardd.records.enums import SurvivorReason


def test_process_handle_refuses_a_different_process() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    handle = ProcessHandle.open(sleeper.pid)
    assert handle is not None and handle.alive()
    sleeper.kill()
    sleeper.wait()
    assert not handle.alive()
    assert handle.send(signal.SIGTERM) is False
    handle.close()


def zombie(exit_code: int) -> procfs.ProcStat:
    return procfs.ProcStat(pid=5, comm="x", state="Z", ppid=1, flags=0, start_time=1, exit_code=exit_code)


def test_how_a_process_ended_is_a_fact_and_its_words_are_made_from_it() -> None:
    killed = exit_status(zombie(signal.SIGTERM))
    assert killed == ExitStatus(killed_by="SIGTERM") and str(killed) == "killed by SIGTERM"
    exited = exit_status(zombie(3 << 8))
    assert exited == ExitStatus(status=3) and str(exited) == "exited with status 3"
    assert exit_status(None) is None
    # Ours ended it only if we sent that signal; a kill by someone else's is not credited.
    assert ended_by("SIGKILL", killed, False) == "SIGTERM"
    assert ended_by("SIGKILL", ExitStatus(killed_by="SIGKILL"), False) == "SIGKILL"
    assert ended_by("SIGTERM", ExitStatus(killed_by="SIGKILL"), False) == ""
    assert ended_by("SIGTERM", exited, False) == "SIGTERM" and ended_by("SIGTERM", exited, True) == ""
    assert ended_by("SIGKILL", None, False) == "SIGKILL"


@pytest.mark.parametrize("state,code,words", [
    ("Z", SurvivorReason.ZOMBIE, "zombie: parent 1 has not reaped it"),
    ("D", SurvivorReason.UNINTERRUPTIBLE,
     "uninterruptible (D state) in nv_wait: SIGKILL is pending until it wakes"),
    ("R", SurvivorReason.STILL_RUNNING, "still running after SIGKILL (state R)"),
    (None, SurvivorReason.EXITED, "exited"),
])
def test_a_survivor_is_coded_by_its_state(monkeypatch: pytest.MonkeyPatch, state: str | None,
                                          code: SurvivorReason, words: str) -> None:
    stat = None if state is None else procfs.ProcStat(pid=5, comm="x", state=state, ppid=1, flags=0,
                                                      start_time=1)
    monkeypatch.setattr(procfs, "read_stat", lambda pid: stat)
    monkeypatch.setattr(procfs, "read_wchan", lambda pid: "nv_wait")
    assert survivor_reason(os.getpid()) == (state or "", code, words)

"""A process handle (pidfd) refuses a process that is not the one it opened (sweeps against
real processes: tests/host/test_sweep.py)."""

from __future__ import annotations

import signal
import subprocess

from gpuguardd.engine.process import ProcessHandle


def test_process_handle_refuses_a_different_process() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    handle = ProcessHandle.open(sleeper.pid)
    assert handle is not None and handle.alive()
    sleeper.kill()
    sleeper.wait()
    assert not handle.alive()
    assert handle.send(signal.SIGTERM) is False
    handle.close()

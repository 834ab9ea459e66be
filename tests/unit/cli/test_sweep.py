"""Unit tests of gpuguardd/cli/sweep.py: a sweep that outlives the daemon."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gpuguardd.cli import client, sweep
from gpuguardd.errors import DaemonUnavailable
from gpuguardd.records.enums import Outcome
from gpuguardd.records.report import Report
from tests.unit.helpers import request


def finished(outcome: Outcome = Outcome.FREED) -> Report:
    return Report(id="f" * 32, outcome=outcome)


def vanish() -> Report:
    raise DaemonUnavailable("Message recipient disconnected from message bus without replying")


def backend(answer: Callable[[], Report]) -> Any:
    return SimpleNamespace(sweep=lambda request: answer())


def through_restarts(monkeypatch: pytest.MonkeyPatch, first: Callable[[], Report], again: Callable[[], Report],
                     local: Callable[[], Report]) -> Report:
    """sweep_through_restarts where the daemon answers `first()`, each new connection `again()`
    and the local engine `local()`."""
    monkeypatch.setattr(client, "DBusBackend", lambda bus_address: backend(again))
    monkeypatch.setattr(sweep, "local", lambda args: backend(local))
    return sweep.sweep_through_restarts(backend(first), request(), argparse.Namespace(bus_address=None))


def test_the_sweep_is_asked_again_once_the_daemon_is_back(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sweep, "RETRY_INTERVAL_SEC", 0.01)
    asked: list[str] = []

    def again() -> Report:
        asked.append("again")
        if len(asked) < 3:  # still restarting
            raise DaemonUnavailable("org.gpuguard.GpuGuard1 is not running")
        return finished()

    report = through_restarts(monkeypatch, vanish, again, lambda: pytest.fail("no local sweep"))
    assert report.outcome == Outcome.FREED and len(asked) == 3
    text = caplog.text
    assert "gpuguardd stopped during the sweep of sglang-a.service" in text and "retrying" in text
    assert "finished it: sweep ffffffff, freed" in text


def test_root_finishes_locally_when_the_daemon_stays_away(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sweep, "RETRY_INTERVAL_SEC", 0.01)
    monkeypatch.setattr(sweep, "RETRY_SEC", 0.05)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    report = through_restarts(monkeypatch, vanish, vanish, lambda: finished(Outcome.SURVIVORS))
    assert report.outcome == Outcome.SURVIVORS  # the exit status is the finishing sweep's
    assert "sweeping with the local engine" in caplog.text and "finished locally" in caplog.text


def test_a_user_is_told_to_sweep_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "RETRY_INTERVAL_SEC", 0.01)
    monkeypatch.setattr(sweep, "RETRY_SEC", 0.05)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(DaemonUnavailable, match="did not come back within 0 s"):
        through_restarts(monkeypatch, vanish, vanish, lambda: pytest.fail("no local sweep"))

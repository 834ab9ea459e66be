"""Unit tests of gpuguardd/daemon/main.py."""

from __future__ import annotations

import pytest

from gpuguardd.daemon.main import watchdog_interval


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None


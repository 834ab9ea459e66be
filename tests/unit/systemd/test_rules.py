"""The unit watch's stop rule (gpuguardd/systemd/rules.py), without a bus: which state a
watched unit is seen in, after which, is a stop to sweep. The watcher against a real systemd
(JobRemoved, PropertiesChanged, daemon-reload, Restart=) is tests/e2e's."""

from __future__ import annotations

import pytest

from gpuguardd.systemd.adoption import owner_lets_go
from gpuguardd.systemd.rules import UnitState, became_active, is_stop_to_sweep


def state(active: str) -> UnitState:
    return UnitState("sglang.service", active, invocation_id="ab" * 16)


@pytest.mark.parametrize(("previous", "now", "job_done", "sweep"), [
    ("active", "inactive", False, True),  # seen running, now stopped
    ("deactivating", "failed", False, True),
    ("active", "", False, True),  # unloaded right after its stop
    ("", "inactive", True, True),  # first sight, but a stop job just finished
    ("inactive", "inactive", True, True),
    ("", "inactive", False, False),  # daemon-reload re-announcing an inactive unit
    ("inactive", "inactive", False, False),
    ("failed", "inactive", False, False),  # reset-failed: no new stop
    ("", "", False, False),
    ("inactive", "active", True, False),  # running again: never a stop
    ("active", "deactivating", True, False),  # still stopping: the drop-in's turn
    ("active", "activating", False, False),
])
def test_stop_to_sweep(previous: str, now: str, job_done: bool, sweep: bool) -> None:
    assert is_stop_to_sweep(previous, state(now), job_done) is sweep


@pytest.mark.parametrize(("previous", "now", "started"), [
    ("", "active", True), ("activating", "active", True), ("inactive", "active", True),
    ("active", "active", False), ("active", "reloading", False), ("", "activating", False),
])
def test_became_active(previous: str, now: str, started: bool) -> None:
    assert became_active(previous, state(now)) is started


@pytest.mark.parametrize(("owner", "lets_go"), [
    (None, False),  # systemd could not be asked: the unit may run
    ("active", False), ("activating", False), ("reloading", False), ("deactivating", False),
    ("refreshing", False), ("inactive", True), ("failed", True), ("", True),  # "": unloaded
])
def test_rule_4_only_a_stopped_owner_lets_its_process_go(owner: str | None, lets_go: bool) -> None:
    assert owner_lets_go(None if owner is None else state(owner)) is lets_go

"""The unit watch's stop rule (gpuguardd/systemd/rules.py), without a bus: which state a
watched unit is seen in, after which, is a stop to sweep. The watcher against a real systemd
(JobRemoved, PropertiesChanged, daemon-reload, Restart=) is tests/e2e's."""

from __future__ import annotations

import pytest

from gpuguardd.records.enums import RequesterKind
from gpuguardd.systemd.rules import (
    is_stop_to_sweep,
    legacy_requester_kind,
    matches,
    unit_name_from_path,
)
from tests.unit.helpers import state


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


@pytest.mark.parametrize(("requested_by", "kind"), [
    ("hook:a.service", RequesterKind.HOOK), ("watch:a.service", RequesterKind.WATCH),
    ("slurm:42", RequesterKind.SLURM), ("recovered:a.service", RequesterKind.RECOVERED),
    ("hook:a.service via uid 1000 (alice) :1.4", RequesterKind.HOOK_NONROOT),
    ("uid 1000 (alice) :1.4", RequesterKind.MANUAL), ("hook:", RequesterKind.MANUAL),
])
def test_the_legacy_rule_for_records_older_than_the_kinds(requested_by: str, kind: RequesterKind) -> None:
    assert legacy_requester_kind(requested_by) is kind


def test_unit_name_from_path() -> None:
    assert unit_name_from_path("/org/freedesktop/systemd1/unit/sglang_2ddemo_2eservice") \
        == "sglang-demo.service"
    assert unit_name_from_path("/org/freedesktop/systemd1/unit/foo_40bar_2eservice") \
        == "foo@bar.service"
    assert unit_name_from_path("/org/freedesktop/systemd1/job/42") == ""


@pytest.mark.parametrize(("unit", "patterns", "expected"), [
    ("sglang-demo.service", ["sglang-*"], True),
    ("sglang-demo.service", ["sglang-demo"], True),
    ("sglang-demo.service", ["vllm-*", "sglang-*.service"], True),
    ("sglang-demo.socket", ["sglang-*.service"], False),
    ("vllm-a.service", ["sglang-*"], False),
    ("vllm-a.service", [], False),
])
def test_matches(unit: str, patterns: list[str], expected: bool) -> None:
    assert matches(unit, patterns) is expected


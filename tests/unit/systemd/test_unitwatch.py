"""Unit tests of gpuguardd/systemd/unitwatch.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpuguardd.systemd.unitwatch import UnitWatch
from tests.unit.helpers import holder


def test_unit_records_that_cannot_be_kept_are_said_once_not_every_poll(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The records are written at each inventory change (every poll); a runtime directory that
    is gone must cost one warning, not one every 2 s, and a change of the records tries again."""
    watch = UnitWatch(bus=None, patterns=["sglang-*"],  # type: ignore[arg-type]
                      records_path=str(tmp_path / "gone" / "units.json"))
    held = [holder(10, "sglang-a.service", [0])]
    with caplog.at_level("WARNING"):
        for _ in range(5):
            watch.observe(held)
        assert len([r for r in caplog.records if "cannot keep" in r.message]) == 1
        (tmp_path / "gone").mkdir()
        watch.observe([*held, holder(11, "sglang-a.service", [1])])
    assert (tmp_path / "gone" / "units.json").exists()


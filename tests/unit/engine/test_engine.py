"""engine/engine.py: what only the Engine decides (the rest is tested where it lives)."""

from __future__ import annotations

import time
from pathlib import Path

from gpuguardd.config import Config
from gpuguardd.engine.engine import Engine
from gpuguardd.records.enums import WarningCode
from gpuguardd.records.models import SweepRequest


def test_a_sweep_that_cannot_lock_says_so_with_a_code(tmp_path: Path) -> None:
    # A file where the lock directory should be: the sweep goes on, unserialized, and its
    # report says why with the code programs test, not only in words.
    (tmp_path / "locks").write_text("")
    engine = Engine(Config(device_paths=(str(tmp_path / "nvidia*"),), runtime_directory=str(tmp_path),
                           sysfs_path=str(tmp_path / "sys")))
    started = time.monotonic()
    report = engine.sweep(SweepRequest(grace_ms=0))
    # Nothing to end and no memory to read: done at once, not after VerifyTimeoutSec.
    assert time.monotonic() - started < 10, report.duration_ms
    assert WarningCode.LOCKS_UNAVAILABLE in report.warning_codes, (report.warnings, report.warning_codes)
    assert len(report.warning_codes) == len(report.warnings)

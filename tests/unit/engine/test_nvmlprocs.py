"""nvmlprocs: the kernel's pid_max, read as untrusted text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd.engine import nvmlprocs, procfs


@pytest.mark.parametrize(("text", "expected"), [
    ("4194304\n", 4194304),
    ("32768\n", 32768),
    ("1_000\n", nvmlprocs.PID_MAX_LIMIT),       # int() would take it as 1000
    ("\u0663\u0662\u0667\u0666\u0668\n", nvmlprocs.PID_MAX_LIMIT),  # Arabic-Indic digits
    ("0\n", nvmlprocs.PID_MAX_LIMIT),
    ("99999999999\n", nvmlprocs.PID_MAX_LIMIT),
    ("-5\n", nvmlprocs.PID_MAX_LIMIT),
])
def test_pid_max_takes_ascii_digits_in_range_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   text: str, expected: int) -> None:
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "pid_max").write_text(text, encoding="utf-8")
    monkeypatch.setattr(procfs, "PROC", str(tmp_path))
    assert nvmlprocs.pid_max() == expected


def test_pid_max_unreadable_is_the_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procfs, "PROC", str(tmp_path))
    assert nvmlprocs.pid_max() == nvmlprocs.PID_MAX_LIMIT

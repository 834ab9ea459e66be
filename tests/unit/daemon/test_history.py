"""The sweep history file: durable, bounded, newest first, and never lost to a bad line
(gpuguardd.daemon.history driven directly; tests/bus/test_history.py restarts and kills the
real daemon)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.daemon.history import FILE_NAME, History
from gpuguardd.records.enums import Outcome
from gpuguardd.records.report import Report, Target
from tests.unit.helpers import HOLDER


def record(n: int) -> Report:
    return Report.from_dict(report(n))


def report(n: int) -> dict[str, Any]:
    return {"id": f"{n:032x}", "started_usec": 1_700_000_000_000_000 + n, "outcome": "freed",
            "requested_by": "uid 0 (root) :1.7", "terminated": [{"pid": 100 + n}]}


def loaded(directory: Path, max_entries: int = 1000) -> History:
    history = History(str(directory), max_entries)
    history.load()
    return history


def file_lines(directory: Path) -> list[str]:
    return (directory / FILE_NAME).read_text().splitlines()


def test_reports_survive_a_reload_newest_first(tmp_path: Path) -> None:
    history = loaded(tmp_path)
    for n in range(5):
        history.append(record(n))
    again = loaded(tmp_path)
    assert [r["id"] for r in again.newest(3)] == [report(n)["id"] for n in (4, 3, 2)]
    assert len(again.newest(0)) == 5
    last = again.last()
    assert last is not None and last.to_dict() == report(4)
    assert (tmp_path / FILE_NAME).stat().st_mode & 0o777 == 0o600


def test_history_is_bounded_and_compacted(tmp_path: Path) -> None:
    history = loaded(tmp_path, max_entries=5)
    for n in range(40):
        history.append(record(n))
    assert [r["id"] for r in history.newest(0)] == [report(n)["id"] for n in range(39, 34, -1)]
    # Compaction rewrites once the file holds max + max(10, max/10) lines: never unbounded.
    assert len(file_lines(tmp_path)) <= 5 + 10
    again = loaded(tmp_path, max_entries=5)
    assert [r["id"] for r in again.newest(0)] == [report(n)["id"] for n in range(39, 34, -1)]
    assert len(file_lines(tmp_path)) == 5


def test_torn_last_line_is_dropped_and_older_reports_kept(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    history = loaded(tmp_path)
    for n in range(3):
        history.append(record(n))
    with open(tmp_path / FILE_NAME, "a") as handle:
        handle.write(json.dumps(report(3))[:25])  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="gpuguard.history"):
        again = loaded(tmp_path)
    assert [r["id"] for r in again.newest(0)] == [report(n)["id"] for n in (2, 1, 0)]
    assert "dropped an incomplete last record" in caplog.text
    # The torn tail is gone from the file, so the next append starts on its own line.
    again.append(record(4))
    assert [json.loads(line)["id"] for line in file_lines(tmp_path)] == \
        [report(n)["id"] for n in (0, 1, 2, 4)]
    assert not list(tmp_path.glob("*.corrupt-*")), "a torn tail is expected, not corruption"


def test_complete_record_without_newline_is_kept(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text(json.dumps(report(0)) + "\n" + json.dumps(report(1)))
    history = loaded(tmp_path)
    assert [r["id"] for r in history.newest(0)] == [report(1)["id"], report(0)["id"]]
    history.append(record(2))
    assert len(file_lines(tmp_path)) == 3


def test_garbled_lines_are_skipped_reported_and_set_aside(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    lines = [json.dumps(report(0)), "{not json", json.dumps(report(1)), '"a string"',
             json.dumps({"no": "id"}), json.dumps(report(2))]
    (tmp_path / FILE_NAME).write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="gpuguard.history"):
        history = loaded(tmp_path)
    assert [r["id"] for r in history.newest(0)] == [report(n)["id"] for n in (2, 1, 0)]
    assert "skipped 3 unreadable line(s) (line 2, 4, 5)" in caplog.text
    aside = list(tmp_path.glob(f"{FILE_NAME}.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text().splitlines() == lines
    assert len(file_lines(tmp_path)) == 3


def test_entirely_corrupt_file_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE_NAME).write_bytes(b"\x00\xff\xfe garbage\n\x89PNG\r\n")
    with caplog.at_level(logging.ERROR, logger="gpuguard.history"):
        history = loaded(tmp_path)
    assert history.newest(0) == []
    assert "no readable report" in caplog.text and ".corrupt-" in caplog.text
    assert len(list(tmp_path.glob(f"{FILE_NAME}.corrupt-*"))) == 1
    history.append(record(7))
    assert loaded(tmp_path).newest(0) == [report(7)]


def test_unwritable_directory_keeps_history_in_memory(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    history = History(str(blocker / "state"), 10)
    with caplog.at_level(logging.ERROR, logger="gpuguard.history"):
        history.load()
        history.append(record(1))
    assert history.newest(1) == [report(1)]
    assert "sweep history" in caplog.text


def test_shrinking_the_maximum_trims(tmp_path: Path) -> None:
    history = loaded(tmp_path, max_entries=10)
    for n in range(8):
        history.append(record(n))
    history.set_max_entries(3)
    assert [r["id"] for r in history.newest(0)] == [report(n)["id"] for n in (7, 6, 5)]


def test_the_history_reads_its_newest_report_once(tmp_path: Path) -> None:
    """The status line asks for the newest report at every change; one may hold 40,000
    targets, so it is typed once: the record appended, or the stored one read back."""
    history = History(str(tmp_path), 10)
    history.load()
    assert history.last() is None
    report = Report(id="f" * 32, outcome=Outcome.FREED, targets=[Target.of(HOLDER)])
    history.append(report)
    assert history.last() is report
    again = History(str(tmp_path), 10)
    again.load()
    first = again.last()
    assert first is not None and first is again.last() and first.to_dict() == report.to_dict()


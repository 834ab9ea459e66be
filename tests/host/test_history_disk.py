"""The sweep history on a full disk, on a real tmpfs: a report that cannot be
written is served from memory, cut back off the file, and appended once a little room is back,
without needing room for a second copy of the file (tests/bus/test_history.py: the daemon)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gpuguardd.daemon.history import FILE_NAME, History
from gpuguardd.records.report import Report
from tests.conftest import require_root
from tests.fulldisk import PAGE, fill, tiny_tmpfs


def ident(n: int) -> str:
    return f"{n:08x}" * 4


def record(n: int, size: int) -> Report:
    """A report whose line is a little over `size` bytes."""
    return Report.from_dict({"id": ident(n), "started_usec": 1_700_000_000_000_000 + n,
                             "outcome": "freed", "reason": "r" * size})


def test_a_report_that_did_not_fit_is_appended_once_a_little_room_is_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    require_root()
    state = tmp_path / "state"
    with tiny_tmpfs(state, 16 * PAGE):
        history = History(str(state), 100)
        try:
            history.load()
            for n in range(6):
                history.append(record(n, 2000))  # three pages of history
            path = state / FILE_NAME
            before = path.read_bytes()
            fill(state / "spare", 2 * PAGE)
            fill(state / "filler")
            with caplog.at_level(logging.ERROR, logger="gpuguard.history"):
                history.append(record(6, 5000))  # needs a page more than the last one's end
            assert "No space left on device" in caplog.text
            assert f"report {ident(6)[:8]} is not on disk" in caplog.text
            # The part that fitted is cut back off: the file ends on a whole line.
            assert path.read_bytes() == before
            assert history.newest(1)[0]["id"] == ident(6)

            # Two pages: room for the missing line, not for the file written again beside itself.
            (state / "spare").unlink()
            assert history.flush()
            lines = path.read_bytes().split(b"\n")
            assert lines[-1] == b"" and path.read_bytes().startswith(before)
            assert [json.loads(line)["id"] for line in lines[:-1]] == [ident(n) for n in range(7)]
        finally:
            if history._retry is not None:  # no retries in the background after the test
                history._retry.cancel()

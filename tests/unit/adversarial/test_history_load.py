"""A large history loads a line at a time: memory stays bounded by what is kept (HistoryMax),
not by the file's size. (Time and memory figures: bench/bench_history.py.)"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from gpuguardd.daemon.history import FILE_NAME, MAX_LINE, History

MiB = 1024 * 1024


def peak_while_loading(history: History) -> int:
    """Peak bytes Python allocated during history.load()."""
    tracemalloc.start()
    try:
        history.load()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_large_history_loads_in_bounded_memory(tmp_path: Path) -> None:
    line = {"id": "", "outcome": "freed", "requested_by": "hook:x.service",
            "warnings": ["w" * 900]}
    with open(tmp_path / FILE_NAME, "w") as handle:
        for n in range(20_000):  # about 19 MiB
            handle.write(json.dumps({**line, "id": f"{n:032x}"}) + "\n")
    assert (tmp_path / FILE_NAME).stat().st_size > 18 * MiB
    history = History(str(tmp_path), 100)
    peak = peak_while_loading(history)
    # 100 reports of ~1 KiB each are kept; reading the whole file would peak above 19 MiB.
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert len(history.newest(0)) == 100
    assert history.newest(1)[0]["id"] == f"{19_999:032x}"
    assert len((tmp_path / FILE_NAME).read_text().splitlines()) == 100


def test_an_endless_line_is_skipped_without_being_held(tmp_path: Path) -> None:
    good = json.dumps({"id": "a" * 32, "outcome": "freed"})
    with open(tmp_path / FILE_NAME, "w") as handle:
        handle.write(good + "\n")
        handle.write('{"id": "' + "x" * (MAX_LINE + 32 * MiB) + '"}\n')
        handle.write(json.dumps({"id": "b" * 32, "outcome": "freed"}) + "\n")
    history = History(str(tmp_path), 10)
    peak = peak_while_loading(history)
    assert [r["id"] for r in history.newest(0)] == ["b" * 32, "a" * 32]
    # Pieces are kept up to MAX_LINE, then dropped; the whole line would be 96 MiB.
    assert peak < MAX_LINE + 8 * MiB, f"peak {peak / MiB:.1f} MiB"
    # The damaged file is kept aside, as for any unreadable line.
    assert any(p.name.startswith(FILE_NAME + ".corrupt-") for p in tmp_path.iterdir())

"""How many cores a big scan may use (engine/holders.py others_load): the load other work puts
on the host, not the scan's own."""

from __future__ import annotations

import pytest

from gpuguardd.engine.holders import others_load


@pytest.mark.parametrize(("loadavg", "others"), [
    # The scanner itself has kept one core busy for a minute; nothing else runs now.
    ("1.02 0.98 0.90 1/300 4242", 0.0),
    # Another process has kept a core busy and still runs, besides the reader.
    ("1.05 1.00 0.95 2/300 4242", 1.0),
    # A spike of runnable tasks right now, on a host idle over the minute.
    ("0.10 0.20 0.30 5/300 4242", 0.1),
    # Saturated: both say so.
    ("3.50 3.20 3.00 4/300 4242", 3.0),
    ("0.00 0.00 0.00 1/120 7", 0.0),
])
def test_others_load_is_the_smaller_of_the_load_and_the_other_runnable_tasks(
        loadavg: str, others: float) -> None:
    assert others_load(loadavg) == pytest.approx(others)


def test_unreadable_text_is_an_error_the_caller_handles() -> None:
    with pytest.raises((ValueError, IndexError)):
        others_load("garbage")

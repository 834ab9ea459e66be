"""How many cores a big scan may use (engine/scanhelpers.py others_load): the load other work puts
on the host, not the scan's own; and the work queue its processes share."""

from __future__ import annotations

import os

import pytest

from gpuguardd.engine.scanhelpers import WorkQueue, others_load
from gpuguardd.engine.scanworker import RECORD, next_chunk


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


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 2000, 100_000])
def test_the_work_queue_hands_out_every_pid_once_and_fits_one_page(count: int) -> None:
    """Every chunk number once, whoever reads (here: two readers of one queue, taking turns),
    then nothing; the chunks cover the PIDs exactly; the queue is written before anyone reads,
    so it must fit the smallest pipe (one page)."""
    pids = list(range(1000, 1000 + count))
    queue = WorkQueue(pids)
    other = os.dup(queue.fd)  # a helper's copy of the read end
    try:
        assert queue.count * RECORD.size <= 4096
        taken: list[int] = []
        while (index := queue.next() if len(taken) % 2 else next_chunk(other)) is not None:
            taken.append(index)
        assert sorted(taken) == list(range(queue.count))
        assert queue.next() is None and next_chunk(other) is None
        assert [pid for index in taken for pid in queue.chunk(index)] == pids
    finally:
        os.close(other)
        queue.close()

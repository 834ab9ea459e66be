"""NVML faults without a GPU host: the NVML worker answers at once while a call is stuck (the
engine on the fake NVML: tests/host/test_nvml_faults.py)."""

from __future__ import annotations

import time

import pytest

from gpuguardd.engine.nvmlworker import NvmlHung, NvmlWorker


def test_worker_answers_at_once_while_stuck_and_recovers() -> None:
    worker = NvmlWorker("test-nvml")
    release = time.monotonic() + 0.6
    with pytest.raises(NvmlHung) as first:
        worker.run(lambda: time.sleep(max(0.0, release - time.monotonic())), 0.1, "slow call")
    assert "slow call has not returned" in str(first.value)
    started = time.monotonic()
    with pytest.raises(NvmlHung):
        worker.run(lambda: 1, 5.0, "next call")
    assert time.monotonic() - started < 0.05, "a call queued behind the stuck one"
    time.sleep(max(0.0, release - time.monotonic()) + 0.1)
    assert worker._hung is None
    assert worker.run(lambda: 42, 1.0, "after") == 42
    with pytest.raises(ZeroDivisionError):
        worker.run(lambda: 1 // 0, 1.0, "raises")


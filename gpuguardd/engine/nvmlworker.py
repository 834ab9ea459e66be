"""One thread that owns every NVML call, so a hung driver never blocks anyone else.

NVML calls can hang for good in an ioctl no signal reaches (open-gpu-kernel-modules issue
1333). Past a caller's deadline the worker is marked hung, and until the stuck call returns
every later call gets NvmlHung at once instead of queueing behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

log = logging.getLogger("gpuguard.nvml")

T = TypeVar("T")


class NvmlHung(Exception):
    """NVML did not answer in time, or is still busy with a call that did not."""

    def __init__(self, what: str, since: float) -> None:
        self.what = what
        self.since = since  # time.monotonic() when the stuck call started
        super().__init__(self.describe())

    def describe(self) -> str:
        waited = max(0.0, time.monotonic() - self.since)
        return f"NVML hung: {self.what} has not returned for {waited:.1f} s"


class _Job(Generic[T]):
    def __init__(self, fn: Callable[[], T], what: str) -> None:
        self.fn = fn
        self.what = what
        self.future: Future[T] = Future()
        self.started = 0.0


class NvmlWorker:
    """Runs one job at a time on a daemon thread of its own (started on first use)."""

    def __init__(self, name: str = "gpuguard-nvml") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._job: _Job[object] | None = None
        self._hung: _Job[object] | None = None
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """fn() on the worker; its exception re-raised here; NvmlHung after `timeout` seconds
        (or at once while an earlier call is stuck). `what` names the call in messages."""
        deadline = time.monotonic() + timeout
        job: _Job[T] = _Job(fn, what)
        with self._cond:
            while True:
                if self._hung is not None:
                    raise NvmlHung(self._hung.what, self._hung.started)
                if self._job is None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # The running job began before this call: older than our whole timeout, it is stuck.
                    self._mark_hung(self._job)
                    raise NvmlHung(self._job.what, self._job.started)
                self._cond.wait(remaining)
            if self._thread is None or not self._thread.is_alive():
                # A daemon thread: a process whose NVML hangs for good must still be able to exit.
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            job.started = time.monotonic()
            self._job = job  # type: ignore[assignment]
            self._cond.notify_all()
        with contextlib.suppress(FutureTimeout):  # the job's own exceptions pass through
            return job.future.result(max(0.0, deadline - time.monotonic()))
        with self._cond:
            if job.future.done():
                return job.future.result()
            self._mark_hung(job)  # type: ignore[arg-type]
        raise NvmlHung(job.what, job.started)

    def _mark_hung(self, job: _Job[object]) -> None:
        if self._hung is not job:
            self._hung = job
            log.error("NVML call %s has not returned after %.1f s: the driver is hung; NVML "
                      "queries are answered as unknown until it returns", job.what,
                      time.monotonic() - job.started)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None or self._job.future.running() or self._job.future.done():
                    self._cond.wait()
                job = self._job
                job.future.set_running_or_notify_cancel()
            try:
                result = job.fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            with self._cond:
                if self._hung is job:
                    log.warning("NVML call %s returned after %.1f s: NVML answers again",
                                job.what, time.monotonic() - job.started)
                    self._hung = None
                self._job = None
                self._cond.notify_all()

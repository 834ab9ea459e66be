"""The daemon's live view of GPUs and holders, kept current at almost no idle cost.

Every PollIntervalSec only NVML is read (under a millisecond a GPU). The full holder scan walks
every process's fds and maps (over a second with thousands of processes), so it runs only when
it can find something new: when asked; when NVML's processes or GPUs changed, at most every
CHURN_FACTOR scan durations (~2 % of a CPU under churn); else every RESCAN_MIN_SEC or
RESCAN_FACTOR scan durations (~0.2 % idle). Concurrent requests share one scan started after.

ListHolders gets the last scan if it started under LIST_MAX_AGE_SEC before the call with no
holder-changing event since (invalidate() bumps a generation), else waits for one that did.
A quick scan (REFRESH_MAX_SCAN_SEC) near expiry starts the next in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from gpuguardd.engine.engine import Engine
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.records.enums import GpuState
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult

if TYPE_CHECKING:  # service.py, the listener, imports this module
    from gpuguardd.daemon.service import Service

log = logging.getLogger("gpuguard.live")

# Holders NVML cannot see only change HolderCount: a minute late is fine for a walk of /proc.
RESCAN_MIN_SEC = 60.0
LIST_MAX_AGE_SEC = 1.0
REFRESH_LEAD_FACTOR = 4.0
REFRESH_MAX_SCAN_SEC = 0.0625
clock = time.monotonic  # the freshness rule's clock (tests move it)
RESCAN_FACTOR = 500.0
CHURN_FACTOR = 50.0

NvmlKey = tuple[bool, tuple[tuple[str, tuple[int, ...], bool, bool], ...]]


def _nvml_key(snapshot: NvmlSnapshot) -> NvmlKey:
    """What a holder scan could learn from NVML: which GPUs, and which processes on them."""
    return snapshot.available, tuple((g.uuid, tuple(sorted(g.processes)), g.lost, g.suspended) for g in snapshot.gpus)


class Inventory:
    def __init__(self, engine: Engine, executor: Executor, listener: Service) -> None:
        self.engine = engine
        self.executor = executor
        self.listener = listener
        self.snapshot: NvmlSnapshot = NvmlSnapshot(available=False, error="not read yet")
        self.holders: list[Holder] = []
        self._scanned_key: NvmlKey | None = None
        self._seen_key: NvmlKey | None = None  # the last one polled
        self._scanned_at = 0.0
        self.scan_cost = 0.0  # seconds the last full scan took
        self._running: asyncio.Future[ScanResult] | None = None
        self._running_mark = (0.0, 0)  # (monotonic start, generation) of the running scan
        self.last_result: ScanResult | None = None
        self._result_mark = (0.0, -1)
        self._generation = 0  # bumped by invalidate(): older scans are never served after it
        self._queued: asyncio.Future[ScanResult] | None = None
        # (GPU index, MIG UUID or "" for the whole GPU) of each leak already announced
        self._leaked: set[tuple[int, str]] = set()
        self._rescan_task: asyncio.Task[Any] | None = None
        self._wake = asyncio.Event()

    async def scan(self) -> ScanResult:
        """A full scan that started after this call (shared)."""
        loop = asyncio.get_running_loop()
        if self._running is None:
            return await asyncio.shield(self._start(loop))
        # The running scan may have read /proc before the caller's change: wait for the next.
        if self._queued is None:
            self._queued = loop.create_future()
        return await asyncio.shield(self._queued)

    def invalidate(self) -> None:
        self._generation += 1

    def _fresh(self, mark: tuple[float, int], asked: float) -> bool:
        started, generation = mark
        return generation == self._generation and asked - started < LIST_MAX_AGE_SEC

    async def recent(self) -> ScanResult:
        asked = clock()
        if self.last_result is not None and self._fresh(self._result_mark, asked):
            self._refresh_ahead(asked)
            return self.last_result
        if self._running is not None and self._fresh(self._running_mark, asked):
            return await asyncio.shield(self._running)
        return await self.scan()

    def _refresh_ahead(self, asked: float) -> None:
        if self.scan_cost > REFRESH_MAX_SCAN_SEC or self._running is not None or self._queued is not None:
            return
        expires = self._result_mark[0] + LIST_MAX_AGE_SEC
        if asked >= expires - REFRESH_LEAD_FACTOR * self.scan_cost:
            self._start(asyncio.get_running_loop())

    async def fresh_scan(self) -> ScanResult:
        self.invalidate()
        return await self.scan()

    def _timed_scan(self) -> ScanResult:
        started = time.monotonic()
        try:
            return self.engine.scan()
        finally:
            self.scan_cost = time.monotonic() - started
            log.debug("holder scan took %.0f ms", self.scan_cost * 1000)

    def _start(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[ScanResult]:
        # Marked before the thread starts: the scan's view is at least as new as this.
        self._running_mark = (clock(), self._generation)
        future: asyncio.Future[ScanResult] = loop.run_in_executor(self.executor, self._timed_scan)
        self._running = future
        future.add_done_callback(self._scan_done)
        return future

    def _scan_done(self, future: asyncio.Future[ScanResult]) -> None:
        self._running = None
        if future.cancelled():
            pass
        elif (exc := future.exception()) is None:
            self.last_result, self._result_mark = future.result(), self._running_mark
            self._publish_scan(future.result())
        else:
            log.error("holder scan failed: %s: %s", type(exc).__name__, exc)
        queued, self._queued = self._queued, None
        if queued is not None:
            try:
                follow = self._start(asyncio.get_running_loop())
            except RuntimeError:  # the executor is shut down: gpuguardd is stopping
                queued.cancel()
                return
            follow.add_done_callback(lambda done: _chain(done, queued))

    def request_rescan(self) -> None:
        self.invalidate()
        if self._rescan_task is None or self._rescan_task.done():
            self._rescan_task = asyncio.ensure_future(self._quiet_scan())

    async def _quiet_scan(self) -> None:
        try:
            await self.scan()
        except Exception as exc:  # already logged by _scan_done; the next poll retries
            log.debug("rescan failed: %s", exc)

    async def poll(self) -> None:
        loop = asyncio.get_running_loop()
        snapshot = await loop.run_in_executor(self.executor, self.engine.snapshot)
        since = time.monotonic() - self._scanned_at
        stale = since >= max(RESCAN_MIN_SEC, RESCAN_FACTOR * self.scan_cost)
        key = _nvml_key(snapshot)
        changed = key != self._scanned_key and since >= CHURN_FACTOR * self.scan_cost
        if key != self._seen_key:
            # NVML saw processes or GPUs come or go: ListHolders must not serve older scans.
            self._seen_key = key
            self.invalidate()
        if stale or changed:
            await self.scan()
        else:
            self._publish(snapshot)

    async def run(self, interval: Callable[[], float]) -> None:
        while True:
            try:
                await self.poll()
            except Exception as exc:  # cancellation is no Exception: it ends the loop
                log.error("GPU poll failed: %s: %s", type(exc).__name__, exc)
            # A start gate's waiter wakes the poll at once and shortens the interval.
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval())

    def scan_age(self) -> float:
        return time.monotonic() - self._scanned_at

    def wake(self) -> None:
        self._wake.set()

    def republish(self) -> None:
        """Again, for a change the start gate judges (a sweep began or ended)."""
        self._publish(self.snapshot)

    def _publish_scan(self, result: ScanResult) -> None:
        self.holders = result.holders
        self._scanned_key = _nvml_key(result.nvml)
        self._seen_key = self._scanned_key
        self._scanned_at = time.monotonic()
        self._publish(result.nvml)

    def _publish(self, snapshot: NvmlSnapshot) -> None:
        self.snapshot = snapshot
        released_below = self.engine.config.released_below_mib * 1024 * 1024
        summaries = gpu_summaries(ScanResult(holders=self.holders, nvml=snapshot), released_below)
        self.listener.inventory_changed(snapshot, summaries)
        # Each MIG instance is announced by its UUID: its GPU's total hides it while another is busy.
        leaked: dict[tuple[int, str], tuple[str, int]] = {}
        for summary in summaries:
            if summary.state == GpuState.LEAKED:
                leaked[(summary.index, "")] = (summary.uuid, summary.memory_used)
            for mig in summary.mig_instances or []:
                if mig.state == GpuState.LEAKED:
                    leaked[(summary.index, mig.uuid)] = (mig.uuid, mig.memory_used)
        for key, (uuid, used) in leaked.items():
            if key not in self._leaked:
                self.listener.leak_suspected(key[0], uuid, used)
        self._leaked = set(leaked)

    def note_leak_reported(self, index: int, mig_uuid: str = "") -> None:
        self._leaked.add((index, mig_uuid))


def _chain(source: asyncio.Future[ScanResult], target: asyncio.Future[ScanResult]) -> None:
    if target.done():
        pass
    elif source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())

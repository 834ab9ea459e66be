"""Sweeps run by the daemon, each in an executor thread (the engine's sweep blocks), its
progress moved onto the loop by call_soon_threadsafe: in order, before its completion.

At shutdown a sweep still running past its budget (a hung driver) is recorded as it stands,
so a stop never loses a sweep from the audit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from gpuguardd.config import Config
from gpuguardd.daemon.history import History
from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.engine.engine import Engine, Prepared
from gpuguardd.errors import GpuGuardError
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report, ReportScope, Terminated

if TYPE_CHECKING:  # service.py, the listener, imports this module
    from gpuguardd.daemon.service import Service

log = logging.getLogger("gpuguard.runner")


# Scans, lock waits and NVML reads around a sweep's own timeouts.
SWEEP_MARGIN_SEC = 15.0


def sweep_budget_sec(config: Config, request: SweepRequest) -> float:
    grace = config.grace_sec if request.grace_ms is None else request.grace_ms / 1000.0
    return grace + config.kill_timeout_sec + config.verify_timeout_sec + SWEEP_MARGIN_SEC


class LoopObserver:
    """The engine's SweepObserver, called from the sweep thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: Service, flight: InFlightSweep,
                 on_terminated: Callable[[], None]) -> None:
        self.loop = loop
        self.events = events
        self.flight = flight
        self.on_terminated = on_terminated

    def sweep_started(self, report_id: str, scope: ReportScope) -> None:
        self.loop.call_soon_threadsafe(self._started, report_id, scope)

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str, signal_name: str) -> None:
        self.loop.call_soon_threadsafe(self._terminated, report_id, pid, comm, unit, signal_name)

    def _started(self, report_id: str, scope: ReportScope) -> None:
        self.flight.scope = scope
        self.events.sweep_started(report_id, scope)

    def _terminated(self, report_id: str, pid: int, comm: str, unit: str, signal_name: str) -> None:
        self.flight.terminated.append(Terminated(pid=pid, comm=comm, unit=unit, signal=signal_name))
        self.on_terminated()
        self.events.process_terminated(report_id, pid, comm, unit, signal_name)


class SweepRunner:
    def __init__(self, engine: Engine, sweep_executor: Executor, io_executor: Executor, history: History,
                 events: Service, inflight: InFlightSweeps) -> None:
        self.engine = engine
        self.inflight = inflight
        self.sweep_executor = sweep_executor
        self.io_executor = io_executor
        self.history = history
        self.events = events
        self.active = 0
        self.closing = False
        self.in_flight: list[InFlightSweep] = []
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return self.active > 0

    async def run(self, request: SweepRequest, prepared: Prepared | None = None) -> Report:
        if self.closing:
            # Shutdown waits for running sweeps; new ones would keep it waiting forever.
            raise GpuGuardError("gpuguardd is stopping; sweep again once it is back")
        loop = asyncio.get_running_loop()
        self.active += 1
        self._idle.clear()
        request.report_id = request.report_id or uuid.uuid4().hex
        flight = InFlightSweep(request, budget_sec=sweep_budget_sec(self.engine.config, request))
        self.in_flight.append(flight)  # before Busy: its listeners judge the sweeps in flight
        if self.active == 1:
            self.events.busy_changed(True)
        # On disk before the first signal, each process ended added, for a successor (inflight.py).
        store = self.inflight if not request.is_dry_run(self.engine.config.dry_run) else None
        try:
            if store is not None and not await self.io(store.add, flight):
                store = None

            def progress() -> None:
                if store is not None:
                    self.io_executor.submit(store.add, InFlightSweep(
                        request, flight.started_usec, list(flight.terminated)))

            try:
                report = await loop.run_in_executor(self.sweep_executor, self.engine.sweep, request,
                                                    LoopObserver(loop, self.events, flight, progress), prepared)
            except GpuGuardError:
                if store is not None:  # it failed: nothing to finish
                    await self.io(store.remove, request.report_id)
                raise
            recorded = flight not in self.in_flight
            if recorded:
                # Recorded as interrupted at shutdown: that stays its one record; the rest is logged.
                log.warning("sweep %s finished after it was recorded as interrupted: %s, %d process(es) ended, "
                            "%d survived (the history keeps the interrupted record)", report.id[:8], report.outcome,
                            len(report.terminated), len(report.survived))
            else:
                self.in_flight.remove(flight)
                # Durable before anyone hears of it: a report the caller saw survives a crash.
                await self._record(request, report)
            if store is not None:  # done: nothing to resume
                await self.io(store.remove, report.id)
            if not recorded:
                self.events.sweep_finished(report)
        finally:
            if flight in self.in_flight:
                self.in_flight.remove(flight)
            self.active -= 1
            if self.active == 0:
                self._idle.set()
                self.events.busy_changed(False)
        return report

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.io_executor, fn, *args)

    def budget_sec(self) -> float:
        """How long the running sweeps may still take, one after another (locks)."""
        now = time.time_ns() // 1000
        return sum(max(0.0, f.budget_sec - (now - f.started_usec) / 1e6) for f in self.in_flight)

    async def record_interrupted(self) -> None:
        """At shutdown, budgets spent; the next gpuguardd finishes them (units.py)."""
        flights, self.in_flight = self.in_flight, []
        for flight in flights:
            report = flight.report(
                "gpuguardd stopped while this sweep was still running; what it had ended by "
                "then is listed, the rest is unknown", Outcome.ERROR,
                flight.scope or ReportScope.from_dict({"unit": flight.request.unit}))
            log.warning("sweep %s still running at shutdown: recorded as interrupted (%d "
                        "process(es) ended so far)", report.id[:8], len(report.terminated))
            await self._record(flight.request, report)
            self.events.sweep_finished(report)

    async def _record(self, request: SweepRequest, report: Report) -> None:
        if not request.audited:
            log.debug("sweep %s: a dry run by %s, not kept in the history", report.id[:8], request.requested_by)
            return
        await self.io(self.history.append, report)

    async def wait_idle(self, timeout: float) -> bool:
        """Refuse new sweeps and wait for running ones; False after `timeout`."""
        self.closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

"""Sweeps run by the daemon: in a thread, with their progress forwarded to the event loop.

The engine's sweep blocks (signals, grace periods, NVML verification, per-GPU locks that make
a second sweep of the same GPU wait for the first), so each runs in an executor thread while
the event loop keeps answering the bus. The engine reports progress through SweepObserver
from that thread; call_soon_threadsafe moves each callback onto the loop, in order, before
the sweep's own completion (which travels the same queue).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Protocol

from .engine import Engine
from .errors import GpuGuardError
from .history import History
from .models import Report, SweepRequest

log = logging.getLogger("gpuguard.runner")


class SweepEvents(Protocol):
    """What the service publishes; called on the event loop."""

    def sweep_started(self, report_id: str, scope: dict[str, object]) -> None: ...

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None: ...

    def sweep_finished(self, report: Report) -> None: ...

    def busy_changed(self, busy: bool) -> None: ...


class LoopObserver:
    """The engine's SweepObserver, called from the sweep thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: SweepEvents) -> None:
        self.loop = loop
        self.events = events

    def sweep_started(self, report_id: str, scope: dict[str, object]) -> None:
        self.loop.call_soon_threadsafe(self.events.sweep_started, report_id, dict(scope))

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None:
        self.loop.call_soon_threadsafe(self.events.process_terminated, report_id, pid, comm,
                                       unit, signal_name)


class SweepRunner:
    def __init__(self, engine: Engine, sweep_executor: Executor, io_executor: Executor,
                 history: History, events: SweepEvents) -> None:
        self.engine = engine
        self.sweep_executor = sweep_executor
        self.io_executor = io_executor
        self.history = history
        self.events = events
        self.active = 0
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return self.active > 0

    async def validate(self, request: SweepRequest) -> None:
        """Raise InvalidArgument now, before the caller's sweep counts as running."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.io_executor, self.engine.resolve_request, request)

    async def run(self, request: SweepRequest) -> Report:
        if self.closing:
            # Shutdown waits for running sweeps; new ones would keep it waiting forever.
            raise GpuGuardError("gpuguardd is stopping; sweep again once it is back")
        loop = asyncio.get_running_loop()
        self.active += 1
        self._idle.clear()
        if self.active == 1:
            self.events.busy_changed(True)
        try:
            report = await loop.run_in_executor(
                self.sweep_executor, self.engine.sweep, request, LoopObserver(loop, self.events))
            # Durable before anyone hears of it: a report the caller saw survives a crash.
            await loop.run_in_executor(self.io_executor, self.history.append, report.to_dict())
            self.events.sweep_finished(report)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()
                self.events.busy_changed(False)
        return report

    async def wait_idle(self, timeout: float) -> bool:
        """Refuse new sweeps and wait for running ones (at shutdown); False after `timeout`."""
        self.closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

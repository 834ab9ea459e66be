"""GPU resets in the daemon: one at a time, recorded like sweeps, and the AutoReset policy.

AutoReset resets a GPU leaked with nothing holding it for LeakGraceSec: never one in MIG mode
(a reset destroys its instances: an operator's decision), never while a sweep runs or a start
gate waits, and at most once per ResetIntervalSec, so a reset that does not cure is not repeated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from gpuguardd.engine.engine import Engine
from gpuguardd.records.enums import GpuState, RequesterKind
from gpuguardd.records.models import GpuSummary
from gpuguardd.records.report import Report

if TYPE_CHECKING:  # service.py, the listener, imports this module
    from gpuguardd.daemon.service import Service

log = logging.getLogger("gpuguard.recovery")

AUTO_RESET_BY = "gpuguardd (AutoReset)"


class Recovery:
    def __init__(self, engine: Engine, executor: Executor, record: Callable[[Report], Any], events: Service,
                 held_off: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.executor = executor
        self.record = record  # awaitable: keeps the report (history)
        self.events = events
        self.held_off = held_off  # a sweep runs or a start gate waits
        self.clock = clock
        self._lock = asyncio.Lock()
        self._leaked_since: dict[int, float] = {}
        self._last_auto: dict[int, float] = {}
        self._task: asyncio.Task[Any] | None = None

    async def reset(self, index: int, requested_by: str, reason: str = "",
                    requester_kind: RequesterKind = RequesterKind.MANUAL) -> Report:
        async with self._lock:
            loop = asyncio.get_running_loop()
            report = await loop.run_in_executor(self.executor, self.engine.reset_gpu, index, requested_by, reason)
            report.requester_kind = requester_kind
            await self.record(report)
            self.events.reset_finished(report)
            return report

    def observe(self, summaries: list[GpuSummary]) -> None:
        config = self.engine.config
        now = self.clock()
        leaked = {s.index: s for s in summaries if s.state == GpuState.LEAKED and not s.mig_mode}
        self._leaked_since = {i: t for i, t in self._leaked_since.items() if i in leaked}
        if not config.auto_reset:
            return
        for index, summary in sorted(leaked.items()):
            since = self._leaked_since.setdefault(index, now)
            if now - since < config.leak_grace_sec or self.busy() or self.held_off():
                continue
            last = self._last_auto.get(index)
            if last is not None and now - last < config.reset_interval_sec:
                continue
            self._last_auto[index] = now
            reason = (f"{summary.leak_kind or 'leaked'}: {summary.memory_used // (1024 * 1024)} MiB "
                      f"leaked for {now - since:.0f} s")
            log.warning("GPU %d: %s with nothing holding it: resetting it ([Recovery] AutoReset)", index, reason)
            self._task = asyncio.ensure_future(self._auto(index, reason))

    def busy(self) -> bool:
        return (self._task is not None and not self._task.done()) or self._lock.locked()

    async def _auto(self, index: int, reason: str) -> None:
        try:
            await self.reset(index, AUTO_RESET_BY, reason, RequesterKind.AUTO_RESET)
        except Exception as exc:  # logged; the policy tries again after ResetIntervalSec
            log.error("automatic reset of GPU %d failed: %s: %s", index, type(exc).__name__, exc)

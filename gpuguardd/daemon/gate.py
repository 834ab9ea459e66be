"""The start gate as the daemon serves it: FreeSinceUsec/WaitingOn and Manager.Wait.

Every inventory observation is judged once per rule in use (the configured one and each one a
Wait caller asked for). Waiters sleep on the next observation that changes a verdict on their
targets, never on timers, so twenty cost what one does. NVML is polled fast only while a
waited-for target is held by no process; a live compute holder is watched through a pidfd.
A "free" answer is confirmed by a holder scan started within the steady time: NVML polls miss
a process holding a device node that NVML does not list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence

from gpuguardd.daemon.inventory import Inventory
from gpuguardd.engine import procfs
from gpuguardd.engine.gate import GateRule, GateTracker, MiB, Target, WaitOutcome, outcome, targets_of
from gpuguardd.records.enums import HolderKind
from gpuguardd.records.models import GpuSummary, Holder, NvmlSnapshot

log = logging.getLogger("gpuguard.gate")

FAST_POLL_SEC = 0.025  # NVML poll interval while a waiter's target is held by no process
MAX_WAIT_SEC = 20.0  # one Wait call: under D-Bus's default 25 s call timeout
SCAN_LEAD_FACTOR = 2.0  # the confirming scan's lead, in scan durations, plus the minimum
SCAN_LEAD_MIN_SEC = 0.01
# A waiter asks for a holder scan older than this, so WaitingOn is current (clients call every ~20 s).
RESCAN_FOR_WAITER_SEC = 30.0
MAX_TRACKERS = 16  # rules kept at once: each costs an evaluation per poll
TRACKER_IDLE_SEC = 600.0  # a rule no one has waited with for this long is dropped


def sweeping_indices(scopes: Sequence[Sequence[int] | None], all_indices: Sequence[int]) -> set[int]:
    """A sweep with no GPU list yet covers every GPU."""
    return {index for gpus in scopes for index in (gpus or all_indices)}


class GateService:
    def __init__(self, inventory: Inventory, sweep_scopes: Callable[[], list[list[int] | None]]) -> None:
        self.inventory = inventory  # its scans publish through observe()
        self.sweep_scopes = sweep_scopes
        self.waiters = 0
        self._trackers: dict[GateRule, tuple[GateTracker, float]] = {}
        # The last observation: summaries, holders and NVML's error (None: it lists the GPUs).
        self._last: tuple[list[GpuSummary], list[Holder], str | None] | None = None
        # Each waiter: its rule, its targets' keys (empty: any change) and the event it sleeps on.
        self._listeners: list[tuple[GateRule, frozenset[tuple[int, str]], asyncio.Event]] = []
        self.fast = False  # poll NVML fast (module docstring)
        self._pidfds: dict[int, int] = {}  # pid of a holder waited on -> its pidfd

    def default_rule(self) -> GateRule:
        config = self.inventory.engine.config
        return GateRule(config.gate_free_below_mib * MiB, config.gate_tolerance_mib * MiB)

    def observe(self, snapshot: NvmlSnapshot, summaries: list[GpuSummary], holders: list[Holder]) -> None:
        if self.waiters:
            holders = self._live(holders)
        self._last = (summaries, holders, None if snapshot.gpus_known else snapshot.error or "not loaded")
        self._tracker(self.default_rule())
        now = time.monotonic()
        changed: dict[GateRule, set[tuple[int, str]]] = {}
        for rule, (tracker, used) in list(self._trackers.items()):
            if rule != self.default_rule() and now - used > TRACKER_IDLE_SEC:
                del self._trackers[rule]
                continue
            changed[rule] = self._feed(tracker)
        for rule, keys, event in self._listeners:
            if not keys or keys & changed.get(rule, set()):
                event.set()
        self._watch()

    def _watch(self) -> None:
        held: set[int] = set()
        fast = False
        for rule, keys, _ in self._listeners:
            found = self._trackers.get(rule)
            states = found[0].states if found else {}
            for key in keys or states:
                state = states.get(key)
                if state is None or not state.held_by:
                    fast = True
                else:
                    held.update(state.held_by)
        loop = asyncio.get_running_loop()
        for pid in set(self._pidfds) - held:
            self._unwatch(loop, pid)
        for pid in held - set(self._pidfds):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._exited(pid)
                continue
            except (AttributeError, OSError):  # no pidfds here (Linux < 5.3): poll instead
                fast = True
                continue
            self._pidfds[pid] = fd
            loop.add_reader(fd, self._exited, pid)
        self.fast = fast

    def _unwatch(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)

    def _exited(self, pid: int) -> None:
        self._unwatch(asyncio.get_running_loop(), pid)
        self.fast = True
        self.inventory.request_rescan()
        self.inventory.wake()

    def _live(self, holders: list[Holder]) -> list[Holder]:
        """Without the compute holders that exited since the scan (asks for a rescan)."""
        kept = []
        for holder in holders:
            if holder.kind == HolderKind.COMPUTE:
                stat = procfs.read_stat(holder.pid)
                if stat is None or (holder.start_time and stat.start_time != holder.start_time):
                    self.inventory.request_rescan()
                    continue
            kept.append(holder)
        return kept

    def _feed(self, tracker: GateTracker) -> set[tuple[int, str]]:
        if self._last is None:
            return set()
        summaries, holders, error = self._last
        sweeping = sweeping_indices(self.sweep_scopes(), [g.index for g in summaries])
        return tracker.observe(time.monotonic(), time.time_ns() // 1000, summaries, holders, error, sweeping)

    def _tracker(self, rule: GateRule) -> GateTracker:
        found = self._trackers.get(rule)
        if found is None:
            if len(self._trackers) >= MAX_TRACKERS:
                oldest = min((r for r in self._trackers if r != self.default_rule()),
                             key=lambda r: self._trackers[r][1])
                del self._trackers[oldest]
            tracker = GateTracker(rule)
            self._feed(tracker)  # judged on the last observation at once
        else:
            tracker = found[0]
        self._trackers[rule] = (tracker, time.monotonic())
        return tracker

    def gpu_values(self, index: int) -> dict[str, object]:
        state = self._tracker(self.default_rule()).states.get((index, ""))
        if state is None:
            return {"free_since_usec": 0, "waiting_on": ["not judged yet"]}
        return {"free_since_usec": state.free_since_usec, "waiting_on": list(state.waiting_on)}

    def _targets(self, gpus: Sequence[int], mig: Sequence[str]) -> list[Target]:
        every = targets_of(self._last[0] if self._last else [])
        if not gpus and not mig:
            return every
        chosen = [t for t in every if t.mig_uuid and t.mig_uuid in mig]
        parents = {t.index for t in chosen}
        chosen += [t for t in every if not t.mig_uuid and t.index in gpus and t.index not in parents]
        return chosen

    async def wait(self, gpus: Sequence[int], mig: Sequence[str], rule: GateRule,
                   stable_sec: float, timeout_sec: float) -> WaitOutcome:
        started = time.monotonic()
        deadline = started + min(timeout_sec, MAX_WAIT_SEC)
        self.waiters += 1
        if self.inventory.scan_age() > RESCAN_FOR_WAITER_SEC:
            self.inventory.request_rescan()
        event = asyncio.Event()
        listener = (rule, frozenset(t.key for t in self._targets(gpus, mig)), event)
        self._listeners.append(listener)
        self._tracker(rule)
        self._watch()
        if self.fast:
            self.inventory.wake()  # poll now, then fast; a held target waits on its holder's pidfd
        asked_scan = -1.0  # when the last confirming scan was asked for (monotonic)
        try:
            while True:
                event.clear()  # before judging: an observation from here on wakes the wait
                found = self._outcome(self._tracker(rule), gpus, mig, started)
                now = found.now
                short = found.short_of(stable_sec)
                # A confirming scan within the steady time, led by its duration to end with it.
                since = max((s.free_since or now for s in found.gpus), default=started)
                lead = min(stable_sec, SCAN_LEAD_FACTOR * self.inventory.scan_cost + SCAN_LEAD_MIN_SEC)
                if short is not None and asked_scan < since and short <= lead:
                    asked_scan = time.monotonic()
                    await self.inventory.scan()
                    continue
                if short is not None and short <= 0:
                    found.free = True
                    return found
                left = deadline - now
                if left <= 0:
                    return found
                pause = left if short is None else min(left, short if asked_scan >= since else short - lead)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), max(0.0, pause))
        finally:
            self.waiters -= 1
            self._listeners.remove(listener)
            self._watch()

    def _outcome(self, tracker: GateTracker, gpus: Sequence[int], mig: Sequence[str], started: float) -> WaitOutcome:
        targets = self._targets(gpus, mig)
        if self._last is None:
            found = outcome(tracker, [], [], None, gpus, False, started, time.monotonic())
            found.waiting_on.append("no GPU list yet")  # (nothing to choose targets from)
            return found
        _, holders, error = self._last
        found = outcome(tracker, targets, holders, error, gpus, bool(gpus or mig), started, time.monotonic())
        if mig and not targets and error is not None:
            found.waiting_on.append(f"NVML unavailable ({error}): MIG instances cannot be found")
        return found

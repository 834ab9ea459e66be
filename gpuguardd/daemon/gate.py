"""The start gate as the daemon serves it: FreeSinceUsec/WaitingOn and Manager.Wait.

The rule is engine/gate.py's. Here it is fed with every observation of the live inventory
(live.py), once per rule in use: the configured one ([Gate] FreeBelowMiB, ToleranceMiB), which
the Gpu objects publish, and one for each other threshold a caller of Wait asked for, kept
while callers use it. A waiter sleeps on the next observation (or on the moment its targets
become stable enough), never on a timer of its own, so twenty waiters cost what one does;
while anyone waits the inventory polls NVML every FAST_POLL_SEC (the service's interval).

Before a Wait answers "free" it asks for a holder scan that starts after the targets had been
stable long enough, and judges again on it: between scans only NVML's side is polled, and a
process that holds a device node without NVML listing it would otherwise be missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gpuguardd.config import Config
from gpuguardd.engine.enums import HolderKind
from gpuguardd.engine.gate import GateRule, GateState, GateTracker, MiB, Target, blockers, holder_line, targets_of
from gpuguardd.engine.models import GpuSummary, Holder, NvmlSnapshot

log = logging.getLogger("gpuguard.gate")

FAST_POLL_SEC = 0.025  # NVML poll interval while someone waits (bench_gate.py measures it)
MAX_WAIT_SEC = 20.0  # one Wait call: under D-Bus's default 25 s call timeout
# A waiter arriving after the last holder scan is older than this asks for one: holders NVML
# does not list (or that it lists before the scan attributes them) are found only by scans.
RESCAN_FOR_WAITER_SEC = 2.0
MAX_TRACKERS = 16  # rules kept at once: each costs an evaluation per poll
TRACKER_IDLE_SEC = 600.0  # a rule no one has waited with for this long is dropped


@dataclass
class WaitOutcome:
    free: bool
    waited_ms: int
    gpus: list[GateState]
    waiting_on: list[str]
    now: float

    def to_dict(self) -> dict[str, object]:
        return {"free": self.free, "waited_ms": self.waited_ms,
                "gpus": [g.to_dict(self.now) for g in self.gpus], "waiting_on": self.waiting_on}


def sweeping_indices(scopes: Sequence[Sequence[int] | None], all_indices: Sequence[int]) -> set[int]:
    """The GPUs running sweeps cover: a sweep not yet resolved, or with no GPU list (a whole
    host, or a unit whose GPUs are not known yet), covers every GPU."""
    covered: set[int] = set()
    for gpus in scopes:
        covered.update(gpus if gpus else all_indices)
    return covered


class GateService:
    def __init__(self, config: Callable[[], Config], scan: Callable[[], Awaitable[object]],
                 wake: Callable[[], None], sweep_scopes: Callable[[], list[list[int] | None]],
                 scan_age: Callable[[], float], rescan: Callable[[], None]) -> None:
        self.config = config
        self.scan = scan  # a holder scan that starts now; publishes through observe()
        self.scan_age = scan_age  # seconds since the last holder scan was published
        self.rescan = rescan  # a holder scan soon, not waited for
        self.wake = wake  # makes the inventory poll now (and then fast while waiters > 0)
        self.sweep_scopes = sweep_scopes
        self.waiters = 0
        self._trackers: dict[GateRule, tuple[GateTracker, float]] = {}
        self._last: tuple[list[GpuSummary], list[Holder], NvmlSnapshot] | None = None
        self._observed = asyncio.Event()

    # -- observations --------------------------------------------------------------------

    def default_rule(self) -> GateRule:
        config = self.config()
        return GateRule(config.gate_free_below_mib * MiB, config.gate_tolerance_mib * MiB)

    def observe(self, snapshot: NvmlSnapshot, summaries: list[GpuSummary],
                holders: list[Holder]) -> None:
        """An inventory observation: every rule in use judges it; waiters wake up."""
        self._last = (summaries, holders, snapshot)
        self._tracker(self.default_rule())
        now = time.monotonic()
        for rule, (tracker, used) in list(self._trackers.items()):
            if rule != self.default_rule() and now - used > TRACKER_IDLE_SEC:
                del self._trackers[rule]
                continue
            self._feed(tracker)
        self._observed.set()
        self._observed = asyncio.Event()

    def _feed(self, tracker: GateTracker) -> None:
        if self._last is None:
            return
        summaries, holders, snapshot = self._last
        sweeping = sweeping_indices(self.sweep_scopes(), [g.index for g in summaries])
        tracker.observe(time.monotonic(), time.time_ns() // 1000, summaries, holders,
                        None if snapshot.available else (snapshot.error or "not loaded"), sweeping)

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
        """The Gpu object's FreeSinceUsec and WaitingOn (the configured rule)."""
        state = self._tracker(self.default_rule()).states.get((index, ""))
        if state is None:
            return {"free_since_usec": 0, "waiting_on": ["not judged yet"]}
        return {"free_since_usec": state.free_since_usec, "waiting_on": list(state.waiting_on)}

    # -- Wait ----------------------------------------------------------------------------

    def _targets(self, gpus: Sequence[int], mig: Sequence[str]) -> list[Target]:
        summaries = self._last[0] if self._last else []
        every = targets_of(summaries)
        if not gpus and not mig:
            return every
        chosen = [t for t in every if t.mig_uuid and t.mig_uuid in mig]
        parents = {t.index for t in chosen}
        chosen += [t for t in every if not t.mig_uuid and t.index in gpus and t.index not in parents]
        return chosen

    async def wait(self, gpus: Sequence[int], mig: Sequence[str], rule: GateRule,
                   stable_sec: float, timeout_sec: float) -> WaitOutcome:
        """Until every target is free and stable for `stable_sec` (confirmed by a holder scan
        that started after that), or `timeout_sec`."""
        started = time.monotonic()
        deadline = started + min(timeout_sec, MAX_WAIT_SEC)
        self.waiters += 1
        self.wake()
        if self.scan_age() > RESCAN_FOR_WAITER_SEC:
            self.rescan()
        try:
            while True:
                tracker = self._tracker(rule)
                outcome = self._outcome(tracker, gpus, mig, started)
                now = time.monotonic()
                ready = not outcome.waiting_on and all(s.free_since is not None for s in outcome.gpus)
                short = min((stable_sec - s.stable_for(now) for s in outcome.gpus), default=0.0)
                if ready and short <= 0:
                    await self.scan()
                    confirmed = self._outcome(self._tracker(rule), gpus, mig, started)
                    now = time.monotonic()
                    if not confirmed.waiting_on and all(s.stable_for(now) >= stable_sec and not s.waiting_on
                                for s in confirmed.gpus):
                        confirmed.free = True
                        return confirmed
                    continue
                left = deadline - now
                if left <= 0:
                    return outcome
                observed = self._observed
                pause = min(left, short) if ready else left
                try:
                    await asyncio.wait_for(observed.wait(), pause)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiters -= 1

    def _outcome(self, tracker: GateTracker, gpus: Sequence[int], mig: Sequence[str],
                 started: float) -> WaitOutcome:
        now = time.monotonic()
        targets = self._targets(gpus, mig)
        states = [tracker.states[t.key] for t in targets if t.key in tracker.states]
        waiting_on: list[str] = []
        if not targets and self._last is not None:
            _, holders, snapshot = self._last
            if not snapshot.available:
                # No GPU list to judge: fail closed, unless the caller allows unverified GPUs,
                # who then pass on their holders alone (any compute holder when none is named).
                error = snapshot.error or "not loaded"
                for index in gpus or [-1]:
                    found = blockers(Target(index, ""), None, holders, tracker.rule, error, False)
                    if index == -1:
                        found += [f"GPU {','.join(map(str, h.gpus))}: {line}" for h, line in
                                  _compute_lines(holders) if h.gpus]
                    waiting_on += [w for w in found if w not in waiting_on]
                if mig:
                    waiting_on.append(f"NVML unavailable ({error}): MIG instances cannot be found")
            elif gpus or mig:
                waiting_on.append("none of the GPUs asked for is listed by NVML")
        elif not targets:
            waiting_on.append("no GPU list yet")
        return WaitOutcome(False, int((now - started) * 1000), states, waiting_on, now)


def _compute_lines(holders: Sequence[Holder]) -> list[tuple[Holder, str]]:
    return [(h, holder_line(h)) for h in holders if h.kind == HolderKind.COMPUTE]

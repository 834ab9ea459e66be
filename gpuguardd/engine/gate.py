"""The start gate's rule: when a GPU (or MIG instance) is free for the next job, and since when.

The driver frees memory asynchronously, over seconds, and it can grow back before it settles; a
server that profiles free memory at start-up aborts when it moves (vLLM issue 56830). So a
target is free when the judge finds nothing blocking it and its memory has since moved no more
than `tolerance` (a larger move restarts the clock). The daemon and `gpuguardctl wait --local`
both apply this code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from gpuguardd.engine.judge import Reason, facts_of_record, judge, may_be_on
from gpuguardd.escaping import escape_text
from gpuguardd.records.enums import Why
from gpuguardd.records.models import GpuSummary, Holder, MigSummary

MiB = 1024 * 1024
# Holders named one by one in WaitingOn; more are counted, so a busy GPU's reason stays short.
MAX_NAMED_HOLDERS = 4
_WORDS = {Why.NOT_LISTED: "not listed by NVML", Why.LOST: "lost (fell off the bus)",
          Why.UNREADABLE: "its memory cannot be read", Why.PROCESSES: "NVML lists processes on it",
          Why.FOREIGN: "NVML lists processes on it", Why.ENDING: "NVML lists processes on it"}


@dataclass(frozen=True)
class GateRule:
    free_below: int  # bytes: memory in use must be below this
    tolerance: int  # bytes: a move larger than this restarts the stability clock
    allow_unverified: bool = False  # a GPU whose memory cannot be read may pass


@dataclass(frozen=True)
class Target:
    """A whole GPU (mig_uuid "") or one MIG instance of it."""

    index: int
    uuid: str
    mig_uuid: str = ""

    @property
    def key(self) -> tuple[int, str]:
        return self.index, self.mig_uuid


@dataclass
class GateState:
    target: Target
    memory_used: int = 0
    waiting_on: list[str] = field(default_factory=list)
    free_since: float | None = None  # monotonic seconds; None while something blocks it
    free_since_usec: int = 0  # the same moment on CLOCK_REALTIME, for clients to show
    held_by: list[int] = field(default_factory=list)  # pids of compute holders that may be on it
    reference: int = 0  # memory used when it last became free: the stability clock's figure

    def settle(self, now: float, wall_usec: int, used: int, blocked: bool, tolerance: int) -> None:
        if blocked:
            self.free_since, self.free_since_usec = None, 0
        elif self.free_since is None or abs(used - self.reference) > tolerance:
            self.free_since, self.free_since_usec, self.reference = now, wall_usec, used

    def stable_for(self, now: float) -> float:
        return 0.0 if self.free_since is None else max(0.0, now - self.free_since)

    def to_dict(self, now: float) -> dict[str, object]:
        return {"index": self.target.index, "uuid": self.target.uuid,
                "mig_uuid": self.target.mig_uuid, "memory_used": self.memory_used,
                "free_since_usec": self.free_since_usec,
                "stable_ms": int(self.stable_for(now) * 1000), "waiting_on": list(self.waiting_on)}


def holder_line(holder: Holder) -> str:
    unit = f" unit {escape_text(holder.unit)}" if holder.unit else ""
    return f"compute holder pid {holder.pid} ({escape_text(holder.comm)}){unit}"


@dataclass
class WaitOutcome:
    free: bool
    waited_ms: int
    gpus: list[GateState]
    waiting_on: list[str]
    now: float  # monotonic

    def to_dict(self) -> dict[str, object]:
        return {"free": self.free, "waited_ms": self.waited_ms,
                "gpus": [g.to_dict(self.now) for g in self.gpus], "waiting_on": self.waiting_on}

    def short_of(self, stable_sec: float) -> float | None:
        """Seconds until every target has been free for `stable_sec` (<= 0: now); None if blocked."""
        if self.waiting_on or any(s.free_since is None for s in self.gpus):
            return None
        return min((stable_sec - s.stable_for(self.now) for s in self.gpus), default=0.0)


def outcome(tracker: GateTracker, targets: Sequence[Target], holders: Sequence[Holder], nvml_error: str | None,
            gpus: Sequence[int], asked: bool, started: float, now: float) -> WaitOutcome:
    """With no GPU list (`nvml_error`): judged on the holders of `gpus` (none: any GPU)."""
    states = [tracker.states[t.key] for t in targets if t.key in tracker.states]
    waiting_on: list[str] = []
    if not targets and nvml_error is not None:
        for index in gpus or [-1]:
            found = blockers(Target(index, ""), None, holders, tracker.rule, nvml_error, False)
            waiting_on += [w for w in found if w not in waiting_on]
    elif not targets and asked:
        waiting_on.append("none of the GPUs asked for is listed by NVML")
    return WaitOutcome(False, int((now - started) * 1000), states, waiting_on, now)


def blockers(target: Target, record: GpuSummary | MigSummary | None, holders: Sequence[Holder],
             rule: GateRule, nvml_error: str | None, sweeping: bool) -> list[str]:
    """WaitingOn's words ([]: free). `record` None: not listed by NVML; index -1: any GPU."""
    index = None if target.index < 0 else target.index
    # The gate's line, or the GPU's own released line where that is higher (an AMD GPU's).
    line = max(rule.free_below, record.released_below if isinstance(record, GpuSummary) else 0)
    verdict = judge(facts_of_record(index, target.mig_uuid, record, holders, nvml_error, sweeping), line)
    return words(verdict.blocking(rule.allow_unverified), line, any_gpu=index is None)


def words(reasons: Sequence[Reason], line: int, any_gpu: bool = False) -> list[str]:
    lines: list[str] = []
    held = sum(1 for r in reasons if r.holder is not None)
    named = 0
    for reason in reasons:
        why = reason.why
        if why == Why.SWEEPING:
            lines.append("a sweep of its GPU is running")
        elif reason.holder is not None:
            named += 1
            on = reason.holder.gpus
            if any_gpu and on:
                lines.append(f"GPU {','.join(map(str, on))}: {holder_line(reason.holder)}")
            elif named <= MAX_NAMED_HOLDERS:
                lines.append(holder_line(reason.holder))
            elif named == MAX_NAMED_HOLDERS + 1:
                lines.append(f"and {held - MAX_NAMED_HOLDERS} more compute holder(s)")
        elif why == Why.NO_BACKEND:
            lines.append(f"NVML unavailable ({escape_text(reason.detail)}): memory cannot be checked")
        elif why in (Why.MEMORY, Why.LEAKED):
            lines.append(f"memory in use at or above {line // MiB} MiB")
        elif why in _WORDS:
            lines.append(_WORDS[why])
    return list(dict.fromkeys(lines))


def targets_of(gpus: Iterable[GpuSummary]) -> list[Target]:
    return [Target(g.index, g.uuid, mig) for g in gpus for mig in ("", *(m.uuid for m in g.mig_instances or []))]


def record_of(target: Target, gpus: Sequence[GpuSummary]) -> GpuSummary | MigSummary | None:
    gpu = next((g for g in gpus if g.index == target.index and g.uuid == target.uuid), None)
    if gpu is None or not target.mig_uuid:
        return gpu
    return next((m for m in gpu.mig_instances or [] if m.uuid == target.mig_uuid), None)


class GateTracker:
    def __init__(self, rule: GateRule) -> None:
        self.rule = rule
        self.states: dict[tuple[int, str], GateState] = {}

    def observe(self, now: float, wall_usec: int, gpus: Sequence[GpuSummary], holders: Sequence[Holder],
                nvml_error: str | None, sweeping: Iterable[int]) -> set[tuple[int, str]]:
        """`sweeping`: the GPUs running sweeps cover. Returns the keys whose verdict changed."""
        covered = set(sweeping)
        changed: set[tuple[int, str]] = set()
        targets = {t.key: t for t in targets_of(gpus)}
        for key in list(self.states):
            if key not in targets:
                del self.states[key]
                changed.add(key)
        for key, target in targets.items():
            record = record_of(target, gpus)
            reasons = blockers(target, record, holders, self.rule, nvml_error, target.index in covered)
            used = record.memory_used if record is not None else 0
            held = [h.pid for h in holders if may_be_on(h, target.index, target.mig_uuid)]
            old = self.states.get(key, GateState(target))
            state = replace(old, target=target, memory_used=used, waiting_on=reasons, held_by=held)
            state.settle(now, wall_usec, used, bool(reasons), self.rule.tolerance)
            if key not in self.states or old.free_since != state.free_since or old.waiting_on != reasons:
                changed.add(key)
            self.states[key] = state
        return changed

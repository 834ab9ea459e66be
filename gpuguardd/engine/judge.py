"""The one judge of "is this GPU (or MIG instance) free?", for every vendor and every surface
(Gpu State, the start gate, `gpuguardctl check`, a sweep's verification, AutoReset): nothing
else decides, so no two of them can disagree on the same facts.

Safe side first: a compute holder that may be on it, a live or foreign listed pid, or a running
sweep makes it in use; figures not read or not current (no NVML, unlisted, lost, unreadable) are
never free. Leak kinds (docs/recovery.md): no-process (rocm-systems 8263), dead-pids
(vllm-dashboard 182; only where NVML's pids are this /proc's), stuck-in-driver (vllm 25127).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gpuguardd.engine import procfs
from gpuguardd.records.enums import GpuState, HolderKind, LeakKind, Why
from gpuguardd.records.models import GpuInfo, GpuSummary, Holder, MigInstance, MigSummary

UNNAMED = 0  # a pid a summary's verdict implies without naming it (facts_of_record)
UNVERIFIED = frozenset({Why.NO_BACKEND, Why.UNREADABLE})  # figures that prove nothing: allow_unverified passes
HARMLESS = frozenset({Why.SUSPENDED})  # reasons that leave it free


@dataclass(frozen=True)
class Facts:
    backend_error: str | None = None  # NVML does not answer (why): nothing below was read
    listed: bool = True  # NVML lists it
    suspended: bool = False
    lost: bool = False
    unreadable: bool = False
    error: str = ""
    used: int = 0  # bytes in use
    released_below: int = 0  # bytes: at or below this its memory counts as released
    live: tuple[int, ...] = ()  # pids NVML lists on it that live here
    live_bytes: int = 0  # what NVML charges to them
    dead: tuple[int, ...] = ()  # pids NVML lists on it that do not exist here
    foreign: tuple[int, ...] = ()  # pids NVML lists by another PID namespace's numbers
    ending: tuple[int, ...] = ()  # listed pids the caller ended and still waits for
    stuck: tuple[int, ...] = ()  # listed pids a sweep left asleep in the driver (D state)
    holders: tuple[Holder, ...] = ()  # compute holders that may be on it (may_be_on)
    sweeping: bool = False  # a sweep of its GPU is running


@dataclass(frozen=True)
class Reason:
    why: Why
    holder: Holder | None = None  # Why.HOLDER: which
    detail: str = ""  # Why.NO_BACKEND, LOST, UNREADABLE: the backend's error


@dataclass(frozen=True)
class Judgement:
    state: GpuState  # IDLE is "free"
    reasons: tuple[Reason, ...] = ()
    leak: LeakKind | None = None  # the kind of memory not released with nobody computing on it
    released: bool = False  # its memory is back: at or below the line plus what live pids hold

    def blocking(self, allow_unverified: bool = False) -> list[Reason]:
        return [r for r in self.reasons if r.why not in HARMLESS
                and not (allow_unverified and r.why in UNVERIFIED)]

    def has(self, why: Why) -> bool:
        return any(r.why == why for r in self.reasons)


def may_be_on(holder: Holder, index: int | None, mig_uuid: str = "") -> bool:
    """On GPU `index` (None: any) or its MIG instance `mig_uuid`? An unknown one counts as this one."""
    if holder.kind != HolderKind.COMPUTE:
        return False
    if index is not None and holder.gpus and index not in holder.gpus:
        return False
    if mig_uuid and holder.mig:
        return any(m.lower() == mig_uuid.lower() for m in holder.mig)
    return True


def judge(facts: Facts, free_below: int | None = None) -> Judgement:
    """The verdict on `facts`. `free_below`: the gate's line in bytes (None: the released line)."""
    f = facts
    reasons = [Reason(Why.SWEEPING)] if f.sweeping else []
    reasons += [Reason(Why.HOLDER, holder=h) for h in f.holders]
    busy = bool(f.holders)
    if f.backend_error is not None:
        reasons.append(Reason(Why.NO_BACKEND, detail=f.backend_error))
        return Judgement(GpuState.IN_USE if busy else GpuState.UNKNOWN, tuple(reasons))
    if not f.listed:
        reasons.append(Reason(Why.NOT_LISTED))
        return Judgement(GpuState.UNKNOWN, tuple(reasons))
    if f.unreadable and not (f.suspended or f.lost):
        reasons.append(Reason(Why.UNREADABLE, detail=f.error))
        return Judgement(GpuState.UNKNOWN, tuple(reasons))
    listed = set(f.live) | set(f.dead) | set(f.foreign)
    leak = None
    if f.foreign:
        reasons.append(Reason(Why.FOREIGN))
    elif not listed:
        leak = LeakKind.NO_PROCESS
    elif not f.live:
        leak = LeakKind.DEAD_PIDS
    if not leak and set(f.stuck) & listed:
        leak = LeakKind.STUCK
    if f.ending:
        reasons.append(Reason(Why.ENDING))
    if f.live and not busy and not f.foreign:
        reasons.append(Reason(Why.PROCESSES))
    released = not f.ending and not f.foreign and f.used <= f.released_below + f.live_bytes
    if f.suspended or f.lost:
        reasons.append(Reason(Why.SUSPENDED) if f.suspended else Reason(Why.LOST, detail=f.error))
        state, released, leak = (GpuState.SUSPENDED if f.suspended else GpuState.LOST), False, None
    elif busy or f.live or f.foreign:
        state = GpuState.IN_USE
    elif f.used > f.released_below:
        state = GpuState.LEAKED
    else:
        state = GpuState.IDLE
    if free_below is not None:
        if f.used >= free_below:
            reasons.append(Reason(Why.MEMORY))
    elif state == GpuState.LEAKED:
        reasons.append(Reason(Why.LEAKED))
    return Judgement(state, tuple(reasons), None if released or busy else leak, released)


def released_line(gpu: GpuInfo, configured: int) -> int:
    return configured if gpu.released_below is None else gpu.released_below


def facts_of(gpu: GpuInfo, instance: MigInstance | None, holders: Sequence[Holder],
             released_below: int, pids_local: bool, *,
             ending: Collection[int] = (), stuck: Collection[int] = ()) -> Facts:
    memory: GpuInfo | MigInstance = gpu if instance is None else instance
    listed = memory.processes
    live = [pid for pid in listed if procfs.pid_exists(pid)] if pids_local else []
    dead = [pid for pid in listed if pid not in live] if pids_local else []
    return Facts(
        suspended=gpu.suspended, lost=gpu.lost,
        unreadable=gpu.unknown or bool(memory.error and not memory.memory_total),
        error=gpu.error or memory.error, used=memory.memory_used,
        released_below=released_line(gpu, released_below), live=tuple(live),
        live_bytes=sum(listed[p] or 0 for p in live if p not in ending), dead=tuple(dead),
        foreign=() if pids_local else tuple(listed),
        ending=tuple(p for p in listed if p in ending),
        stuck=tuple(p for p in listed if p in stuck),
        holders=tuple(h for h in holders if may_be_on(h, gpu.index, instance.uuid if instance else "")))


def facts_of_record(index: int | None, mig_uuid: str, record: GpuSummary | MigSummary | None,
                    holders: Sequence[Holder], backend_error: str | None,
                    sweeping: bool = False) -> Facts:
    """A published summary's facts (the daemon's judgement), with the holders and sweeps known now."""
    on = tuple(h for h in holders if may_be_on(h, index, mig_uuid))
    if backend_error is not None:
        return Facts(backend_error=backend_error, holders=on, sweeping=sweeping)
    if record is None:
        return Facts(listed=False, holders=on, sweeping=sweeping)
    state = record.state if "state" not in record.unread else GpuState.UNKNOWN
    used = record.memory_used
    return Facts(
        suspended=state == GpuState.SUSPENDED, lost=state == GpuState.LOST,
        unreadable=state == GpuState.UNKNOWN, error=getattr(record, "error", ""), used=used,
        # The daemon judged the line: leaked is above it, anything else not.
        released_below=used - 1 if state == GpuState.LEAKED else used,
        live=(UNNAMED,) if state == GpuState.IN_USE else (),
        dead=(UNNAMED,) if record.leak_kind == LeakKind.DEAD_PIDS.value else (),
        holders=on, sweeping=sweeping)


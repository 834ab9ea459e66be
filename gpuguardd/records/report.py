"""A sweep's report and its entries: docs/contract.md's keys in the wire's order. An entry about a
process is built from its holder (Target.of, Survivor.of, Spared.of), so each list names it alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from gpuguardd.records.codec import WireRecord
from gpuguardd.records.enums import HolderKind, Outcome, RequesterKind, SpareReason, SurvivorReason, WarningCode

if TYPE_CHECKING:
    from gpuguardd.records.models import Holder, Scope


@dataclass
class ReportScope(WireRecord):
    """What a sweep covered, resolved (GPU indices, not what the caller typed)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"mig", "adopted_pids", "slurm_job", "slurm_uid", "grace_ms"})

    gpus: list[int] = field(default_factory=list)
    unit: str = ""
    container: str = ""
    include_management: bool = False
    mig: list[str] = field(default_factory=list)
    adopted_pids: list[int] = field(default_factory=list)
    slurm_job: str = ""
    slurm_uid: int | None = None  # with slurm_job only
    grace_ms: int | None = None

    @classmethod
    def of(cls, scope: Scope, grace_ms: int | None = None) -> ReportScope:
        return cls(gpus=list(scope.gpus), unit=scope.unit, container=scope.container,
                   include_management=scope.include_management, mig=list(scope.mig),
                   adopted_pids=[pid for pid, _ in scope.adopted], slurm_job=scope.slurm_job,
                   slurm_uid=scope.slurm_uid if scope.slurm_job else None, grace_ms=grace_ms)


@dataclass
class Target(WireRecord):
    """A process the sweep set out to end (the plan; also in dry runs)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"mig"})

    pid: int
    comm: str = ""
    unit: str = ""
    container: str = ""
    kind: HolderKind = HolderKind.MANAGEMENT
    gpus: list[int] = field(default_factory=list)
    gpu_memory: int = 0
    exe: str = ""
    mig: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, holder: Holder) -> Target:
        return cls(pid=holder.pid, comm=holder.comm, unit=holder.unit, container=holder.container,
                   kind=holder.kind, gpus=list(holder.gpus), gpu_memory=holder.gpu_memory,
                   exe=holder.exe, mig=list(holder.mig))


@dataclass
class Terminated(WireRecord):
    """A process that ended during the sweep, and our signal that ended it ("": it exited itself)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"exit_status", "zombie_parent", "uid"})

    pid: int
    comm: str = ""
    unit: str = ""
    uid: int | None = None  # its owner as the scan read it, for a desktop to tell its user
    signal: str = ""
    exited_after_ms: int = 0
    exit_status: str = ""  # as the kernel still had it: "killed by SIGTERM", "exited with status 0"
    zombie_parent: int | None = None  # exited, not reaped: the parent that should reap it


@dataclass
class Survivor(WireRecord):
    """A process the sweep could not end, and why: `code` for programs, `why` for people."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"code"})  # absent before the codes: OTHER

    pid: int
    comm: str = ""
    unit: str = ""
    state: str = ""  # /proc state: "D", "Z", "R"...; "" once it has gone
    why: str = ""
    code: SurvivorReason = SurvivorReason.OTHER

    @classmethod
    def of(cls, holder: Holder, code: SurvivorReason, why: str, state: str | None = None) -> Survivor:
        """`state` when it was read after the scan."""
        return cls(pid=holder.pid, comm=holder.comm, unit=holder.unit,
                   state=holder.state if state is None else state, why=why, code=code)


@dataclass
class Spared(WireRecord):
    """A process in (or touching) the scope left alone on purpose: `code` for programs, `why` for people."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"code"})  # absent before the codes: OTHER

    pid: int
    comm: str = ""
    unit: str = ""
    why: str = ""
    code: SpareReason = SpareReason.OTHER

    @classmethod
    def of(cls, holder: Holder, code: SpareReason, why: str) -> Spared:
        return cls(pid=holder.pid, comm=holder.comm, unit=holder.unit, why=why, code=code)


@dataclass
class GpuResult(WireRecord):
    """One GPU (or MIG instance, by mig_uuid) the sweep verified: its memory before and after."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"mig_uuid"})

    index: int
    uuid: str = ""
    memory_used_before: int = 0
    memory_total: int = 0
    mig_uuid: str = ""
    memory_used_after: int = 0
    released: bool = False


@dataclass
class Leak(WireRecord):
    """Memory still in use on a GPU (or MIG instance) with no process holding it."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"mig_uuid", "kind"})

    gpu: int
    uuid: str = ""
    bytes: int = 0
    mig_uuid: str = ""
    kind: str = ""  # a LeakKind (engine/judge.py); absent from records older than the kinds


@dataclass
class Report(WireRecord):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"resumes", "finished_by", "kind", "steps",
                                                     "requester_kind", "warning_codes"})

    # Every field has a value from the start, so that the declaration order can be the wire's.
    id: str = ""
    started_usec: int = 0
    duration_ms: int = 0
    requested_by: str = ""
    reason: str = ""
    scope: ReportScope = field(default_factory=ReportScope)
    dry_run: bool = False
    # A record read back without a readable outcome claims nothing: never "freed".
    outcome: Outcome = field(default=Outcome.NOTHING, metadata={"unread": Outcome.ERROR})
    verified: bool = False
    targets: list[Target] = field(default_factory=list)
    terminated: list[Terminated] = field(default_factory=list)
    survived: list[Survivor] = field(default_factory=list)
    spared: list[Spared] = field(default_factory=list)
    gpus: list[GpuResult] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    # A sweep cut short by the daemon's death and the one that finished it name each other.
    resumes: str = ""
    finished_by: str = ""
    # REPORT_RESET for a GPU reset (engine/reset.py), with its every step; absent for a sweep.
    kind: str = ""
    steps: list[str] = field(default_factory=list)
    requester_kind: RequesterKind = RequesterKind.MANUAL  # the metrics' trigger label
    # warning_codes[i] is warnings[i]'s; one past its end has none (a record older than the
    # codes, the note a copy trimmed for the bus ends with). Consumers test codes, not words.
    warning_codes: list[WarningCode] = field(default_factory=list)

    def warn(self, text: str, code: WarningCode = WarningCode.OTHER) -> None:
        self.code_warnings()
        self.warnings.append(text)
        self.warning_codes.append(code)

    def code_warnings(self, code: WarningCode = WarningCode.OTHER) -> None:
        """Give `code` to every warning added without one (by warnings.append) so far."""
        self.warning_codes.extend([code] * (len(self.warnings) - len(self.warning_codes)))

    def warnings_of(self, codes: Collection[WarningCode]) -> list[str]:
        return [text for text, code in zip(self.warnings, self.warning_codes) if code in codes]


REPORT_RESET = "reset"

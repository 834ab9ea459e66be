"""The closed vocabularies of gpuguard's records: sweep outcomes, GPU states, holder kinds.

Each is a `str` enum whose values are the contract's words (docs/contract.md), so a member
compares, hashes, formats and serialises (json, D-Bus `s`) as its value: the wire does not
change, and code names members instead of repeating strings. `enum.StrEnum` would do the
same but needs Python 3.11; the explicit __str__ gives that behaviour on 3.9 and 3.10 too
(without it, 3.11's format() of a `(str, Enum)` member would print "Outcome.FREED").
"""

from __future__ import annotations

from enum import Enum


class WireEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class Outcome(WireEnum):
    FREED = "freed"
    NOTHING = "nothing-to-do"
    SURVIVORS = "survivors"
    NOT_RELEASED = "memory-not-released"
    DRY_RUN = "dry-run"
    ERROR = "error"
    # Processes ended, but without NVML nobody can say the memory came back: never "freed".
    UNVERIFIED = "unverified"
    # gpuguardd died (a crash, a kill, an upgrade's restart) while the sweep ran; the report's
    # `finished_by` names the sweep that finished it after the restart (daemon/resume.py).
    INTERRUPTED = "interrupted"
    # A GPU reset's record (report kind "reset", engine/reset.py): done and verified, refused
    # before anything was touched (the report's error says why), or tried and not verified.
    RESET = "reset"
    RESET_REFUSED = "reset-refused"
    RESET_FAILED = "reset-failed"


class GpuState(WireEnum):
    IDLE = "idle"
    IN_USE = "in-use"
    LEAKED = "leaked"
    LOST = "lost"
    # NVML could not say how the GPU is (hung, or its handle or memory query failed): never "idle".
    UNKNOWN = "unknown"
    # Runtime-suspended (powered down by the kernel's runtime PM): not asked, so as not to wake
    # it; its memory figures are the last ones read.
    SUSPENDED = "suspended"


class LeakKind(WireEnum):
    """What a leak looks like (engine/judge.py): memory in use with no process listed at all;
    memory NVML attributes to processes that no longer exist; processes that outlived a sweep
    stuck in D state in the driver. Only a GPU reset or a reboot frees any of them."""

    NO_PROCESS = "no-process"
    DEAD_PIDS = "dead-pids"
    STUCK = "stuck-in-driver"


class Vendor(WireEnum):
    """Whose driver a GPU runs on: which backend reads it (NVML, or the amdgpu driver's KFD and
    DRM files in sysfs) and which device nodes its holders hold."""

    NVIDIA = "nvidia"
    AMD = "amd"


class HolderKind(WireEnum):
    COMPUTE = "compute"  # has a CUDA context: holds /dev/nvidia-uvm, or NVML lists it
    MANAGEMENT = "management"  # NVML-style handles only: nvidia-smi, exporters, gpuguardd


class GpusFrom(WireEnum):
    """Where a holder's `gpus` come from: NVML's per-GPU process lists, or (for a process NVML
    does not list) the GPU nodes it holds, which say only that it uses the driver: a CUDA
    process opens every GPU's node whichever GPU it computes on."""

    NVML = "nvml"
    # AMD: KFD's per-process VRAM entries or DRM fdinfo say which GPU it has memory on.
    KFD = "kfd"
    NODES = "nodes"
    NONE = ""  # it holds no GPU at all


class Why(WireEnum):
    """Why the judge (engine/judge.py) says a GPU or MIG instance is not free, one code a
    reason; each surface words them its own way (WaitingOn, `check`, a sweep's warnings)."""

    SWEEPING = "sweeping"  # a sweep of its GPU is running
    HOLDER = "holder"  # a compute holder may be on it (protected or not, GPU told or not)
    NO_BACKEND = "no-backend"  # NVML does not answer: its memory cannot be checked
    NOT_LISTED = "not-listed"  # NVML answers but does not list it
    LOST = "lost"  # fell off the bus
    UNREADABLE = "unreadable"  # its state or memory cannot be read
    SUSPENDED = "suspended"  # runtime-suspended: its figures are the last ones read
    PROCESSES = "processes"  # NVML lists live processes on it (none of them a holder found)
    FOREIGN = "foreign-pids"  # NVML lists pids of another PID namespace: whose, nobody can say
    ENDING = "ending"  # processes the caller ended are still listed on it
    LEAKED = "leaked"  # memory above the released line with nobody holding it
    MEMORY = "memory"  # memory in use at or above the caller's line (the gate's FreeBelowMiB)


class SpareReason(WireEnum):
    """Why a sweep left a process alone (a report's spared entries' `code`; their `why` words
    it for people). Decided where the process is judged: protection.py for those never to be
    signalled, sweep.py's plan for the rest. The metrics count spared processes by it."""

    INIT = "init"  # PID 1
    KERNEL_THREAD = "kernel-thread"
    SELF = "self"  # gpuguardd (or gpuguardctl --local) itself
    ANCESTOR = "ancestor"  # one of the sweeping process's callers
    EXECUTABLE_UNKNOWN = "executable-unknown"  # /proc/PID/exe unreadable: cannot rule one out
    PROTECTED_EXECUTABLE = "protected-executable"  # [Sweep] ProtectedExecutables
    PROTECTED_UNIT = "protected-unit"  # [Sweep] ProtectedUnits
    MANAGEMENT = "management"  # a management client, and the scope does not include them
    NO_DEVICE_HERE = "no-device-here"  # NVML lists it, but it holds no device here
    OTHER_GPU = "other-gpu"  # it also holds a GPU outside the scope
    OTHER_MIG_INSTANCE = "other-mig-instance"  # it also runs in a MIG instance outside the scope
    # Read back from a record that carries no code (written before the codes).
    OTHER = "other"


class SurvivorReason(WireEnum):
    """Why a sweep could not end a process (a report's survived entries' `code`; their `why`
    words it for people). Decided where the survivor is recorded: engine/sweep.py, and
    engine/process.survivor_reason for those still there after SIGKILL."""

    ZOMBIE = "zombie"  # exited, not reaped: only its parent can release it
    UNINTERRUPTIBLE = "uninterruptible"  # in D state: SIGKILL is pending until it wakes
    STILL_RUNNING = "still-running"  # neither: still running after SIGKILL
    PERMISSION_DENIED = "permission-denied"  # a signal of ours was refused (not root)
    REAPPEARED = "reappeared"  # holders kept appearing, round after round: the last ones
    EXITED = "exited"  # gone by the time it was recorded, after the wait for it had ended
    # Read back from a record that carries no code (written before the codes).
    OTHER = "other"


class RequesterKind(WireEnum):
    """Who asked for a sweep or a reset, as the daemon decided when the request came (a
    report's `requester_kind`; `requested_by` words it for people). The metrics' `trigger`
    label is read from it, never from requested_by or the caller's reason."""

    HOOK = "hook"  # root's ExecStopPost drop-in (its reason is the hook's, dropins.py)
    # Someone else than root whose reason is the hook's: named as a manual caller, but the
    # unit watch still takes its real sweep as the stop's one sweep.
    HOOK_NONROOT = "hook-nonroot"
    WATCH = "watch"  # the unit watch, at a watched unit's stop
    SLURM = "slurm"  # root's Slurm epilog (a slurm_job request)
    RECOVERED = "recovered"  # a unit that stopped while no gpuguardd ran (daemon/resume.py)
    AUTO_RESET = "auto-reset"  # [Recovery] AutoReset's GPU reset (daemon/recovery.py)
    MANUAL = "manual"  # anyone else: an admin, a script, a user's dry run


class WarningCode(WireEnum):
    """What a report's warning is about (a report's `warning_codes`, one for each entry of
    `warnings`, in the same order). Consumers that act on a kind of warning (the Slurm
    epilog's drain reason) test the code; the text is for people."""

    # NVML did not answer: no GPU's memory can be verified.
    NVML_UNAVAILABLE = "nvml-unavailable"
    # A GPU's (or MIG instance's) memory could not be read, or proves nothing (hung, lost,
    # suspended, NVML's pids another namespace's): it was not verified.
    MEMORY_UNVERIFIED = "memory-unverified"
    # The GPU lock directory or a lock file could not be used: sweeps (and resets) of the
    # same GPU are not serialized.
    LOCKS_UNAVAILABLE = "locks-unavailable"
    # A reset turned persistence mode off and could not turn it back on.
    PERSISTENCE_NOT_RESTORED = "persistence-not-restored"
    OTHER = "other"


# The warnings that say why a sweep's memory could not be verified (engine/slurm.summary).
UNVERIFIED_WARNINGS = frozenset({WarningCode.NVML_UNAVAILABLE, WarningCode.MEMORY_UNVERIFIED})

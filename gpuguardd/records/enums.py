"""The closed vocabularies of records: `str` enums whose values are docs/contract.md's words, so a
member compares, hashes and serialises as its value. __str__ as 3.11's StrEnum: format() is "freed".
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
    UNVERIFIED = "unverified"  # processes ended, but nobody can say the memory came back
    INTERRUPTED = "interrupted"  # gpuguardd died mid-sweep; `finished_by` names who finished it
    RESET = "reset"  # a GPU reset's, done and verified
    RESET_REFUSED = "reset-refused"  # refused before anything was touched
    RESET_FAILED = "reset-failed"  # not verified


class GpuState(WireEnum):
    IDLE = "idle"
    IN_USE = "in-use"
    LEAKED = "leaked"
    LOST = "lost"
    UNKNOWN = "unknown"  # hung, or its handle or memory query failed: never "idle"
    SUSPENDED = "suspended"  # runtime PM: not asked, so not woken; memory as last read


class LeakKind(WireEnum):
    """What a leak looks like (engine/judge.py); only a GPU reset or a reboot frees any of them."""

    NO_PROCESS = "no-process"
    DEAD_PIDS = "dead-pids"
    STUCK = "stuck-in-driver"


class Vendor(WireEnum):
    """Whose driver a GPU runs on: which backend reads it and which nodes its holders hold."""

    NVIDIA = "nvidia"
    AMD = "amd"


class HolderKind(WireEnum):
    COMPUTE = "compute"  # has a CUDA context: holds /dev/nvidia-uvm, or NVML lists it
    MANAGEMENT = "management"  # NVML-style handles only: nvidia-smi, exporters, gpuguardd


class GpusFrom(WireEnum):
    """Where a holder's `gpus` come from; a CUDA process opens every GPU's node, whichever it uses."""

    NVML = "nvml"
    KFD = "kfd"  # AMD: KFD's per-process VRAM entries or DRM fdinfo
    NODES = "nodes"
    NONE = ""  # it holds no GPU at all


class Why(WireEnum):
    """Why engine/judge.py says a GPU or MIG instance is not free; each surface words them its own way."""

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
    """A spared entry's `code` (`why` words it), from protection.py or, for the rest, sweep.py's plan."""

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
    OTHER = "other"  # read back from a record written before the codes


class SurvivorReason(WireEnum):
    """Why a sweep could not end a process (a survived entry's `code`; `why` words it)."""

    ZOMBIE = "zombie"  # exited, not reaped: only its parent can release it
    UNINTERRUPTIBLE = "uninterruptible"  # in D state: SIGKILL is pending until it wakes
    STILL_RUNNING = "still-running"  # neither: still running after SIGKILL
    PERMISSION_DENIED = "permission-denied"  # a signal of ours was refused (not root)
    REAPPEARED = "reappeared"  # holders kept appearing, round after round: the last ones
    EXITED = "exited"  # gone by the time it was recorded, after the wait for it had ended
    OTHER = "other"  # read back from a record written before the codes


class RequesterKind(WireEnum):
    """Who asked for a sweep or reset, decided when the request came: the metrics' `trigger` label."""

    HOOK = "hook"  # root's ExecStopPost drop-in (its reason is the hook's, dropins.py)
    HOOK_NONROOT = "hook-nonroot"  # the hook's reason, not root: manual, yet the watch's stop sweep
    WATCH = "watch"  # the unit watch, at a watched unit's stop
    SLURM = "slurm"  # root's Slurm epilog (a slurm_job request)
    RECOVERED = "recovered"  # a unit that stopped while no gpuguardd ran (daemon/units.py)
    AUTO_RESET = "auto-reset"  # [Recovery] AutoReset's GPU reset (daemon/recovery.py)
    MANUAL = "manual"  # anyone else: an admin, a script, a user's dry run


class WarningCode(WireEnum):
    """A report's `warning_codes[i]`, what warnings[i] is about: consumers (Slurm's drain) test it."""

    NVML_UNAVAILABLE = "nvml-unavailable"  # no GPU's memory can be verified
    MEMORY_UNVERIFIED = "memory-unverified"  # unreadable, or proves nothing (hung, lost, suspended...)
    LOCKS_UNAVAILABLE = "locks-unavailable"  # sweeps and resets of a GPU are not serialized
    PERSISTENCE_NOT_RESTORED = "persistence-not-restored"  # a reset could not turn it back on
    OTHER = "other"


# Why a sweep's memory could not be verified (engine/slurm.summary).
UNVERIFIED_WARNINGS = frozenset({WarningCode.NVML_UNAVAILABLE, WarningCode.MEMORY_UNVERIFIED})

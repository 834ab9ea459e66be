"""Which holders a scope takes: the rules a sweep plans by, and what listings and the unit
watch place holders with."""

from __future__ import annotations

from gpuguardd.engine.attribution import container_matches
from gpuguardd.engine.slurm import in_job_scope
from gpuguardd.records.enums import HolderKind
from gpuguardd.records.models import Holder, Scope


def gpu_scope(holder: Holder, gpus: tuple[int, ...]) -> tuple[bool, str]:
    """Whether `holder` is on `gpus`, and why not if it holds some of their nodes. Off NVML's lists
    it has only its nodes (a CUDA process holds every GPU's): on `gpus` only if all of them are."""
    wanted = set(gpus)
    if holder.nvml_gpus:
        return bool(wanted & set(holder.nvml_gpus)), ""
    nodes = set(holder.node_gpus)
    if nodes and nodes <= wanted:
        return True, ""
    if nodes & wanted:
        others = ", ".join(str(g) for g in sorted(nodes - wanted))
        return False, f"also holds GPU {others}; NVML lists it on no GPU"
    return False, ""


def holds_no_device_here(holder: Holder) -> bool:
    """Listed, but holds no device here (another namespace's pid, or reused); a zombie holds nothing."""
    return not {"fd", "mmap"} & set(holder.how) and holder.state != "Z"


def mig_scope_why(holder: Holder, scope: Scope) -> str:
    """Why a tenant of one of the scope's MIG instances is left out: it is in others too."""
    others = sorted(set(holder.mig) - set(scope.mig))
    return f"also in MIG instance {', '.join(others)}" if others and set(holder.mig) & set(scope.mig) else ""


def _on_scope_gpus(holder: Holder, scope: Scope) -> bool:
    """On the scope's GPUs (gpu_scope's rule), or in its MIG instances only (never also in others)."""
    on_mig = bool(holder.mig) and set(holder.mig) <= set(scope.mig)
    return (bool(scope.gpus) and gpu_scope(holder, scope.gpus)[0]) or on_mig


def in_scope(holder: Holder, scope: Scope) -> bool:
    if scope.slurm_job:
        # A Slurm epilog's sweep: its own rule, whatever else the scope says (slurm.py).
        return in_job_scope(holder, scope.slurm_job, scope.slurm_uid,
                            lambda: _on_scope_gpus(holder, scope))
    if scope.adopted and not holder.container and (holder.pid, holder.start_time) in scope.adopted:
        # A leftover of scope.unit outside its cgroup, pinned by start time: the very process
        # the unit watch chose (daemon/units.py), never a recycled PID.
        return (not scope.gpus and not scope.mig) or _on_scope_gpus(holder, scope)
    if scope.container:
        if not container_matches(holder.container, scope.container):
            return False
    elif scope.unit and holder.container:
        # A unit name without a container means the host's unit, never a container's namesake.
        return False
    if scope.unit and holder.unit != scope.unit:
        return False
    if scope.gpus or scope.mig:
        return _on_scope_gpus(holder, scope)
    return True


def is_target(holder: Holder, scope: Scope) -> bool:
    return (in_scope(holder, scope) and not holder.protected and not holds_no_device_here(holder)
            and (holder.kind == HolderKind.COMPUTE or scope.include_management))

"""Slurm: the epilog's sweep of one finished job, and nothing of any other job.

The epilog runs as root after Slurm signalled the job and waited KillWait. In scope: 1. the
processes in the job's cgroup (any controller's hierarchy); 2. those that escaped it (a
launcher's daemonised workers): the job user's, on the job's GPUs, in no job's cgroup; never for
a job of root, whose "escaped" processes could be any system service. The job's GPUs
(SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES) are device minors, not NVML indices.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuguardd.engine import procfs
from gpuguardd.errors import InvalidArgument
from gpuguardd.escaping import escape_text
from gpuguardd.numbers import UID_MAX, is_digits, parse_job_id, parse_uint
from gpuguardd.records.enums import UNVERIFIED_WARNINGS, Outcome
from gpuguardd.records.models import GpuSummary, Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.records.selectors import PCI, selector

# v1: /slurm/uid_1000/job_42/step_0/task_0, or /slurm_<node>/uid_... (CgroupPrepend "/slurm_%n" of
# --enable-multiple-slurmd builds, as Debian's); v2: /system.slice/slurmstepd.scope/job_42/step_0/...
# [0-9], never \d: \d takes any Unicode digit, and a cgroup name is text anyone may choose.
_JOB_CGROUP = re.compile(r"/(?:slurm(?:_[^/]+)?/uid_[0-9]+|slurmstepd\.scope)/job_([0-9]+)(?=/|$)")
REASON_PREFIX = "slurm:"
MAX_REASON = 240  # sinfo shows a node's drain reason in its table: one short line
EPILOG_GRACE_MS = 2000  # short: Slurm already sent SIGTERM and waited KillWait before the epilog
EPILOG_DEADLINE_MS = 60_000  # well under PrologEpilogTimeout (docs/fleet.md suggests 120 s)
_NO_GPUS = {"", "NoDevFiles"}  # SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES of a job without GPUs


def job_of_cgroups(cgroup_file: str) -> str:
    for line in cgroup_file.splitlines():
        match = _JOB_CGROUP.search(line.split(":", 2)[-1])
        if match:
            return match.group(1)
    return ""


def in_job_scope(holder: Holder, job: str, uid: int, on_job_gpus: Callable[[], bool]) -> bool:
    """Rule 1 or 2 of the module docstring; `on_job_gpus`: the sweep's rule (scope.gpu_scope)."""
    owner_job = job_of_cgroups(procfs.read_cgroup(holder.pid) or "")
    if owner_job:
        return owner_job == job
    return uid != ROOT_UID and holder.uid == uid and not holder.container and on_job_gpus()


@dataclass(frozen=True)
class EpilogJob:
    job_id: str
    uid: int
    # Device minors (/dev/nvidia<N>; an AMD GPU's render node, renderD<N>), or PCI bus ids as
    # the list gave them.
    minors: tuple[int | str, ...]

    @property
    def reason(self) -> str:
        return f"{REASON_PREFIX}{self.job_id}"


# A device minor: the kernel's minors are 20 bits (MINORBITS); gpu_selectors() says which are GPUs.
MAX_MINOR = 2**20 - 1
ROOT_UID = 0


def epilog_job(environ: Mapping[str, str], flag: str = "--slurm-epilog") -> EpilogJob:
    """The job as the epilog's (or prolog's: the same variables) environment describes it."""
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        script = "Prolog=" if "prolog" in flag else "Epilog="
        raise InvalidArgument(f"{flag}: SLURM_JOB_ID is not set (run it as Slurm's {script})")
    # The request's own rule (check_request), so --local and the daemon agree on every id.
    parse_job_id(job_id, "SLURM_JOB_ID")
    if "SLURM_JOB_UID" not in environ:
        raise InvalidArgument(f"{flag}: SLURM_JOB_UID is not set")
    uid = parse_uint(environ["SLURM_JOB_UID"], "SLURM_JOB_UID", UID_MAX)
    name = "SLURM_JOB_GPUS" if "SLURM_JOB_GPUS" in environ else "CUDA_VISIBLE_DEVICES"
    text = environ.get(name, "").strip()
    minors: list[int | str] = []
    if text not in _NO_GPUS:
        for item in (i.strip() for i in text.split(",")):
            pci = not is_digits(item) and selector(item).kind == PCI
            minors.append(item if pci else parse_uint(item, name, MAX_MINOR))
    return EpilogJob(job_id, uid, tuple(dict.fromkeys(minors)))


def gpu_selectors(minors: Iterable[int | str], gpus: list[GpuSummary]) -> tuple[list[str], list[str]]:
    """The sweep's `gpus` strings for device minors (a PCI bus id as it is), and warnings."""
    by_minor = {-1 if "minor" in g.unread else g.minor: str(g.index) for g in gpus}
    selectors: list[str] = []
    warnings: list[str] = []
    for minor in minors:
        if isinstance(minor, str):
            selectors.append(minor)
        elif minor in by_minor:
            selectors.append(by_minor[minor])
        elif not gpus:
            selectors.append(str(minor))  # as it is on almost every host
            warnings.append(f"no GPU list (NVML unavailable?): device minor {minor} taken to be GPU {minor}")
        else:
            raise InvalidArgument(f"no GPU has device minor {minor} (/dev/nvidia{minor}, "
                                  f"/dev/dri/renderD{minor}); "
                                  f"minors: {', '.join(str(m) for m in sorted(by_minor)) or 'none'}")
    return selectors, warnings


def check_request(request: SweepRequest) -> None:
    if not request.slurm_job:
        if request.slurm_uid != -1:
            raise InvalidArgument("slurm_uid given without slurm_job")
        return
    parse_job_id(request.slurm_job, "slurm_job")
    if not 0 <= request.slurm_uid <= UID_MAX:
        raise InvalidArgument("slurm_job needs slurm_uid, the job's user")
    if request.unit or request.container:
        raise InvalidArgument("slurm_job cannot be combined with unit or container")


def summary(job: str, report: Report) -> str:
    """One line for `scontrol update ... Reason=` (and the journal): what kept the GPUs."""
    outcome = report.outcome
    details: list[str] = []
    if outcome == Outcome.SURVIVORS:
        details = [f"pid {s.pid} {s.why}".strip() for s in report.survived]
    elif outcome == Outcome.NOT_RELEASED:
        details = [f"GPU {g.index} {g.memory_used_after // (1024 * 1024)} MiB still used"
                   for g in report.gpus if not g.released]
    elif outcome == Outcome.UNVERIFIED:
        details = report.warnings_of(UNVERIFIED_WARNINGS) or ["GPU memory not verified"]
    elif report.error:
        details = [report.error]
    text = f"gpuguard: job {job}: {outcome}" + (": " + "; ".join(details[:3]) if details else "")
    if len(details) > 3:
        text += f"; and {len(details) - 3} more"
    return escape_text(text)[:MAX_REASON]

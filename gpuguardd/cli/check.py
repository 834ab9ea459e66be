"""`gpuguardctl check`: is a GPU free for the next job? Read-only, for schedulers and health probes.

The judge's rule on the published inventory decides, so a check and a sweep never disagree about a
holder. Without NVML the memory cannot be checked, so no NVIDIA GPU can be called free.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from gpuguardd.cli.backend import Backend
from gpuguardd.cli.exits import EXIT_NOT_FREE, EXIT_OK
from gpuguardd.cli.output import gpu_title, human_bytes, print_json, sent
from gpuguardd.engine.judge import facts_of_record, judge
from gpuguardd.errors import GpuGuardError, InvalidArgument
from gpuguardd.escaping import escape_text as printable
from gpuguardd.records.enums import GpuState, Outcome, Vendor, Why
from gpuguardd.records.models import GpuSummary, Holder, MigSummary
from gpuguardd.records.report import REPORT_RESET, Report
from gpuguardd.records.selectors import KnownGpu, selector

log = logging.getLogger("gpuguard.cli")
RECENT_REPORTS = 20  # the newest reports read for GPUs a reset recovered
# The judge's reasons that make a GPU (or MIG instance) unfit for the next job, worded, in order.
DETAILS = {
    Why.LEAKED: "memory in use with no process holding it",
    Why.LOST: "fell off the bus (NVML reports it lost)",
    Why.UNREADABLE: "its state cannot be read",
    Why.PROCESSES: "NVML lists processes on it",
}


@dataclass
class Problem:
    gpu: int | None
    uuid: str
    kind: str  # holder, leaked, lost, unknown, nvml
    message: str
    pid: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gpu": -1 if self.gpu is None else self.gpu}


@dataclass
class CheckResult:
    checked: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "gpus": self.checked,
                "problems": [p.to_dict() for p in self.problems], "recovered": self.recovered}


def run(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    result = check(backend.status(), backend.gpus(), backend.holders(args.gpu, "", "", True), args.gpu)
    try:
        notes = recovered_by_reset(result, backend.history(RECENT_REPORTS))
    except GpuGuardError as exc:  # the answer stands without them
        log.debug("no history for the check's notes: %s", exc)
        notes = []
    if args.json:
        print_json(result.to_dict(), out)
    else:
        out.writelines(problem.message + "\n" for problem in result.problems)
        sys.stderr.writelines(note + "\n" for note in notes)  # stderr: stdout stays one line per problem
    return EXIT_OK if result.ok else EXIT_NOT_FREE


def recovered_by_reset(result: CheckResult, reports: list[Report]) -> list[str]:
    """A note per checked GPU a reset among `reports` (newest first) recovered: free, but worth a look."""
    checked = {c["index"] for c in result.checked}
    lines = []
    for report in (r for r in reports if r.kind == REPORT_RESET and r.outcome == Outcome.RESET):
        for index in report.scope.gpus:
            if index in checked and index not in {r["index"] for r in result.recovered}:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.started_usec / 1e6))
                result.recovered.append({"index": index, "report": report.id, "started_usec": report.started_usec})
                lines.append(f"note: GPU {index} was recovered by reset {report.id[:8]} at {when}")
    return lines


def _known(gpu: GpuSummary) -> KnownGpu:
    return KnownGpu(-1 if "index" in gpu.unread else gpu.index, gpu.uuid,
                    tuple(m.uuid for m in gpu.mig_instances or []), gpu.pci_bus_id)


def _selected(gpus: list[GpuSummary], selectors: list[str]) -> list[tuple[GpuSummary, MigSummary | None]]:
    """(GPU, MIG instance or None) for each selector; every GPU when there is none."""
    if not selectors:
        return [(g, None) for g in gpus]
    chosen: list[tuple[GpuSummary, MigSummary | None]] = []
    for item in selectors:
        wanted = selector(item)
        matches = wanted.find(_known(g) for g in gpus)
        if not matches:
            known = ", ".join(str(g.index) for g in gpus) or "none"
            raise InvalidArgument(f"no GPU {printable(wanted.text)!r} (GPUs: {known})")
        gpu = next(g for g in gpus if _known(g).index == matches[0].index)
        found = (gpu, next((m for m in gpu.mig_instances or [] if matches[0].mig and m.uuid == matches[0].mig), None))
        if found not in chosen:
            chosen.append(found)
    return chosen


def check(status: dict[str, Any], gpus: list[GpuSummary], holders: list[Holder], selectors: list[str]) -> CheckResult:
    """The problems the judge finds on the selected GPUs; `holders` is the backend's, in the same
    selection (it resolves selectors as a sweep does)."""
    result = CheckResult()
    # AMD's memory is read from sysfs, without NVML.
    if not status.get("nvml_available", False) and not any(g.vendor == Vendor.AMD for g in gpus):
        why = printable(status.get("nvml_error") or "NVML unavailable")
        result.problems.append(Problem(None, "", "nvml", f"NVML unavailable ({why}): GPU memory cannot be checked"))
    # Without NVML there is no GPU list to select from; the holders still count, on any GPU.
    chosen = _selected(gpus, selectors) if gpus else []
    indices = {g.index for g, _ in chosen}
    named: set[int] = set()  # id() of the holders the judge names
    for gpu, instance in chosen:
        record = instance or gpu
        index, uuid = gpu.index, record.uuid
        title = ", ".join(part for part in (uuid, gpu_title(gpu)) if part)
        name = f"GPU {index} ({printable(title)})" if title else f"GPU {index}"
        state = sent(record, "state", GpuState.UNKNOWN.value)
        result.checked.append({"index": index, "uuid": uuid, "state": state, "memory_used": record.memory_used,
                               "vendor": sent(gpu, "vendor", "?"), "name": gpu.name})
        verdict = judge(facts_of_record(index, instance.uuid if instance else "", record, holders, None))
        named.update(id(r.holder) for r in verdict.reasons if r.holder is not None)
        for why in filter(verdict.has, DETAILS):
            detail = DETAILS[why]
            if why == Why.LEAKED:
                kind = record.leak_kind
                detail = f"{human_bytes(record.memory_used)} {detail}" + (f" ({printable(kind)})" if kind else "")
            elif gpu.error and why != Why.PROCESSES:
                detail += f": {printable(gpu.error)}"
            result.problems.append(Problem(index, uuid, state, f"{name}: {state}, {detail}"))
    if not chosen:
        anywhere = judge(facts_of_record(None, "", None, holders, "no GPU list"))
        named.update(id(r.holder) for r in anywhere.reasons if r.holder is not None)
    for holder in (h for h in holders if id(h) in named):
        where = ",".join(str(g) for g in holder.gpus) or "?"
        first = min(set(holder.gpus) & indices) if holder.gpus and indices else None
        uuid = next((g.uuid for g, _ in chosen if g.index == first), "")
        who = printable(holder.user or ("?" if "uid" in holder.unread else holder.uid))
        result.problems.append(Problem(first, uuid, "holder", f"GPU {where}: compute holder pid {holder.pid} "
                                       f"({printable(holder.comm)}) user {who} unit {printable(holder.unit or '-')}"
                                       + (f" container {printable(holder.container)}" if holder.container else "")
                                       + (" [protected]" if holder.protected else ""), pid=holder.pid))
    return result

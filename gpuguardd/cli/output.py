"""gpuguardctl's output for people: aligned tables and sizes.

Every field comes from processes, callers or files nobody vetted: each printer escapes its input, its
lines or (table()) its cells, so none reaches the terminal raw. print_json needs none: JSON escapes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO

from gpuguardd.bus.names import OMITTED_KEY, UID_UNKNOWN
from gpuguardd.escaping import escape_text, escaped
from gpuguardd.records import models
from gpuguardd.records.codec import WireRecord
from gpuguardd.records.models import GpuSummary, Holder, MigSummary
from gpuguardd.records.report import REPORT_RESET, Report, ReportScope, Spared, Survivor, Target, Terminated


def human_bytes(value: int) -> str:
    for size, shown in ((1024 ** 3, "{:.1f} GiB"), (1024 ** 2, "{:.0f} MiB"), (1024, "{:.0f} KiB")):
        if value >= size:
            return shown.format(value / size)
    return f"{value} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    lines = [headers, *([escape_text(cell) for cell in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    for line in lines:
        cells = [cell.ljust(widths[i]) if i < len(line) - 1 else cell for i, cell in enumerate(line)]
        out.write("  ".join(cells).rstrip() + "\n")


def print_json(data: Any, out: TextIO) -> None:
    # One write: json.dump() writes each token on its own, ~100 ms for 200 holders.
    out.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _state(record: GpuSummary | MigSummary) -> str:
    return _shown(record, "state") + (f" ({record.leak_kind})" if record.leak_kind else "")


def sent(record: WireRecord, name: str, missing: str) -> str:
    """A field as shown: one this version cannot read (a newer daemon's vendor or state) as it came,
    unescaped; `missing` when none came."""
    return str(record.to_dict().get(name, missing)) if name in record.unread else str(getattr(record, name))


def gpu_title(gpu: GpuSummary) -> str:
    """"nvidia NVIDIA H100 80GB HBM3", unescaped: the caller escapes the line."""
    return " ".join(part for part in (sent(gpu, "vendor", "?"), gpu.name) if part)


def print_gpus(gpus: Sequence[GpuSummary], out: TextIO) -> None:
    rows = []
    for gpu in gpus:
        vendor = sent(gpu, "vendor", "?")
        memory = (f"{human_bytes(gpu.memory_used)} / {human_bytes(gpu.memory_total)}"
                  if gpu.memory_total else "unknown")
        rows.append([str(gpu.index), vendor, gpu.name, gpu.uuid, gpu.pci_bus_id, memory,
                     str(gpu.holder_count), _state(gpu)])
        for mig in gpu.mig_instances or []:
            memory = f"{human_bytes(mig.memory_used)} / {human_bytes(mig.memory_total)}"
            rows.append([f"  {gpu.index}/gi{mig.gpu_instance_id}/ci{mig.compute_instance_id}", vendor, "MIG instance",
                         mig.uuid, mig.device_path or "-", memory, str(mig.holder_count), _state(mig)])
    table(["GPU", "VENDOR", "NAME", "UUID", "PCI", "MEMORY", "HOLDERS", "STATE"], rows, out)


def print_holders(holders: Sequence[Holder], out: TextIO) -> None:
    rows = []
    for h in holders:
        gpus = ",".join([str(g) for g in h.gpus] + h.mig) or "?"
        memory = human_bytes(h.gpu_memory) if h.gpu_memory else "-"
        kind = _shown(h, "kind") + (" (protected)" if h.protected else "")
        # Cut after escaping, as the table shows it: an escape is never cut in two.
        command = escape_text(h.cmdline or f"[{h.comm}]")[:80]
        user = h.user or ("?" if "uid" in h.unread or h.uid == UID_UNKNOWN else str(h.uid))
        rows.append([_shown(h, "pid"), user, h.unit or "-", h.container or "-", kind, h.state,
                     gpus, memory, ",".join(h.how), command])
    table(["PID", "USER", "UNIT", "CONTAINER", "KIND", "STATE", "GPUS", "MEMORY", "HOW", "COMMAND"], rows, out)
    print_omitted(holders, "holders", out)


def print_omitted(records: Sequence[WireRecord], what: str, out: TextIO) -> None:
    """The daemon's cut reply (replysize.py): its last record says how many were left out."""
    omitted = records[-1].to_dict().get(OMITTED_KEY, 0) if records else 0
    if isinstance(omitted, int) and omitted:
        out.write(f"({omitted} more {what} not shown: the reply was cut to stay under the bus's message size)\n")


def describe_scope(scope: ReportScope) -> str:
    return escape_text(models.describe_scope(scope, whole="whole host", with_management=False))


def print_status(status: dict[str, Any], out: TextIO) -> None:
    out.writelines(f"{key}: {value}\n" for key, value in sorted(escaped(status).items()))


def _line(out: TextIO, text: str) -> None:
    """One line, escaped whole: gpuguard's own words need no escaping."""
    out.write(escape_text(text) + "\n")


# A report from history.jsonl (an older version's, or edited) is read leniently (records/codec.py):
# what could not be read shows as "?" rather than losing the admin the rest of the history.
def _shown(record: WireRecord, name: str) -> str:
    return "?" if name in record.unread else str(getattr(record, name))


def _size(record: WireRecord, name: str) -> str:
    return "?" if name in record.unread else human_bytes(getattr(record, name))


def _row(entry: Terminated | Survivor | Spared | Target) -> str:
    unit = "-" if "unit" in entry.unread else entry.unit or "-"
    # Escaped before padding, so a name with an escape in it keeps the columns.
    return f"{_shown(entry, 'pid'):>7}  {escape_text(_shown(entry, 'comm')):<16} {unit}"


def print_report(report: Report, out: TextIO) -> None:
    what = describe_scope(report.scope)
    dry = " (dry run)" if report.dry_run else ""
    kind = "Reset" if report.kind == REPORT_RESET else "Sweep"
    _line(out, f"{kind} {_shown(report, 'id')[:8]} of {what}{dry}, requested by {_shown(report, 'requested_by')}")
    for step in report.steps:
        _line(out, f"  step: {step}")
    if report.dry_run:
        for target in report.targets:
            _line(out, f"  would end   {_row(target)}")
    for ended in report.terminated:
        note = f", zombie of {ended.zombie_parent}" if ended.zombie_parent else ""
        _line(out, f"  terminated  {_row(ended)}  "
                   f"{ended.signal or 'gone'} after {_shown(ended, 'exited_after_ms')} ms{note}")
    for survivor in report.survived:
        _line(out, f"  SURVIVED    {_row(survivor)}  {_shown(survivor, 'why')}")
    for spared in report.spared:
        _line(out, f"  spared      {_row(spared)}  {_shown(spared, 'why')}")
    for gpu in report.gpus:
        after = _size(gpu, "memory_used_after") if not report.dry_run else "-"
        flag = "" if gpu.released or report.dry_run else " (not released)"
        what = f"GPU {_shown(gpu, 'index')}" + (f" MIG {gpu.mig_uuid}" if gpu.mig_uuid else "")
        _line(out, f"  {what}: {_size(gpu, 'memory_used_before')} used before, {after} after{flag}")
    for leak in report.leaks:
        _line(out, f"  LEAK: GPU {_shown(leak, 'gpu')} keeps {_size(leak, 'bytes')} "
                   "with no process holding it" + (f" ({leak.kind})" if leak.kind else ""))
    for warning in report.warnings:
        _line(out, f"  warning: {warning}")
    _line(out, f"Outcome: {_shown(report, 'outcome')} in {_shown(report, 'duration_ms')} ms")


"""Human-readable output for gpuguardctl: aligned tables and sizes an admin reads at a glance.

Everything a printer here formats comes from processes, callers or files nobody vetted: each
printer escapes its whole input first (escaping.escaped), and table() its cells, so no field
can reach the terminal raw. JSON output (print_json) stays JSON: json escapes on its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO

from gpuguardd.bus.names import OMITTED_KEY, UID_UNKNOWN
from gpuguardd.escaping import escape_text, escaped


def human_bytes(value: int) -> str:
    if value >= 1024 ** 3:
        return f"{value / 1024 ** 3:.1f} GiB"
    if value >= 1024 ** 2:
        return f"{value / 1024 ** 2:.0f} MiB"
    if value >= 1024:
        return f"{value / 1024:.0f} KiB"
    return f"{value} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    rows = [[escape_text(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [headers, *rows]
    for line in lines:
        cells = [cell.ljust(widths[i]) if i < len(line) - 1 else cell for i, cell in enumerate(line)]
        out.write("  ".join(cells).rstrip() + "\n")


def print_json(data: Any, out: TextIO) -> None:
    # One write: json.dump() writes each token on its own, ~100 ms for 200 holders.
    out.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def print_gpus(gpus: list[dict[str, Any]], out: TextIO) -> None:
    gpus = escaped(gpus)
    rows = []
    for gpu in gpus:
        memory = (f"{human_bytes(gpu['memory_used'])} / {human_bytes(gpu['memory_total'])}"
                  if gpu["memory_total"] else "unknown")
        rows.append([str(gpu["index"]), gpu["name"], gpu["uuid"], gpu["pci_bus_id"], memory,
                     str(gpu["holder_count"]), gpu["state"]])
        # MIG instances under their GPU, by the UUID users name them with.
        for mig in gpu.get("mig_instances") or []:
            memory = f"{human_bytes(mig['memory_used'])} / {human_bytes(mig['memory_total'])}"
            rows.append([f"  {gpu['index']}/gi{mig['gpu_instance_id']}/ci{mig['compute_instance_id']}",
                         "MIG instance", mig["uuid"], mig["device_path"] or "-", memory,
                         str(mig["holder_count"]), mig["state"]])
    table(["GPU", "NAME", "UUID", "PCI", "MEMORY", "HOLDERS", "STATE"], rows, out)


def print_holders(holders: list[dict[str, Any]], out: TextIO) -> None:
    holders = escaped(holders)
    rows = []
    for h in holders:
        gpus = ",".join([str(g) for g in h["gpus"]] + list(h.get("mig") or [])) or "?"
        memory = human_bytes(h["gpu_memory"]) if h["gpu_memory"] else "-"
        kind = h["kind"] + (" (protected)" if h["protected"] else "")
        command = h["cmdline"] or f"[{h['comm']}]"
        user = h["user"] or ("?" if h.get("uid", UID_UNKNOWN) == UID_UNKNOWN else str(h["uid"]))
        rows.append([str(h["pid"]), user, h["unit"] or "-",
                     h["container"] or "-", kind, h["state"], gpus, memory,
                     ",".join(h["how"]), command[:80]])
    table(["PID", "USER", "UNIT", "CONTAINER", "KIND", "STATE", "GPUS", "MEMORY", "HOW",
           "COMMAND"], rows, out)
    print_omitted(holders, "holders", out)


def print_omitted(entries: list[dict[str, Any]], what: str, out: TextIO) -> None:
    """The daemon cut the reply to stay under the bus's message size (replysize.py): say so."""
    omitted = entries[-1].get(OMITTED_KEY, 0) if entries else 0
    if omitted:
        out.write(f"({omitted} more {what} not shown: the reply was cut to stay under the "
                  f"bus's message size)\n")


def describe_scope(scope: Any) -> str:
    scope = _fields(escaped(scope))
    parts = []
    if scope.get("gpus"):
        parts.append("GPU " + _joined(scope["gpus"]))
    if scope.get("mig"):
        parts.append("MIG " + _joined(scope["mig"]))
    if scope.get("unit"):
        parts.append(f"unit {scope['unit']}")
    if scope.get("container"):
        parts.append(f"container {scope['container']}")
    return ", ".join(parts) or "whole host"


def print_status(status: dict[str, Any], out: TextIO) -> None:
    for key, value in sorted(escaped(status).items()):
        out.write(f"{key}: {value}\n")


# A report may come from history.jsonl, which an older version wrote or someone edited: the
# printer takes any shape (a key missing, a string where a list was, a list of numbers) and
# shows "?" for what it cannot read, rather than losing the admin the rest of the history.

def _fields(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _entries(value: Any) -> list[dict[str, Any]]:
    """The records in a report's list; anything else in it is shown as text in a record."""
    if not isinstance(value, list):
        return []
    return [item if isinstance(item, dict) else {"comm": str(item)} for item in value]


def _joined(value: Any) -> str:
    return ",".join(str(item) for item in value) if isinstance(value, list) else str(value)


def _size(value: Any) -> str:
    return human_bytes(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _row(entry: dict[str, Any]) -> str:
    return f"{entry.get('pid', '?')!s:>7}  {entry.get('comm', '?')!s:<16} {entry.get('unit') or '-'}"


def print_report(report: Any, out: TextIO) -> None:
    report = _fields(escaped(report))
    what = describe_scope(report.get("scope"))
    dry = " (dry run)" if report.get("dry_run") else ""
    out.write(f"Sweep {str(report.get('id', '?'))[:8]} of {what}{dry}, "
              f"requested by {report.get('requested_by', '?')}\n")
    if report.get("dry_run"):
        for t in _entries(report.get("targets")):
            out.write(f"  would end   {_row(t)}\n")
    for t in _entries(report.get("terminated")):
        note = f", zombie of {t['zombie_parent']}" if t.get("zombie_parent") else ""
        out.write(f"  terminated  {_row(t)}  "
                  f"{t.get('signal') or 'gone'} after {t.get('exited_after_ms', '?')} ms{note}\n")
    for s in _entries(report.get("survived")):
        out.write(f"  SURVIVED    {_row(s)}  {s.get('why', '?')}\n")
    for s in _entries(report.get("spared")):
        out.write(f"  spared      {_row(s)}  {s.get('why', '?')}\n")
    for g in _entries(report.get("gpus")):
        after = _size(g.get("memory_used_after")) if not report.get("dry_run") else "-"
        flag = "" if g.get("released") or report.get("dry_run") else " (not released)"
        what = f"GPU {g.get('index', '?')}" + (f" MIG {g['mig_uuid']}" if g.get("mig_uuid") else "")
        out.write(f"  {what}: {_size(g.get('memory_used_before'))} used before, {after} after{flag}\n")
    for leak in _entries(report.get("leaks")):
        out.write(f"  LEAK: GPU {leak.get('gpu', '?')} keeps {_size(leak.get('bytes'))} "
                  f"with no process holding it\n")
    warnings = report.get("warnings")
    for warning in warnings if isinstance(warnings, list) else [warnings] if warnings else []:
        out.write(f"  warning: {warning}\n")
    out.write(f"Outcome: {report.get('outcome', '?')} in {report.get('duration_ms', '?')} ms\n")

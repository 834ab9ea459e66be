"""`gpuguardctl watch`: the Manager's signals as they come, one line each (or one JSON object)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from gpuguardd.cli.backend import Backend
from gpuguardd.cli.client import DBusBackend
from gpuguardd.cli.output import describe_scope, gpu_title, human_bytes
from gpuguardd.errors import InvalidArgument
from gpuguardd.escaping import escape_text, escaped
from gpuguardd.records.report import Report, ReportScope


def describe(member: str, fields: dict[str, Any], titles: Mapping[int, str] | None = None) -> str:
    """One line for a signal. `titles`: GPU index -> gpu_title(); a GPU not in it is named by UUID alone."""
    title = (titles or {}).get(fields.get("gpu", -1), "") if member == "LeakSuspected" else ""
    fields = escaped(fields)
    if member == "SweepStarted":
        return f"sweep {fields['id'][:8]} started: {describe_scope(ReportScope.from_dict(fields['scope']))}"
    if member == "ProcessTerminated":
        return (f"sweep {fields['id'][:8]}: pid {fields['pid']} ({fields['comm']}, "
                f"unit {fields['unit'] or '-'}) ended by {fields['signal'] or 'itself'}")
    if member == "SweepFinished":
        report = Report.from_dict(fields["report"])
        return (f"sweep {fields['id'][:8]} finished: {fields['outcome']} ({len(report.terminated)} terminated, "
                f"{len(report.survived)} survived) in {report.duration_ms} ms")
    if member == "LeakSuspected":
        which = ", ".join(part for part in (fields["uuid"], escape_text(title)) if part)
        return f"GPU {fields['gpu']} ({which}): {human_bytes(int(fields['bytes']))} in use with no process holding it"
    return f"{member} {fields}"


def run(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    if not isinstance(backend, DBusBackend):
        raise InvalidArgument("watch needs gpuguardd")
    titles: dict[int, str] = {}

    def read_titles() -> None:
        # On its own connection beside the subscription, so no signal waits for it. The titles
        # are a nicety: any failure (no daemon yet) leaves them out.
        with contextlib.suppress(Exception):
            titles.update({gpu.index: gpu_title(gpu) for gpu in backend.gpus()})

    if not args.json:
        threading.Thread(target=read_titles, name="gpu-titles", daemon=True).start()

    def on_signal(member: str, fields: dict[str, Any]) -> None:
        stamp = time.time()
        try:
            if args.json:
                out.write(json.dumps({"signal": member, "time": stamp, **fields}, sort_keys=True, default=str) + "\n")
            else:
                clock = time.strftime("%H:%M:%S", time.localtime(stamp))
                out.write(f"{clock} {describe(member, fields, titles)}\n")
            out.flush()
        except BrokenPipeError:
            # `watch | head`: the reader left. SystemExit passes dbus-fast's handler guard (it
            # catches Exception) and ends the loop.
            raise SystemExit(0) from None

    def on_owner(owner: str) -> None:
        sys.stderr.write("gpuguardctl: gpuguardd is back\n" if owner
                         else "gpuguardctl: gpuguardd stopped; waiting for it to return\n")
        sys.stderr.flush()

    with contextlib.suppress(KeyboardInterrupt):
        backend.watch(on_signal, on_owner)
    return 0

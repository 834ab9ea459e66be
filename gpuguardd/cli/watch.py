"""`gpuguardctl watch`: the Manager's signals as they come, one line each (or one JSON object)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from gpuguardd.bus import contract
from gpuguardd.bus.names import MANAGER_INTERFACE
from gpuguardd.cli.client import DBusBackend
from gpuguardd.cli.output import describe_scope, human_bytes
from gpuguardd.escaping import escaped
from gpuguardd.records.report import Report, ReportScope


def describe(member: str, fields: dict[str, Any]) -> str:
    fields = escaped(fields)
    if member == "SweepStarted":
        return f"sweep {fields['id'][:8]} started: {describe_scope(ReportScope.from_dict(fields['scope']))}"
    if member == "ProcessTerminated":
        return (f"sweep {fields['id'][:8]}: pid {fields['pid']} ({fields['comm']}, "
                f"unit {fields['unit'] or '-'}) ended by {fields['signal'] or 'itself'}")
    if member == "SweepFinished":
        report = Report.from_dict(fields["report"])
        return (f"sweep {fields['id'][:8]} finished: {fields['outcome']} "
                f"({len(report.terminated)} terminated, "
                f"{len(report.survived)} survived) in {report.duration_ms} ms")
    if member == "LeakSuspected":
        return (f"GPU {fields['gpu']} ({fields['uuid']}): {human_bytes(int(fields['bytes']))} "
                "in use with no process holding it")
    return f"{member} {fields}"


def run_watch(backend: DBusBackend, as_json: bool, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    signals = contract.interface(MANAGER_INTERFACE).signals

    def on_signal(member: str, args: list[Any]) -> None:
        # The backend passes only the contract's signals, with their signatures.
        fields = dict(zip(signals[member].arg_names, args))
        stamp = time.time()
        try:
            if as_json:
                out.write(json.dumps({"signal": member, "time": stamp, **fields}, sort_keys=True,
                                     default=str) + "\n")
            else:
                clock = time.strftime("%H:%M:%S", time.localtime(stamp))
                out.write(f"{clock} {describe(member, fields)}\n")
            out.flush()
        except BrokenPipeError:
            # `gpuguardctl watch | head`: the reader left. SystemExit passes through dbus-fast's
            # handler guard (it only catches Exception) and ends the loop.
            raise SystemExit(0) from None

    def on_owner(owner: str) -> None:
        err.write("gpuguardctl: gpuguardd is back\n" if owner
                  else "gpuguardctl: gpuguardd stopped; waiting for it to return\n")
        err.flush()

    try:
        backend.watch(on_signal, on_owner)
    except KeyboardInterrupt:
        return 0
    return 0

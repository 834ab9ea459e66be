"""history.jsonl is untrusted input to every reader: records an older version wrote, or that
someone edited by hand, may lack keys or hold odd types. GetHistory still answers, and
`gpuguardctl history` prints every record ("?" for what it cannot read) for root and nobody.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from gpuguardd.cli import output
from gpuguardd.daemon.history import FILE_NAME
from gpuguardd.engine.report import Report
from tests.dbus_harness import GuardDaemon

pytest_plugins = ["tests.dbus_harness"]

# Each is a record the loader keeps (it has an id); none has the shape today's daemon writes.
ODD_RECORDS: list[dict[str, Any]] = [
    {"id": "a" * 32},
    {"id": "b" * 32, "outcome": "freed", "scope": "GPU 0", "terminated": [7, None, "x"],
     "gpus": [{"index": 0, "memory_used_before": "lots"}], "leaks": [{}], "warnings": "one"},
    {"id": "c" * 32, "dry_run": True, "targets": {"pid": 1}, "scope": {"gpus": 3, "unit": 5},
     "survived": [{"pid": "x"}], "spared": "all", "duration_ms": None,
     "requested_by": "\x1b[2Jroot"},
    {"id": "d" * 32, "requested_by": ["a", "b"], "gpus": [{"memory_used_after": True}],
     "terminated": [{"pid": 9, "comm": ["x"], "exited_after_ms": {"a": 1}}]},
]


def test_the_printer_takes_any_record_shape() -> None:
    out = io.StringIO()
    not_records: list[Any] = [5, None, "text", []]
    for record in [*ODD_RECORDS, *not_records]:
        output.print_report(Report.from_dict(record), out)
    printed = out.getvalue()
    assert printed.count("Sweep ") == len(ODD_RECORDS) + 4
    assert "\x1b" not in printed and "requested by \\x1b[2Jroot" in printed
    assert "GPU 0: ? used before" in printed and "warning: one" in printed


def test_history_with_partial_records_is_served_and_printed(daemon: GuardDaemon) -> None:
    state = Path(str(daemon.host.root)) / "state"
    state.mkdir(exist_ok=True)
    (state / FILE_NAME).write_text("".join(json.dumps(r) + "\n" for r in ODD_RECORDS))
    daemon.host.write_config()
    daemon.start()
    served = daemon.manager("GetHistory", "u", "0")[0]
    assert sorted(r["id"] for r in served) == sorted(r["id"] for r in ODD_RECORDS)
    for as_nobody in (False, True):
        shown = daemon.ctl("history", "-n", "10", as_nobody=as_nobody)
        assert shown.returncode == 0, shown.stderr
        for record in ODD_RECORDS:
            assert f"Sweep {record['id'][:8]} " in shown.stdout, shown.stdout
        assert "\x1b" not in shown.stdout
    assert daemon.alive()

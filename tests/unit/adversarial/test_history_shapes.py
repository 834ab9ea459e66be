"""history.jsonl is untrusted input: the printer takes any record shape (GetHistory and
gpuguardctl history on the bus: tests/bus/adversarial/test_history_shapes.py)."""

from __future__ import annotations

import io
from typing import Any

from gpuguardd.cli import output
from gpuguardd.records.report import Report

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

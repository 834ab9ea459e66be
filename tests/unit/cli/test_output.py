"""What gpuguardctl prints for people: aligned, sized, and safe from hostile process names."""

from __future__ import annotations

import io

from gpuguardd.cli.output import describe_scope, human_bytes, print_holders
from gpuguardd.records.enums import HolderKind
from gpuguardd.records.models import Holder
from gpuguardd.records.report import ReportScope


def test_sizes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(300 * 1024 * 1024) == "300 MiB"
    assert human_bytes(36 * 1024 ** 3) == "36.0 GiB"


def test_scope_description() -> None:
    assert describe_scope(ReportScope()) == "whole host"
    assert describe_scope(ReportScope(gpus=[0, 1], unit="a.service")) == "GPU 0,1, unit a.service"
    # As read back from a history: what cannot be read is left out, never an error.
    assert describe_scope(ReportScope.from_dict({"gpus": 3, "unit": "b.service"})) == "unit b.service"


def test_hostile_command_line_stays_on_its_row() -> None:
    evil = Holder(pid=4242, comm="x", cmdline="python3 -c 'x'\nFAKE ROW\x1b[2J", user="eve", gpus=[0],
                  how=["fd"], kind=HolderKind.COMPUTE, state="S")
    calm = Holder(pid=7, comm="y", cmdline="sleep 1", user="bob", gpus=[1], how=["nvml"],
                  kind=HolderKind.COMPUTE, state="S", gpu_memory=2 * 1024 ** 3)
    out = io.StringIO()
    print_holders([evil, calm], out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "\x1b" not in out.getvalue()
    header = lines[0]
    # columns line up: every row's MEMORY cell starts where the header's does
    column = header.index("MEMORY")
    assert lines[2][column:].startswith("2.0 GiB")
    assert lines[1][column:].startswith("-")

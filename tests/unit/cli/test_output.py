"""What gpuguardctl prints for people: aligned, sized, and safe from hostile process names."""

from __future__ import annotations

import io

from gpuguardd.cli import output
from gpuguardd.cli.check import check
from gpuguardd.cli.output import describe_scope, human_bytes, print_gpus, print_holders
from gpuguardd.cli.output import describe_scope as printed
from gpuguardd.cli.watch import describe
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.records.enums import HolderKind, SurvivorReason, Vendor
from gpuguardd.records.models import GpuInfo, GpuSummary, Holder, NvmlSnapshot, ScanResult
from gpuguardd.records.report import Report, ReportScope, Survivor
from tests.conftest import GiB
from tests.unit.adversarial.test_escaping import FORGED, SCREEN, assert_clean
from tests.unit.helpers import H100, MI300X, summaries


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


def test_gpus_shows_the_kind_with_the_state() -> None:
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB)
    out = io.StringIO()
    output.print_gpus(gpu_summaries(ScanResult(holders=[], nvml=NvmlSnapshot(
        available=True, gpus=[gpu])), 256 << 20), out)
    assert "leaked (no-process)" in out.getvalue()


def test_gpus_has_a_vendor_column_beside_the_name() -> None:
    out = io.StringIO()
    print_gpus(summaries(), out)
    header, nvidia, amd = out.getvalue().splitlines()
    assert header.split()[:3] == ["GPU", "VENDOR", "NAME"]
    assert nvidia.split()[:3] == ["0", "nvidia", "NVIDIA"] and H100 in nvidia
    assert amd.split()[:3] == ["1", "amd", "AMD"] and MI300X in amd


def test_gpus_json_carries_the_vendor_both_ways() -> None:
    assert [g.to_dict()["vendor"] for g in summaries()] == ["nvidia", "amd"]
    # As the daemon's Gpu properties are read back by gpuguardctl (client.py).
    read = GpuSummary.from_dict({"index": 1, "name": MI300X, "vendor": "amd"})
    assert read.vendor == Vendor.AMD and read.to_dict()["vendor"] == "amd"
    # A daemon from before vendors: NVIDIA's, and --json passes on what came.
    old = GpuSummary.from_dict({"index": 0, "name": H100})
    assert old.vendor == Vendor.NVIDIA and "vendor" not in old.unread
    # A vendor a newer daemon names: shown as it came, never as NVIDIA.
    newer = GpuSummary.from_dict({"index": 2, "name": "X", "vendor": "intel"})
    out = io.StringIO()
    print_gpus([newer], out)
    assert out.getvalue().splitlines()[1].split()[:2] == ["2", "intel"]
    assert newer.to_dict()["vendor"] == "intel"


def test_hostile_names_and_vendors_are_escaped_in_every_line() -> None:
    hostile = GpuSummary.from_dict({"index": 0, "uuid": "GPU-a", "name": FORGED + SCREEN,
                                    "vendor": "x\n" + SCREEN, "state": "lost"})
    out = io.StringIO()
    print_gpus([hostile], out)
    assert_clean(out.getvalue(), lines=2)
    result = check({"nvml_available": True}, [hostile], [], [])
    assert len(result.problems) == 1
    assert_clean(result.problems[0].message, lines=1)
    line = describe("LeakSuspected", {"gpu": 0, "uuid": "GPU-a", "bytes": 1}, {0: FORGED + SCREEN})
    assert_clean(line, lines=1)


def test_printed_text_is_escaped() -> None:
    assert printed(ReportScope(unit="x\n<3>forged.service")) == "unit x\\n<3>forged.service"


def test_escaped_names_keep_the_report_columns() -> None:
    plain_name, odd_name = (Holder(pid=42, comm=comm, unit="u.service") for comm in ("python", "py\x1bthon"))
    report = Report(id="c" * 32, survived=[Survivor.of(plain_name, SurvivorReason.OTHER, "x"),
                                               Survivor.of(odd_name, SurvivorReason.OTHER, "x")])
    out = io.StringIO()
    output.print_report(report, out)
    rows = [line for line in out.getvalue().splitlines() if "SURVIVED" in line]
    assert "py\\x1bthon" in rows[1] and rows[0].index("u.service") == rows[1].index("u.service")


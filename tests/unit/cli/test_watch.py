"""The vendor and the product name on gpuguardctl's surfaces: `gpus` (a VENDOR column, and
--json's "vendor"), `check` (its problem lines and --json's checked GPUs) and `watch` (a leak
line); names and vendors come from sysfs or NVML and are escaped as every other field."""

from __future__ import annotations

import io

from gpuguardd.cli.check import check
from gpuguardd.cli.output import print_gpus
from gpuguardd.cli.watch import describe
from gpuguardd.records.enums import GpuState, Vendor
from gpuguardd.records.models import GpuSummary
from tests.conftest import GiB
from tests.unit.adversarial.test_escaping import FORGED, SCREEN, assert_clean

H100 = "NVIDIA H100 80GB HBM3"
MI300X = "AMD Instinct MI300X"


def summaries() -> list[GpuSummary]:
    return [GpuSummary(index=0, uuid="GPU-a", name=H100, memory_total=80 * GiB, state=GpuState.IDLE),
            GpuSummary(index=1, uuid="GPU-b", name=MI300X, vendor=Vendor.AMD, memory_total=192 * GiB,
                       memory_used=GiB, state=GpuState.IDLE)]


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


def test_check_names_vendor_and_product_on_a_problem_line() -> None:
    gpus = summaries()
    gpus[1].state = GpuState.LEAKED
    gpus[1].leak_kind = "no-process"
    result = check({"nvml_available": True}, gpus, [], [])
    assert [p.message for p in result.problems] == [
        f"GPU 1 (GPU-b, amd {MI300X}): leaked, 1.0 GiB memory in use with no process holding it"
        " (no-process)"]
    assert [(c["vendor"], c["name"]) for c in result.to_dict()["gpus"]] == [("nvidia", H100),
                                                                          ("amd", MI300X)]


def test_watch_names_the_leaking_gpu_by_vendor_and_name() -> None:
    fields = {"gpu": 1, "uuid": "GPU-b", "bytes": 2 * GiB}
    assert describe("LeakSuspected", fields, {1: f"amd {MI300X}"}) == (
        f"GPU 1 (GPU-b, amd {MI300X}): 2.0 GiB in use with no process holding it")
    # Not listed (or not read yet): as before.
    assert describe("LeakSuspected", fields, {}) == "GPU 1 (GPU-b): 2.0 GiB in use with no process holding it"
    assert describe("LeakSuspected", fields) == describe("LeakSuspected", fields, {})


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

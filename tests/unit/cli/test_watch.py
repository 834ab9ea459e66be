"""The vendor and the product name on gpuguardctl's surfaces: `gpus` (a VENDOR column, and
--json's "vendor"), `check` (its problem lines and --json's checked GPUs) and `watch` (a leak
line); names and vendors come from sysfs or NVML and are escaped as every other field."""

from __future__ import annotations

from gpuguardd.cli.watch import describe
from tests.conftest import GiB
from tests.unit.helpers import MI300X


def test_watch_names_the_leaking_gpu_by_vendor_and_name() -> None:
    fields = {"gpu": 1, "uuid": "GPU-b", "bytes": 2 * GiB}
    assert describe("LeakSuspected", fields, {1: f"amd {MI300X}"}) == (
        f"GPU 1 (GPU-b, amd {MI300X}): 2.0 GiB in use with no process holding it")
    # Not listed (or not read yet): as before.
    assert describe("LeakSuspected", fields, {}) == "GPU 1 (GPU-b): 2.0 GiB in use with no process holding it"
    assert describe("LeakSuspected", fields) == describe("LeakSuspected", fields, {})


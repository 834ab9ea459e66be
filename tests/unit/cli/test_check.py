"""`gpuguardctl check`'s rules without processes: hostile names stay on one line, a MIG
instance's own state is checked (against real holders: tests/host/test_check.py)."""

from __future__ import annotations

from gpuguardd.cli.check import check
from gpuguardd.daemon.metrics import Metrics
from gpuguardd.engine.gpustate import gpu_summaries
from gpuguardd.records.enums import GpuState
from gpuguardd.records.models import GpuInfo, GpuSummary, Holder, NvmlSnapshot, ScanResult
from tests.conftest import GiB
from tests.unit.helpers import DEAD, H100, MI300X, summaries


def test_hostile_names_stay_on_one_line() -> None:
    status = {"nvml_available": True}
    gpus = [GpuSummary.from_dict({"index": 0, "uuid": "GPU-1", "state": "in-use", "memory_used": 1})]
    holders = [Holder.from_dict({"pid": 5, "comm": "x\n\x1b[2Jfake", "user": "u\nGPU 0: ok",
                                 "unit": "a\rb", "kind": "compute", "gpus": [0], "container": ""})]
    result = check(status, gpus, holders, [])
    assert len(result.problems) == 1
    message = result.problems[0].message
    assert "\n" not in message and "\x1b" not in message and "\r" not in message


def test_mig_instance_state_is_checked_not_its_parent() -> None:
    status = {"nvml_available": True}
    mig = "MIG-11111111-2222-3333-4444-555555555555"
    gpus = [GpuSummary.from_dict({"index": 0, "uuid": "GPU-1", "state": "idle", "memory_used": 0,
                                  "mig_instances": [{"uuid": mig, "state": "leaked",
                                                     "memory_used": 2 * GiB}]})]
    result = check(status, gpus, [], [mig])
    assert [(p.kind, p.uuid) for p in result.problems] == [("leaked", mig)]
    assert check(status, gpus, [], ["0"]).ok


def test_check_and_metrics_name_the_kind() -> None:
    gpu = GpuInfo(index=0, uuid="GPU-a", memory_total=80 * GiB, memory_used=3 * GiB,
                  processes={DEAD: 3 * GiB})
    scan = ScanResult(holders=[], nvml=NvmlSnapshot(available=True, gpus=[gpu]))
    summaries = gpu_summaries(scan, 256 << 20)
    result = check({"nvml_available": True}, summaries, [], [])
    assert [p.message for p in result.problems] == [
        "GPU 0 (GPU-a, nvidia): leaked, 3.0 GiB memory in use with no process holding it (dead-pids)"]
    metrics = Metrics()
    metrics.observe_inventory(True, summaries, [])
    text = metrics.render().decode()
    labels = 'UUID="GPU-a",gpu="0",kind="dead-pids",vendor="nvidia"'
    assert f"gpuguard_leaked_memory_by_kind_bytes{{{labels}}} 3.221225472e+09" in text, text


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


"""`gpuguardctl check`'s rules without processes: hostile names stay on one line, a MIG
instance's own state is checked (against real holders: tests/host/test_check.py)."""

from __future__ import annotations

from gpuguardd.cli.check import check
from gpuguardd.records.models import GpuSummary, Holder
from tests.conftest import GiB


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

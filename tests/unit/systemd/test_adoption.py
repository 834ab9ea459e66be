"""The unit watch adopts leftovers by the same GPU rule as a sweep (the rule against real
holders and the fake NVML: tests/host/test_gpu_attribution.py)."""

from __future__ import annotations

import asyncio

import pytest

from gpuguardd.records.enums import HolderKind
from gpuguardd.records.models import ScanResult
from gpuguardd.systemd import adoption
from gpuguardd.systemd.adoption import UnitGpuRecords, adoption_candidates, cuda_visible_gpus, leftovers
from gpuguardd.systemd.rules import UnitState
from tests.unit.helpers import NVML, holder, state


def test_unit_watch_adopts_by_the_same_gpu_rule() -> None:
    """A leftover is adopted for the GPUs its unit held only by the sweep's rule: a CUDA process
    of another tenant holds the unit's GPU node too."""
    from gpuguardd.records.enums import GpusFrom, HolderKind
    from gpuguardd.records.models import Holder
    from gpuguardd.systemd.adoption import UnitGpuRecords, adoption_candidates

    records = UnitGpuRecords()
    records.observe([Holder(pid=10, unit="llm.service", gpus=[1], nvml_gpus=[1], start_time=1)])
    cuda_on0 = Holder(pid=20, gpus=[0], nvml_gpus=[0], node_gpus=[0, 1], gpus_from=GpusFrom.NVML,
                      kind=HolderKind.COMPUTE, start_time=1)
    unlisted_everywhere = Holder(pid=21, gpus=[0, 1], node_gpus=[0, 1], gpus_from=GpusFrom.NODES,
                                 kind=HolderKind.COMPUTE, start_time=1)
    unlisted_on1 = Holder(pid=22, gpus=[1], node_gpus=[1], gpus_from=GpusFrom.NODES, kind=HolderKind.COMPUTE,
                          start_time=1)
    found = adoption_candidates("llm.service", records.get("llm.service"),
                                [cuda_on0, unlisted_everywhere, unlisted_on1])
    assert [(h.pid, why) for h, why in found] == [(22, "holds GPU 1, which llm.service held")]


@pytest.mark.parametrize(("owner", "lets_go"), [
    (None, False),  # systemd could not be asked: the unit may run
    ("active", False), ("activating", False), ("reloading", False), ("deactivating", False),
    ("refreshing", False), ("inactive", True), ("failed", True), ("", True),  # "": unloaded
])
def test_rule_4_only_a_stopped_owner_lets_its_process_go(owner: str | None, lets_go: bool) -> None:
    class Systemd:
        available = True

        async def state(self, unit: str) -> UnitState | None:
            return None if owner is None else state(owner)

        async def environment(self, unit: str) -> list[str]:
            return []

        async def dropins(self, unit: str) -> list[str]:
            return []

    records = UnitGpuRecords()
    records.observe([holder(10, "llm.service", [0])])
    scan = ScanResult(holders=[holder(10, "other.service", [0])], nvml=NVML)
    adopted = asyncio.run(leftovers(Systemd(), records, "llm.service", scan))
    assert adopted == ([(10, 100)] if lets_go else [])


@pytest.mark.parametrize(("value", "gpus"), [
    ("0,2", {0, 2}),
    ("GPU-bbbb3333", {2}),  # abbreviated UUIDs are fine when unambiguous
    ("GPU-bbbb", set()),  # ambiguous: two GPUs start so
    ("1,-1,2", {1}),  # CUDA ignores everything after an invalid ordinal
    ("7", set()),  # no such GPU
    ("", set()),
])
def test_cuda_visible_devices_hint(value: str, gpus: set[int]) -> None:
    env = ["PATH=/usr/bin", f"CUDA_VISIBLE_DEVICES={value}"]
    assert cuda_visible_gpus(env, NVML) == gpus
    assert cuda_visible_gpus(["PATH=/bin"], NVML) == set()


def test_records_note_host_units_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adoption, "MAX_UNITS", 2)
    records = UnitGpuRecords()
    records.observe([holder(10, "a.service", [0]), holder(11, "a.service", [1], start=5),
                     holder(12, "", [2]), holder(13, "b.service", [2], container="lxc/1"),
                     holder(14, "c.service", [])])
    record = records.get("a.service")
    assert record is not None and record.gpus == {0, 1}
    assert set(record.processes) == {(10, 100), (11, 5)}
    assert records.units() == ["a.service"]
    records.observe([holder(20, "b.service", [0]), holder(21, "c.service", [1])])
    assert records.units() == ["b.service", "c.service"]  # bounded: the oldest went


def test_adoption_rule() -> None:
    records = UnitGpuRecords()
    records.observe([holder(10, "sglang.service", [0]), holder(11, "sglang.service", [1])])
    records.hint("sglang.service", [2])
    record = records.get("sglang.service")
    now = [
        holder(10, "", [0]),  # same process, escaped: adopted (identity)
        holder(11, "", [1], start=999),  # PID reused by another process, but on its GPU 1
        holder(12, "", [2]),  # on GPU 2, named by CUDA_VISIBLE_DEVICES
        holder(13, "", [3]),  # another GPU: not the unit's business
        holder(14, "", [0], container="docker/abc"),  # containers are never adopted
        holder(15, "", [0], protected=True),
        holder(16, "", [0], kind=HolderKind.MANAGEMENT),  # nvidia-smi, an exporter
        holder(17, "sglang.service", [0]),  # still in the unit: the unit scope has it
        holder(18, "session-3.scope", [0]),  # rule 4 (running?) is the caller's to check
    ]
    found = {h.pid: why for h, why in adoption_candidates("sglang.service", record, now)}
    assert found == {10: "was a process of sglang.service",
                     11: "holds GPU 1, which sglang.service held",
                     12: "holds GPU 2, which sglang.service held",
                     18: "holds GPU 0, which sglang.service held"}
    with_management = adoption_candidates("sglang.service", record, now, include_management=True)
    assert 16 in {h.pid for h, _ in with_management}
    assert adoption_candidates("other.service", records.get("other.service"), now) == []


"""The unit watch adopts leftovers by the same GPU rule as a sweep (the rule against real
holders and the fake NVML: tests/host/test_gpu_attribution.py)."""

from __future__ import annotations


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

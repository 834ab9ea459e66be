"""The sweep runner without a bus: one GPU reading and one scope resolution a sweep."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.config import Config
from gpuguardd.daemon.runner import SweepRunner
from gpuguardd.engine.engine import Engine
from gpuguardd.errors import InvalidArgument
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import NvmlSnapshot, SweepRequest
from gpuguardd.records.report import Report
from tests.unit.helpers import NVML, CountingNvml, SweepCounter


def test_a_sweep_reads_the_gpus_and_resolves_its_scope_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's check and the sweep share one GPU reading and one scope resolution
    (Service.sweep's order: validate, then run), and a bad request is refused by the check."""
    nvml = CountingNvml()
    engine = Engine(Config(runtime_directory=str(tmp_path / "run"), sysfs_path=str(tmp_path / "sys"),
                           device_paths=(str(tmp_path / "dev" / "nvidia*"),)),
                    nvml=nvml, use_pidfd=False)  # type: ignore[arg-type]
    resolved: list[SweepRequest] = []
    resolve = engine.resolve_request

    def counted(request: SweepRequest, snap: NvmlSnapshot | None = None) -> Any:
        resolved.append(request)
        return resolve(request, snap)
    monkeypatch.setattr(engine, "resolve_request", counted)
    events = SweepCounter(nvml)

    async def sweep(request: SweepRequest) -> Report:
        with ThreadPoolExecutor(1) as sweeps, ThreadPoolExecutor(1) as io:
            runner = SweepRunner(engine, sweeps, io, None, events, None)  # type: ignore[arg-type]
            prepared: Any = await runner.io(engine.prepare, request)
            return await (runner.run(request, prepared) if prepared is not None
                          else runner.run(request))

    request = SweepRequest(gpus=[NVML.gpus[1].uuid], unit="sglang-a.service", dry_run=True,
                           requested_by="test", audited=False)
    report = asyncio.run(sweep(request))
    assert report.outcome == Outcome.DRY_RUN and report.scope.gpus == [1]
    assert events.reads_at_start == 1 and nvml.reads[0], nvml.reads  # the scan needs the lists
    assert len(resolved) == 1

    with pytest.raises(InvalidArgument, match="unknown GPU UUID"):
        asyncio.run(sweep(SweepRequest(gpus=["GPU-ffff0000-0000-4000-8000-000000000009"],
                                       dry_run=True, audited=False)))

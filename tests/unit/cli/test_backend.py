"""gpuguardctl --local: a unit's sweep finds its leftovers in the sweep's own first scan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuguardd.cli.backend import LocalBackend
from gpuguardd.config import Config
from gpuguardd.engine import engine as engine_module
from gpuguardd.engine.engine import Engine
from gpuguardd.engine.holders import find_holders
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import ScanResult, SweepRequest
from gpuguardd.systemd import adoption, client
from gpuguardd.systemd.rules import UnitState
from tests.unit.helpers import CountingNvml


class Systemd:
    available = True

    async def state(self, unit: str) -> UnitState | None:
        return UnitState(unit, "deactivating")

    async def environment(self, unit: str) -> list[str]:
        return []


def test_a_local_unit_sweep_reads_the_gpus_and_walks_proc_once(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = CountingNvml()
    backend = LocalBackend.__new__(LocalBackend)
    backend.bus_address = None
    backend.engine = Engine(Config(runtime_directory=str(tmp_path / "run"), sysfs_path=str(tmp_path / "sys"),
                                   device_paths=(str(tmp_path / "dev" / "nvidia*"),)),
                            nvml=nvml, use_pidfd=False)  # type: ignore[arg-type]
    walks: list[int] = []
    looked_in: list[ScanResult] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(len(nvml.reads))
        return find_holders(*args, **kwargs)

    async def local_systemd(address: str | None) -> tuple[Systemd, None]:
        return Systemd(), None

    real_leftovers = adoption.leftovers

    async def leftovers(*args: Any, **kwargs: Any) -> list[tuple[int, int]]:
        looked_in.append(args[3])
        return await real_leftovers(*args, **kwargs)
    monkeypatch.setattr(engine_module, "find_holders", counted)
    monkeypatch.setattr(client, "local_systemd", local_systemd)
    monkeypatch.setattr(adoption, "leftovers", leftovers)

    report = backend.sweep(SweepRequest(unit="sglang-a.service", dry_run=True, audited=False))
    assert report.outcome == Outcome.DRY_RUN
    assert len(looked_in) == 1, "the unit's leftovers were not looked for"
    assert len(nvml.reads) == 1 and walks == [1], (nvml.reads, walks)

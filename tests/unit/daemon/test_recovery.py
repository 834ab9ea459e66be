"""The AutoReset policy (daemon/recovery.py) on its own clock: off by default, a leak must last
LeakGraceSec, never a MIG GPU, never while a sweep runs or a start gate waits, at most once per
ResetIntervalSec a GPU. The reset itself is stood in for by a recorder (tests/bus/test_reset.py
runs the real one)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from gpuguardd.config import Config
from gpuguardd.daemon.recovery import AUTO_RESET_BY, Recovery
from gpuguardd.records.enums import GpuState, Outcome
from gpuguardd.records.models import GpuSummary
from gpuguardd.records.report import Report


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.resets: list[tuple[int, str, str]] = []

    def reset_gpu(self, index: int, requested_by: str, reason: str = "") -> Report:
        self.resets.append((index, requested_by, reason))
        return Report(outcome=Outcome.RESET, kind="reset")


class Events:
    def __init__(self) -> None:
        self.finished: list[Report] = []

    def reset_finished(self, report: Report) -> None:
        self.finished.append(report)


LEAKED = GpuSummary(index=0, state=GpuState.LEAKED, memory_used=3 << 30, leak_kind="dead-pids")
MIG = GpuSummary(index=1, state=GpuState.LEAKED, memory_used=3 << 30, mig_mode=True)


def run_policy(config: Config, steps: Sequence[tuple[float, list[GpuSummary]]],
               sweeping: bool = False, waiting: bool = False) -> list[tuple[int, str, str]]:
    engine = Engine(config)
    now = [0.0]

    async def main() -> None:
        kept: list[Report] = []

        async def keep(report: Report) -> None:
            kept.append(report)
        with ThreadPoolExecutor(1) as executor:
            recovery = Recovery(engine, executor, keep, Events(),  # type: ignore[arg-type]
                                held_off=lambda: sweeping or waiting, clock=lambda: now[0])
            for at, summaries in steps:
                now[0] = at
                recovery.observe(summaries)
                while recovery.busy():
                    await asyncio.sleep(0.01)
        assert len(kept) == len(engine.resets), "every reset is kept"
    asyncio.run(main())
    return engine.resets


def test_the_policy_is_off_by_default() -> None:
    assert run_policy(Config(leak_grace_sec=0), [(0, [LEAKED]), (10, [LEAKED])]) == []


def test_a_leak_is_reset_once_its_grace_is_over_and_once_per_interval() -> None:
    config = Config(auto_reset=True, leak_grace_sec=60, reset_interval_sec=3600)
    steps = [(0, [LEAKED]), (59, [LEAKED]), (60, [LEAKED]), (61, [LEAKED]), (3000, [LEAKED]),
             (3661, [LEAKED])]
    resets = run_policy(config, steps)
    assert [index for index, _, _ in resets] == [0, 0]
    assert resets[0][1] == AUTO_RESET_BY and resets[0][2].startswith("dead-pids: 3072 MiB leaked for 60 s")


def test_a_leak_that_ends_starts_its_grace_again() -> None:
    config = Config(auto_reset=True, leak_grace_sec=60)
    idle = dataclasses.replace(LEAKED, state=GpuState.IDLE)
    assert run_policy(config, [(0, [LEAKED]), (50, [idle]), (70, [LEAKED]), (110, [LEAKED])]) == []


def test_never_a_mig_gpu_a_sweep_or_a_waiting_gate() -> None:
    config = Config(auto_reset=True, leak_grace_sec=0)
    assert run_policy(config, [(0, [MIG]), (10, [MIG])]) == []
    assert run_policy(config, [(0, [LEAKED]), (10, [LEAKED])], sweeping=True) == []
    assert run_policy(config, [(0, [LEAKED]), (10, [LEAKED])], waiting=True) == []

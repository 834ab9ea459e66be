"""Watch mode's decisions, without a bus: records, the escaped-leftover rule, one sweep a stop.

The watcher against the real systemd (Subscribe, JobRemoved, PropertiesChanged, units being
unloaded after their stop, Restart=) is covered by tests/e2e/test_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from gpuguardd.daemon.runner import UnitSweeps
from gpuguardd.records.enums import GpusFrom, HolderKind, Outcome, RequesterKind
from gpuguardd.records.models import GpuInfo, Holder, NvmlSnapshot, ScanResult, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd.adoption import UnitGpuRecords, adoption_candidates, cuda_visible_gpus
from gpuguardd.systemd.rules import UnitState, matches, unit_name_from_path
from gpuguardd.systemd.unitwatch import UnitWatch
from gpuguardd.systemd.watcher import UnitWatcher

NVML = NvmlSnapshot(available=True, gpus=[
    GpuInfo(0, uuid="GPU-aaaa1111-0000-4000-8000-000000000000"),
    GpuInfo(1, uuid="GPU-bbbb2222-0000-4000-8000-000000000001"),
    GpuInfo(2, uuid="GPU-bbbb3333-0000-4000-8000-000000000002"),
])


def holder(pid: int, unit: str, gpus: Sequence[int], *, start: int = 100, container: str = "",
           kind: HolderKind = HolderKind.COMPUTE, protected: bool = False) -> Holder:
    return Holder(pid=pid, comm=f"p{pid}", unit=unit, gpus=list(gpus), nvml_gpus=list(gpus),
                  gpus_from=GpusFrom.NVML if gpus else GpusFrom.NONE, start_time=start,
                  container=container, kind=kind, protected=protected,
                  cgroup=f"/system.slice/{unit}" if unit else "/escaped")


def test_unit_name_from_path() -> None:
    assert unit_name_from_path("/org/freedesktop/systemd1/unit/sglang_2ddemo_2eservice") \
        == "sglang-demo.service"
    assert unit_name_from_path("/org/freedesktop/systemd1/unit/foo_40bar_2eservice") \
        == "foo@bar.service"
    assert unit_name_from_path("/org/freedesktop/systemd1/job/42") == ""


@pytest.mark.parametrize(("unit", "patterns", "expected"), [
    ("sglang-demo.service", ["sglang-*"], True),
    ("sglang-demo.service", ["sglang-demo"], True),
    ("sglang-demo.service", ["vllm-*", "sglang-*.service"], True),
    ("sglang-demo.socket", ["sglang-*.service"], False),
    ("vllm-a.service", ["sglang-*"], False),
    ("vllm-a.service", [], False),
])
def test_matches(unit: str, patterns: list[str], expected: bool) -> None:
    assert matches(unit, patterns) is expected


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


def test_records_note_host_units_only() -> None:
    records = UnitGpuRecords(max_units=2)
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


class FakeSystemd:
    def __init__(self, states: dict[str, UnitState]) -> None:
        self.available = True
        self.states = states
        self.environments: dict[str, list[str]] = {}

    async def state(self, unit: str) -> UnitState | None:
        return self.states.get(unit, UnitState(unit, ""))

    async def environment(self, unit: str) -> list[str]:
        return self.environments.get(unit, [])

    async def dropins(self, unit: str) -> list[str]:
        return []


class Harness:
    """The daemon's UnitSweeps with a fake systemd, a fixed scan, and itself as the runner:
    a sweep that records its requests."""

    def __init__(self, holders: list[Holder], states: dict[str, UnitState]) -> None:
        self.requests: list[SweepRequest] = []
        self.release = asyncio.Event()
        self.engine = SimpleNamespace(config=SimpleNamespace(dry_run=False))
        self.unit_watch = UnitWatch(bus=None, patterns=["sglang-*"])  # type: ignore[arg-type]
        self.unit_watch.systemd = FakeSystemd(states)  # type: ignore[assignment]
        self.watch = UnitSweeps(self, self.unit_watch, self.scan, lambda: NVML)  # type: ignore[arg-type]
        self.holders = holders

    async def scan(self) -> ScanResult:
        return ScanResult(holders=self.holders, nvml=NVML)

    async def run(self, request: SweepRequest) -> Report:
        self.requests.append(request)
        await self.release.wait()
        return Report(id=f"r{len(self.requests)}", requested_by=request.requested_by,
                      outcome=Outcome.FREED)


def hook(unit: str) -> SweepRequest:
    return SweepRequest(unit=unit, requested_by=f"hook:{unit}", reason=f"hook:{unit} result=x",
                        requester_kind=RequesterKind.HOOK)


def test_unit_sweep_adopts_only_leftovers_no_running_unit_owns() -> None:
    unit = "sglang-a.service"
    states = {unit: UnitState(unit, "deactivating", invocation_id="i1"),
              "session-3.scope": UnitState("session-3.scope", "active"),
              "old.service": UnitState("old.service", "failed")}
    scan = [holder(10, "", [0]), holder(11, "session-3.scope", [0]),
            holder(12, "old.service", [0]), holder(13, "gone.service", [0])]
    h = Harness(scan, states)
    h.unit_watch.observe([holder(9, unit, [0])])
    h.release.set()
    report = asyncio.run(h.watch.sweep_unit(hook(unit)))
    assert report is not None and report.outcome == "freed"
    # 10: in no unit; 12: its unit failed; 13: systemd does not know its unit; 11: a running
    # session owns it, so it is left alone.
    assert h.requests[0].adopted == [(10, 100), (12, 100), (13, 100)]
    assert h.watch.records.get(unit) is None  # all freed: the next instance starts afresh


def test_nothing_is_adopted_without_systemd() -> None:
    h = Harness([holder(10, "", [0])], {})
    h.watch.systemd.available = False
    h.unit_watch.observe([holder(9, "sglang-a.service", [0])])
    h.release.set()
    asyncio.run(h.watch.sweep_unit(hook("sglang-a.service")))
    assert h.requests[0].adopted == []


def test_hook_and_watch_of_one_stop_share_one_sweep() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "deactivating", invocation_id="i1")})

    async def scenario() -> list[Any]:
        first = asyncio.ensure_future(h.watch.sweep_unit(hook(unit)))
        await asyncio.sleep(0.01)
        # The watcher fires while the hook's sweep still runs (the unit is now inactive).
        h.watch.systemd.states[unit] = UnitState(unit, "inactive", invocation_id="i1")  # type: ignore[attr-defined]
        second = asyncio.ensure_future(h.watch.sweep_unit(
            SweepRequest(unit=unit, requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
        await asyncio.sleep(0.01)
        h.release.set()
        results = list(await asyncio.gather(first, second))
        # Later, the same stop again (a late JobRemoved): the remembered report.
        results.append(await h.watch.sweep_unit(SweepRequest(unit=unit,
                                                             requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
        # A new instance that stops is a new sweep.
        h.watch.systemd.states[unit] = UnitState(unit, "inactive", invocation_id="i2")  # type: ignore[attr-defined]
        results.append(await h.watch.sweep_unit(hook(unit)))
        return results

    reports = asyncio.run(scenario())
    assert [r.id for r in reports] == ["r1", "r1", "r1", "r2"]
    assert len(h.requests) == 2


def test_manual_sweeps_are_never_deduplicated() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "inactive", invocation_id="i1")})
    h.release.set()

    async def twice() -> None:
        for _ in range(2):
            await h.watch.sweep_unit(SweepRequest(unit=unit, requested_by="uid 0 (root) :1.5"))
    asyncio.run(twice())
    assert len(h.requests) == 2


def test_watch_does_not_sweep_a_unit_that_runs_again() -> None:
    unit = "sglang-a.service"
    h = Harness([], {unit: UnitState(unit, "activating", invocation_id="i2")})
    h.release.set()
    result = asyncio.run(h.watch.sweep_unit(SweepRequest(unit=unit, requested_by=f"watch:{unit}",
                         requester_kind=RequesterKind.WATCH)))
    assert result is None and h.requests == []
    # The drop-in's hook still sweeps: it runs in ExecStopPost, before the restart.
    assert asyncio.run(h.watch.sweep_unit(hook(unit))) is not None


def test_unit_records_that_cannot_be_kept_are_said_once_not_every_poll(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The records are written at each inventory change (every poll); a runtime directory that
    is gone must cost one warning, not one every 2 s, and a change of the records tries again."""
    watch = UnitWatch(bus=None, patterns=["sglang-*"],  # type: ignore[arg-type]
                      records_path=str(tmp_path / "gone" / "units.json"))
    held = [holder(10, "sglang-a.service", [0])]
    with caplog.at_level("WARNING"):
        for _ in range(5):
            watch.observe(held)
        assert len([r for r in caplog.records if "cannot keep" in r.message]) == 1
        (tmp_path / "gone").mkdir()
        watch.observe([*held, holder(11, "sglang-a.service", [1])])
    assert (tmp_path / "gone" / "units.json").exists()


class SlowSystemd:
    """systemd whose answer takes a while: the state is the one at the time of asking."""

    def __init__(self, state: UnitState) -> None:
        self.available = True
        self.now = state
        self.answer = asyncio.Event()
        self.asked: list[str] = []

    async def state(self, unit: str) -> UnitState:
        seen = self.now
        self.asked.append(seen.active_state)
        await self.answer.wait()
        return seen


def running_watcher(systemd: SlowSystemd, unit: str) -> UnitWatcher:
    """A watcher of docker-*.scope that has seen `unit` active."""
    watcher = UnitWatcher(None, systemd, ["docker-*.scope"])  # type: ignore[arg-type]
    watcher._last[unit] = "active"
    return watcher


def stops(watcher: UnitWatcher) -> list[UnitState]:
    """The stops the watcher reported."""
    found = []
    while not watcher.events.empty():
        event = watcher.events.get_nowait()
        if event.stopped:
            found.append(event.state)
    return found


def test_watcher_looks_again_at_a_stop_signalled_while_it_read_the_state() -> None:
    """A transient scope's stop: PropertiesChanged (deactivating) starts a look; the stop's
    JobRemoved arrives while that look still waits for systemd's answer ("deactivating"), and
    the scope is unloaded, so no signal comes again. The stop must still be swept."""
    unit = "docker-0123.scope"
    systemd = SlowSystemd(UnitState(unit, "deactivating", invocation_id="i1"))
    watcher = running_watcher(systemd, unit)

    async def scenario() -> None:
        watcher._consider(unit, job_done=False)  # PropertiesChanged: deactivating
        while not systemd.asked:
            await asyncio.sleep(0)
        systemd.now = UnitState(unit, "", invocation_id="i1")  # stopped, then unloaded
        watcher._consider(unit, job_done=True)  # the stop's JobRemoved, mid-look
        systemd.answer.set()
        for _ in range(100):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert systemd.asked == ["deactivating", ""]
    assert [s.unit for s in stops(watcher)] == [unit]


def test_watcher_reads_a_burst_of_signals_once() -> None:
    """Signals that arrive before the look reads the state are that look's: no second look."""
    unit = "docker-0123.scope"
    systemd = SlowSystemd(UnitState(unit, "inactive", invocation_id="i1"))
    systemd.answer.set()
    watcher = running_watcher(systemd, unit)

    async def scenario() -> None:
        for job_done in (False, False, True):
            watcher._consider(unit, job_done=job_done)
        for _ in range(100):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert systemd.asked == ["inactive"]
    assert [s.unit for s in stops(watcher)] == [unit]

"""A stop must not cut a sweep's report: the unit's stop timeout against a default
sweep, and a sweep that outlives its budget (SIGTERM during a real sweep:
tests/bus/adversarial/test_stop_timeout.py)."""

from __future__ import annotations

import asyncio
import configparser
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.config import Config, parse_timespan
from gpuguardd.daemon.history import History
from gpuguardd.daemon.runner import SWEEP_MARGIN_SEC, SweepRunner, sweep_budget_sec
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report, ReportScope
from tests.shipped import shipped


def test_unit_waits_longer_than_a_default_sweep() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(shipped("systemd/gpuguardd.service"))
    stop = parse_timespan(unit["Service"]["TimeoutStopSec"])
    config = Config()
    longest = config.grace_sec + config.kill_timeout_sec + config.verify_timeout_sec
    assert longest >= 45  # 10 + 5 + 30 when the issue was filed
    assert sweep_budget_sec(config, SweepRequest()) == longest + SWEEP_MARGIN_SEC
    assert stop >= longest + SWEEP_MARGIN_SEC + 10, stop  # the margin and the exit itself
    # A caller's grace counts instead of GraceSec.
    assert sweep_budget_sec(config, SweepRequest(grace_ms=120_000)) \
        == longest - config.grace_sec + 120 + SWEEP_MARGIN_SEC


class _Events:
    def __init__(self) -> None:
        self.finished: list[Report] = []

    def sweep_started(self, report_id: str, scope: dict[str, object]) -> None:
        pass

    def process_terminated(self, *args: Any) -> None:
        pass

    def sweep_finished(self, report: Report) -> None:
        self.finished.append(report)

    def busy_changed(self, busy: bool) -> None:
        pass


class _HungEngine:
    """An engine whose sweep ends one process, then hangs (a wedged driver) until released."""

    def __init__(self) -> None:
        self.config = Config()
        self.release = threading.Event()

    def sweep(self, request: SweepRequest, observer: Any, prepared: Any = None) -> Report:
        observer.sweep_started("feedface" * 4, ReportScope(gpus=[3]))
        observer.process_terminated("feedface" * 4, 4242, "vllm", "vllm.service", "SIGTERM")
        self.release.wait(30)
        return Report(id="feedface" * 4, requested_by="x", outcome=Outcome.FREED)


def test_a_sweep_that_outlives_its_budget_is_recorded(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Recorded as it stands at shutdown; if it finishes while the daemon is still exiting,
    that record stays the sweep's only one, and the late outcome goes to the journal."""
    engine = _HungEngine()
    history = History(str(tmp_path), 100)
    history.load()
    events = _Events()
    pool = ThreadPoolExecutor(2)

    async def scenario() -> None:
        runner = SweepRunner(engine, pool, pool, history, events, None)  # type: ignore[arg-type]
        request = SweepRequest(gpus=["3"], requested_by="uid 0 (root) :1.7", reason="stop test",
                               report_id="feedface" * 4)  # the engine reports under it
        task = asyncio.ensure_future(runner.run(request))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if runner.in_flight and runner.in_flight[0].terminated:
                break
        config = engine.config
        longest = config.grace_sec + config.kill_timeout_sec + config.verify_timeout_sec
        assert longest - 1 < runner.budget_sec() <= longest + SWEEP_MARGIN_SEC
        assert not await runner.wait_idle(0.05)
        await runner.record_interrupted()
        engine.release.set()
        await task  # the late report does not add a second record

    try:
        asyncio.run(scenario())
    finally:
        engine.release.set()
        pool.shutdown()
    records = history.newest(0)
    assert len(records) == 1, records
    record = records[0]
    assert record["id"] == "feedface" * 4 and record["outcome"] == "error"
    assert record["requested_by"] == "uid 0 (root) :1.7" and record["reason"] == "stop test"
    assert [t["pid"] for t in record["terminated"]] == [4242]
    assert "stopped while this sweep was still running" in record["error"]
    assert [r.id for r in events.finished] == ["feedface" * 4]  # SweepFinished was sent
    late = [r.getMessage() for r in caplog.records if "finished after it was recorded" in r.getMessage()]
    assert late == ["sweep feedface finished after it was recorded as interrupted: freed, "
                    "0 process(es) ended, 0 survived (the history keeps the interrupted record)"]

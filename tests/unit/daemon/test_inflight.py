"""The pieces that let a sweep outlive gpuguardd: in-flight records (daemon/inflight.py) and
the caller's retry (cli/retry.py). The daemon doing it for real: tests/bus/test_resume.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguardd.cli import retry
from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.errors import DaemonUnavailable
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report

ID = "0123456789abcdef" * 2


def request(**changes: object) -> SweepRequest:
    base = SweepRequest(gpus=["0", "GPU-1"], unit="sglang-a.service", grace_ms=2500,
                        dry_run=False, reason="hook:sglang-a.service result=success",
                        requested_by="hook:sglang-a.service", adopted=[(41, 9000)],
                        slurm_job="", report_id=ID)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_a_record_reads_back_as_written_and_goes_when_removed(tmp_path: Path) -> None:
    store = InFlightSweeps(str(tmp_path))
    assert store.load() == []  # no directory yet
    assert store.add(InFlightSweep(request(), 1234))
    assert os.stat(store.directory).st_mode & 0o777 == 0o700
    (back,) = store.load()
    assert back.request == request() and back.started_usec == 1234
    store.remove(ID)
    assert store.load() == [] and os.listdir(store.directory) == []


@pytest.mark.parametrize("change", [
    {"report_id": "../../etc/x"}, {"format": 2}, {"slurm_uid": -2}, {"grace_ms": True},
    {"adopted": [[1, -1]]}, {"gpus": [0]}, {"resumes": "zz"}, {"started_usec": "1"},
    {"dry_run": "no"}, {"requested_by": None},
])
def test_a_record_of_another_shape_is_removed_not_acted_on(tmp_path: Path,
                                                           change: dict[str, object]) -> None:
    store = InFlightSweeps(str(tmp_path))
    store.add(InFlightSweep(request(), 1))
    path = Path(store.directory) / f"{ID}.json"
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    (Path(store.directory) / ".sweep.torn").write_text("{")  # a crash mid-write
    assert store.load() == []
    assert os.listdir(store.directory) == []


def test_a_full_disk_is_reported_and_the_sweep_goes_on(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # the directory cannot be made: as an unwritable disk would
    assert not InFlightSweeps(str(blocked)).add(InFlightSweep(request(), 1))


def finished(outcome: Outcome = Outcome.FREED) -> Report:
    return Report(id="f" * 32, outcome=outcome)


def vanish() -> Report:
    raise DaemonUnavailable("Message recipient disconnected from message bus without replying")


def test_the_sweep_is_asked_again_once_the_daemon_is_back(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(retry, "RETRY_INTERVAL_SEC", 0.01)
    asked: list[str] = []

    def again() -> Report:
        asked.append("again")
        if len(asked) < 3:  # still restarting
            raise DaemonUnavailable("org.gpuguard.GpuGuard1 is not running")
        return finished()

    report = retry.sweep(vanish, again, lambda: pytest.fail("no local sweep"), request())
    assert report.outcome == Outcome.FREED and len(asked) == 3
    text = caplog.text
    assert "gpuguardd stopped during the sweep of sglang-a.service" in text and "retrying" in text
    assert "finished it: sweep ffffffff, freed" in text


def test_root_finishes_locally_when_the_daemon_stays_away(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(retry, "RETRY_INTERVAL_SEC", 0.01)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    report = retry.sweep(vanish, vanish, lambda: finished(Outcome.SURVIVORS), request(),
                         retry_sec=0.05)
    assert report.outcome == Outcome.SURVIVORS  # the exit status is the finishing sweep's
    assert "sweeping with the local engine" in caplog.text and "finished locally" in caplog.text


def test_a_user_is_told_to_sweep_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_INTERVAL_SEC", 0.01)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(DaemonUnavailable, match="did not come back within 0 s"):
        retry.sweep(vanish, vanish, lambda: pytest.fail("no local sweep"), request(),
                    retry_sec=0.05)


def test_progress_is_kept_and_a_late_write_never_undoes_it(tmp_path: Path) -> None:
    from gpuguardd.records.report import Terminated

    store = InFlightSweeps(str(tmp_path))
    one, two = Terminated(pid=7, signal="SIGTERM"), Terminated(pid=8, signal="SIGKILL")
    store.add(InFlightSweep(request(), 1))
    store.add(InFlightSweep(request(), 1, [one, two]))
    store.add(InFlightSweep(request(), 1, [one]))  # an I/O thread that ran late
    (back,) = store.load()
    assert [t.pid for t in back.terminated] == [7, 8]
    store.remove(ID)
    store.add(InFlightSweep(request(), 1, [one, two]))  # later still: the sweep is over
    assert store.load() == []

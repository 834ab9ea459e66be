"""The pieces that let a sweep outlive gpuguardd: in-flight records (daemon/inflight.py) and
the caller's retry (cli/sweep.py). The daemon doing it for real: tests/bus/test_resume.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import SweepRequest
from tests.unit.helpers import ID, request


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


def test_an_in_flight_record_keeps_its_kind_and_an_older_one_gets_it_from_its_words(
        tmp_path: Path) -> None:
    report_id = "0123456789abcdef" * 2
    store = InFlightSweeps(str(tmp_path))
    request = SweepRequest(unit="a.service", requested_by="uid 0 (root) :1.5", report_id=report_id,
                           requester_kind=RequesterKind.RECOVERED, dry_run=False)
    assert store.add(InFlightSweep(request, 1))
    (back,) = store.load()
    assert back.request.requester_kind is RequesterKind.RECOVERED
    # A record the version before the kinds wrote (a daemon upgraded mid-sweep).
    path = os.path.join(store.directory, f"{report_id}.json")
    with open(path, encoding="ascii") as f:
        data = json.load(f)
    del data["requester_kind"]
    data["requested_by"] = "hook:a.service"
    with open(path, "w", encoding="ascii") as f:
        json.dump(data, f)
    (old,) = store.load()
    assert old.request.requester_kind is RequesterKind.HOOK


"""gpuguardd dying during a stop, on the real systemd: `systemctl stop` still frees the GPUs.

The daemon is SIGKILLed (as an OOM kill or a crash would end it) while the hook's sweep waits
out its grace period; systemd restarts it (Restart=on-failure). The hook's gpuguardctl sees
the bus's "disconnected without replying", asks the restarted daemon again, and the daemon
finishes its predecessor's sweep from the record in /run/gpuguard/sweeps (daemon/units.py). And a
watched unit that stopped while no daemon ran is swept when the daemon comes back.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import Installed, wait_for
from tests.e2e.test_e2e import main_pid, wait_daemon_up, worker_pids

pytestmark = pytest.mark.timeout(240)

# DAEMON_CONFIG in harness.py: GraceSec=2, VerifyTimeoutSec=5.
DEADLINE_SEC = 2 + 5 + 10


def test_a_daemon_killed_during_the_hooks_sweep_still_frees_the_gpus(guard: Installed) -> None:
    m = guard.machine
    unit = "sglang-crash.service"
    pids = guard.start_server(unit, workers=2, gpus=(0,), stubborn=(1,))
    workers = worker_pids(pids)
    polite, stubborn = pids["worker0"], pids["worker1"]
    old = main_pid(guard)
    stop = m.popen(["systemctl", "stop", unit])
    started = time.monotonic()
    # The sweep has ended the polite worker, and the stubborn one ignores its SIGTERM: the
    # in-flight record says so while the grace period runs.
    wait_for("the hook's sweep to have ended the polite worker",
             lambda: m.run(f"grep -l '\"pid\": {polite}' /run/gpuguard/sweeps/*.json",
                           check=False).returncode == 0, 10, 0.05)
    m.run(["kill", "-9", str(old)])
    wait_daemon_up(guard, old)
    stop.communicate(timeout=60)
    wait_for("the workers to be gone", lambda: not any(guard.alive(p) for p in workers),
             DEADLINE_SEC - (time.monotonic() - started))

    reports = guard.reports_for(unit)
    cut = [r for r in reports if r["outcome"] == "interrupted"]
    assert len(cut) == 1, reports
    done = [r for r in reports if r["id"] == cut[0]["finished_by"]]
    assert len(done) == 1 and done[0]["resumes"] == cut[0]["id"], reports
    assert done[0]["outcome"] == "freed" and done[0]["requested_by"] == f"hook:{unit}"
    # Each report says what its own sweep ended.
    assert [t["pid"] for t in cut[0]["terminated"]] == [polite]
    assert [t["pid"] for t in done[0]["terminated"]] == [stubborn]
    # The hook said what happened, in the unit's journal, not the bus's words alone.
    said = m.journal("-u", unit)
    assert f"gpuguardd stopped during the sweep of {unit}" in said and "retrying" in said, said
    assert f"finished it: sweep {done[0]['id'][:8]}, freed" in said, said


def test_a_watched_unit_stopped_while_the_daemon_was_down_is_swept(guard: Installed) -> None:
    m = guard.machine
    unit = "watched-recover.service"
    # Its one worker escapes its cgroup: only the unit records that the last daemon kept in
    # /run/gpuguard say whose it is (nothing in the unit holds GPU 1 any more).
    pids = guard.start_server(unit, workers=1, gpus=(1,), escaper=0)
    workers = worker_pids(pids)
    escaper = pids["worker0"]
    m.run(["kill", "-USR1", str(escaper)])
    wait_for("the worker to leave the unit's cgroup", lambda: unit not in guard.cgroup(escaper), 10)
    guard.holders()  # the daemon's scan notes the escaper (and keeps it in /run/gpuguard)
    m.systemctl("stop", "gpuguardd.service")
    m.systemctl("stop", unit)  # KillMode=process: the worker stays, nobody sweeps
    time.sleep(1)
    assert all(guard.alive(p) for p in workers)
    assert m.show(unit, "ActiveState") == "inactive"
    m.systemctl("start", "gpuguardd.service")
    wait_for("the leftovers to be swept", lambda: not any(guard.alive(p) for p in workers), 20)
    found = wait_for("the report", lambda: [r for r in guard.reports_for(unit)
                                            if r["requested_by"] == f"recovered:{unit}"] or None, 10)
    assert len(found) == 1, found
    report = found[0]
    assert report["outcome"] == "freed", report
    assert {t["pid"] for t in report["terminated"]} == set(workers)
    assert report["scope"]["adopted_pids"] == [escaper]
    assert "stopped while gpuguardd was not running" in m.journal("-u", "gpuguardd.service")

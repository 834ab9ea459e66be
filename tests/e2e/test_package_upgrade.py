"""An upgrade of the .deb on the real systemd, during a hook's sweep.

Two builds of the release tarball one version apart (tests/packages.py: the same tree with
gpuguardd.__version__ set to V2). v1 is installed and sweeps once (its history has a report);
then, while a hook's sweep waits out its grace period for a worker that ignores SIGTERM,
`apt-get install ./gpuguard_<V2>_all.deb` upgrades the package. The maintainer scripts restart
the daemon (dh_installsystemd: restart after the upgrade); the restart must not cost the sweep:
the worker is gone within GraceSec + VerifyTimeoutSec + 10 s of the stop, v2 answers with its
own version, and it serves the history v1 wrote, both sweeps in it.

No NVML binding in the machine (Debian has none): the sweeps end "unverified", which is
beside the point here; the fake nodes make the workers holders.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import pytest

from gpuguardd import __version__
from tests.e2e.harness import FAKE_NVML_STATE, Installed, Machine, wait_for
from tests.e2e.test_package_install import _require, allow_service_starts, make_nodes
from tests.packages import build

# Two package builds, a boot, two sweeps and an upgrade.
pytestmark = pytest.mark.timeout(300)

V2 = f"{__version__}.post1"
GRACE_SEC, KILL_TIMEOUT_SEC, VERIFY_TIMEOUT_SEC = 10, 3, 5
SWEEP_DROPIN = "/etc/gpuguard/gpuguard.conf.d/e2e-sweep.conf"
# systemd's "Stopping <unit>..." (sd-messages.h SD_MESSAGE_UNIT_STOPPING), logged when a
# restart stops the old daemon.
UNIT_STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"


def apt_install(machine: Machine, deb: str) -> None:
    machine.run(["apt-get", "install", "-y", "--no-install-recommends", deb],
                env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)


def version_property(machine: Machine) -> str:
    return machine.run(["busctl", "get-property", "org.gpuguard.GpuGuard1", "/org/gpuguard/GpuGuard1",
                        "org.gpuguard.GpuGuard1.Manager", "Version"]).stdout.strip()


def daemon_pid(machine: Machine) -> int:
    """gpuguardd's MainPID once it is active and answers on the bus."""
    wait_for("gpuguardd to answer",
             lambda: machine.run(["gpuguardctl", "status", "--json"], check=False).returncode == 0,
             30, 0.3)
    return int(machine.show("gpuguardd.service", "MainPID"))


def stopping_times(machine: Machine) -> list[int]:
    """When systemd began to stop gpuguardd (realtime microseconds), oldest first."""
    out = machine.run(["journalctl", "--no-pager", "-o", "json", f"MESSAGE_ID={UNIT_STOPPING}",
                       "UNIT=gpuguardd.service"], check=False).stdout
    return [int(json.loads(line)["__REALTIME_TIMESTAMP"]) for line in out.splitlines() if line]


def test_deb_upgrade_during_a_hooks_sweep_restarts_the_daemon_and_keeps_the_history() -> None:
    _require()
    v1, v2 = build("deb"), build("deb", V2)
    machine = Machine()
    try:
        machine.boot()
        m = machine
        allow_service_starts(m)
        for deb in (v1, v2):
            shutil.copyfile(deb, m.path(f"/var/tmp/{deb.name}"))
        apt_install(m, f"/var/tmp/{v1.name}")
        m.write(SWEEP_DROPIN, f"[Sweep]\nGraceSec={GRACE_SEC}\nKillTimeoutSec={KILL_TIMEOUT_SEC}\n"
                              f"VerifyTimeoutSec={VERIFY_TIMEOUT_SEC}\n")
        daemon_pid(m)
        make_nodes(m)  # and reloads the configuration
        # The fake inference servers (tests/e2e/fake_server.py) register their workers in the
        # fake NVML's state file, which nothing reads here.
        servers = Installed(m)
        servers.write_gpus()
        m.run(f"mkdir -p -m 1777 /run/fake-server; touch {FAKE_NVML_STATE}.lock")
        m.run(["gpuguardctl", "hook", "install", "sglang-"])

        # v1 sweeps once.
        first = servers.start_server("sglang-first.service", workers=1)
        m.systemctl("stop", "sglang-first.service")  # returns after the hook's sweep
        assert not servers.alive(first["worker0"])
        (v1_report,) = servers.reports_for("sglang-first.service")
        v1_pid = daemon_pid(m)
        assert version_property(m) == f's "{__version__}"'

        # A hook's sweep in its grace period: worker 0 ends at the SIGTERM, worker 1 ignores it.
        unit = "sglang-upgrade.service"
        pids = servers.start_server(unit, workers=2, stubborn=(1,))
        stopped = time.monotonic()
        m.systemctl("stop", "--no-block", unit)
        wait_for("the sweep's SIGTERM to end worker 0",
                 lambda: not servers.alive(pids["worker0"]) or None, GRACE_SEC / 2, 0.1)
        assert servers.alive(pids["worker1"]), "the stubborn worker waits for SIGKILL"
        upgrade = m.popen(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y",
                           "--no-install-recommends", f"/var/tmp/{v2.name}"])
        try:
            wait_for("the stubborn worker to be ended",
                     lambda: not servers.alive(pids["worker1"]) or None,
                     GRACE_SEC + VERIFY_TIMEOUT_SEC + 10 - (time.monotonic() - stopped), 0.2)
            out, _ = upgrade.communicate(timeout=120)
        finally:
            if upgrade.poll() is None:
                upgrade.kill()
                upgrade.communicate()
        assert upgrade.returncode == 0, out
        wait_for(f"{unit} to be stopped",
                 lambda: m.show(unit, "ActiveState") in ("inactive", "failed") or None, 60, 0.3)

        # The maintainer scripts restarted the daemon: v2 runs and answers.
        assert m.run(["dpkg-query", "-W", "-f=${Version}", "gpuguard"]).stdout == V2
        v2_pid = daemon_pid(m)
        assert v2_pid != v1_pid, "the upgrade did not restart gpuguardd"
        assert version_property(m) == f's "{V2}"'
        # ... and stopped v1 while the hook's sweep ran, not after it.
        swept = servers.reports_for(unit)
        assert swept, f"no sweep of {unit} in the history"
        began = min(int(r["started_usec"]) for r in swept)
        ended = max(int(r["started_usec"]) + 1000 * int(r["duration_ms"]) for r in swept)
        stops = stopping_times(m)
        assert any(began <= t <= ended for t in stops), (began, ended, stops)
        # v2 serves what v1 wrote: both sweeps, the stubborn worker ended by one of them.
        ids = [r["id"] for r in servers.history()]
        assert v1_report["id"] in ids and all(r["id"] in ids for r in swept)
        ended_pids: set[Any] = {t["pid"] for r in swept for t in r["terminated"]}
        assert pids["worker1"] in ended_pids, swept
    finally:
        machine.shutdown()

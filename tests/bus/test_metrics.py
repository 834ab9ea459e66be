"""Prometheus metrics: what a sweep adds, the per-GPU gauges, bounded labels, the textfile that
node_exporter reads and GetMetrics on the bus, each checked with Debian's `promtool`.
(The real node_exporter and Prometheus servers scrape them in tests/e2e/test_fleet.py.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuguardd.daemon.metrics import TEXTFILE_NAME
from tests.conftest import GiB
from tests.dbus_harness import FAST_POLL, GuardDaemon, private_gpu, private_holder, wait_until
from tests.unit.daemon.test_metrics import promtool_check, samples

pytest_plugins = ["tests.dbus_harness"]


def test_daemon_publishes_a_sweep_in_the_textfile_and_on_the_bus(daemon: GuardDaemon,
                                                                   tmp_path: Path) -> None:
    textfiles = tmp_path / "node-exporter"
    textfiles.mkdir()
    daemon.host.write_config(FAST_POLL + f"[Metrics]\nTextfileDirectory={textfiles}\n")
    private_gpu(daemon.host)
    daemon.start()
    prom = textfiles / TEXTFILE_NAME
    wait_until(prom.exists, 10, "the textfile")
    pid = private_holder(daemon.host)
    gpu = private_gpu(daemon.host)
    uuid = daemon.host.state.gpus[gpu].uuid
    ids = (("UUID", uuid), ("gpu", str(gpu)))

    def in_use() -> bool:
        # NVML's process list can show the GPU in use a poll before the /proc scan finds the
        # holder, and a loaded machine's daemon rescans /proc only so often: ask for a fresh
        # scan (which publishes the inventory, and so the textfile), then wait for both.
        daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")
        got = samples(prom.read_text())
        vendor = ("vendor", "nvidia")
        return (got.get(("gpuguard_gpu_state", (*ids, ("state", "in-use"), vendor))) == 1
                and got.get(("gpuguard_gpu_holders", (*ids, ("kind", "compute"), vendor))) == 1)
    wait_until(in_use, 20, "the holder in the textfile", interval=0.2)
    result = daemon.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", str(gpu), "grace_ms", "u", "2000")[0]
    assert result["outcome"] == "freed" and [t["pid"] for t in result["terminated"]] == [pid]

    freed = ("gpuguard_sweeps_total", (("outcome", "freed"), ("trigger", "manual")))
    wait_until(lambda: samples(prom.read_text()).get(freed) == 1, 10, "the sweep in the textfile")
    text = daemon.manager("GetMetrics")[0]
    as_nobody = daemon.manager("GetMetrics", as_nobody=True)[0]
    for exposition in (prom.read_text(), text, as_nobody):
        promtool_check(exposition)
        got = samples(exposition)
        assert got[freed] == 1
        assert got[("gpuguard_processes_terminated_total", (("signal", "SIGTERM"),))] == 1
        assert got[("gpuguard_memory_reclaimed_bytes_total", ())] == 2 * GiB
        assert got[("gpuguard_last_sweep_timestamp_seconds", ())] > 0
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    # Once the daemon is gone (a write may be under way while it runs), no temporary file is left.
    assert daemon.stop() == 0
    assert sorted(os.listdir(textfiles)) == [TEXTFILE_NAME]


def test_an_unwritable_textfile_directory_is_logged_not_fatal(daemon: GuardDaemon,
                                                             tmp_path: Path) -> None:
    daemon.host.write_config(FAST_POLL + f"[Metrics]\nTextfileDirectory={tmp_path}/missing\n")
    daemon.start()
    wait_until(lambda: "cannot write the metrics textfile" in daemon.stderr(), 10, "the error")
    assert daemon.alive()
    assert "gpuguard_nvml_up 1.0" in daemon.manager("GetMetrics")[0]

"""Metrics could be forged. A `nobody` dry run with reason "slurm:1" or
"hook:x.service" was counted in gpuguard_sweeps_total under trigger="slurm" / "hook". The
trigger comes from who asked (root's hook, the watch, root's Slurm epilog), never from a
reason text, and dry runs are counted apart, so no one can inflate a real-sweep series."""

from __future__ import annotations

from tests.dbus_harness import GuardDaemon, private_gpu
from tests.unit.daemon.test_metrics import promtool_check, samples

pytest_plugins = ["tests.dbus_harness"]


def sweeps(guard: GuardDaemon) -> dict[tuple[str, str], float]:
    text = guard.manager("GetMetrics", as_nobody=True)[0]
    promtool_check(text)
    return {(dict(k[1])["outcome"], dict(k[1])["trigger"]): v
            for k, v in samples(text).items() if k[0] == "gpuguard_sweeps_total"}


def test_a_nobody_cannot_pick_the_trigger_label(guard: GuardDaemon) -> None:
    gpu = str(private_gpu(guard.host))
    for reason in ("slurm:1", "hook:x.service", "watch:x.service"):
        report = guard.manager("Sweep", "a{sv}", "3", "dry_run", "b", "true", "reason", "s", reason,
                               "gpus", "au", "1", gpu, as_nobody=True)[0]
        assert report["dry_run"] is True and report["outcome"] in ("dry-run", "nothing-to-do"), report
    # A dry run naming a Slurm job too (anyone may dry-run).
    guard.manager("Sweep", "a{sv}", "4", "dry_run", "b", "true", "slurm_job", "s", "1",
                  "slurm_uid", "u", "65534", "gpus", "au", "1", gpu, as_nobody=True)
    text = guard.manager("GetMetrics", as_nobody=True)[0]
    assert samples(text)[("gpuguard_dry_runs_total", ())] == 4
    assert sweeps(guard) == {}, text
    # Root's real sweep with a "slurm:" reason is still a manual one; root's epilog request
    # (slurm_job) is the Slurm trigger.
    guard.manager("Sweep", "a{sv}", "2", "reason", "s", "slurm:7", "gpus", "au", "1", gpu)
    report = guard.manager("Sweep", "a{sv}", "3", "slurm_job", "s", "7", "slurm_uid", "u", "65534",
                           "gpus", "au", "1", gpu)[0]
    assert report["requested_by"] == "slurm:7", report
    assert sweeps(guard) == {("nothing-to-do", "manual"): 1, ("nothing-to-do", "slurm"): 1}

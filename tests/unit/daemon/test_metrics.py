"""Prometheus metrics from reports and GPU states, and the textfile node_exporter reads, each
checked with Debian's `promtool` (gpuguardd serving them: tests/bus/test_metrics.py; the real
node_exporter and Prometheus: tests/e2e/test_fleet.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguardd.daemon.metrics import TEXTFILE_NAME, Metrics, spared_label, trigger_of, write_textfile
from gpuguardd.records.enums import HolderKind, Outcome, RequesterKind, SpareReason
from gpuguardd.records.models import GpuSummary, Holder
from gpuguardd.records.report import Report, Spared
from tests.conftest import GiB


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def promtool_check(text: str) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is required (make deps installs prometheus)")
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


def report(**extra: object) -> Report:
    base: dict[str, object] = {"id": "x", "outcome": "freed", "requested_by": "hook:vllm.service",
                               "requester_kind": "hook",
                               "reason": "", "started_usec": 1_700_000_000_000_000, "duration_ms": 1500,
                               "dry_run": False, "terminated": [], "survived": [], "spared": [],
                               "gpus": []}
    base.update(extra)
    return Report.from_dict(base)


def test_a_report_feeds_every_counter_with_bounded_labels() -> None:
    metrics = Metrics()
    metrics.observe_report(report(
        terminated=[{"signal": "SIGTERM"}, {"signal": "SIGKILL"}, {"signal": ""}],
        survived=[{"state": "D"}, {"state": "evil\"label\n"}],
        spared=[{"why": "management client (no CUDA context)", "code": "management"},
                {"why": "protected executable /usr/bin/nvidia-persistenced",
                 "code": "protected-executable"},
                {"why": "something new \n{}", "code": "from-a-newer-version"}],
        gpus=[{"memory_used_before": 40 * GiB, "memory_used_after": 0},
              {"memory_used_before": GiB, "memory_used_after": 2 * GiB}]))
    metrics.observe_report(report(outcome="survivors", requested_by="watch:x.service",
                                  requester_kind="watch", duration_ms=20))
    metrics.observe_report(report(outcome="error", reason="slurm:42", requested_by="slurm:42",
                                  requester_kind="slurm"))
    text = metrics.render().decode()
    promtool_check(text)
    got = samples(text)
    assert got[("gpuguard_sweeps_total", (("outcome", "freed"), ("trigger", "hook")))] == 1
    assert got[("gpuguard_sweeps_total", (("outcome", "survivors"), ("trigger", "watch")))] == 1
    assert got[("gpuguard_sweeps_total", (("outcome", "error"), ("trigger", "slurm")))] == 1
    assert got[("gpuguard_processes_terminated_total", (("signal", "SIGTERM"),))] == 1
    assert got[("gpuguard_processes_terminated_total", (("signal", "SIGKILL"),))] == 1
    assert got[("gpuguard_processes_terminated_total", (("signal", "none"),))] == 1
    assert got[("gpuguard_processes_survived_total", (("state", "D"),))] == 1
    assert got[("gpuguard_processes_survived_total", (("state", "other"),))] == 1
    assert {dict(k[1])["why"] for k in got if k[0] == "gpuguard_processes_spared_total"} == {
        "management", "protected-executable", "other"}
    # Only what came back counts, never a GPU whose use grew.
    assert got[("gpuguard_memory_reclaimed_bytes_total", ())] == 40 * GiB
    assert got[("gpuguard_sweep_duration_seconds_count", ())] == 3
    assert got[("gpuguard_sweep_duration_seconds_bucket", (("le", "0.05"),))] == 1
    assert got[("gpuguard_memory_release_seconds_count", ())] == 1
    assert got[("gpuguard_memory_release_seconds_sum", ())] == 1.5
    assert got[("gpuguard_last_sweep_timestamp_seconds", ())] == pytest.approx(1_700_000_001.5)


def test_dry_runs_reclaim_nothing() -> None:
    metrics = Metrics()
    metrics.observe_report(report(outcome="dry-run", dry_run=True,
                                  gpus=[{"memory_used_before": GiB, "memory_used_after": 0}]))
    assert samples(metrics.render().decode())[("gpuguard_memory_reclaimed_bytes_total", ())] == 0


def test_the_trigger_is_who_asked_never_the_reason_and_dry_runs_count_apart() -> None:
    """A nobody's dry run with reason "slurm:1" or "hook:x.service" was counted as a
    Slurm or hook sweep. The label comes from the requester kind the daemon decided (root's
    hook and epilog only), and a dry run is in gpuguard_dry_runs_total alone."""
    metrics = Metrics()
    nobody = "uid 65534 (nobody) :1.9"
    for reason, by, kind in (("slurm:1", nobody, "manual"),
                             ("hook:x.service", f"hook:x.service via {nobody}", "hook-nonroot"),
                             ("watch:x.service", nobody, "manual")):
        metrics.observe_report(report(outcome="freed", reason=reason, requested_by=by,
                                      requester_kind=kind))
        metrics.observe_report(report(outcome="dry-run", dry_run=True, reason=reason, requested_by=by,
                                      requester_kind=kind, terminated=[{"signal": "SIGTERM"}]))
    metrics.observe_report(report(outcome="dry-run", dry_run=True, requested_by="hook:y.service"))
    got = samples(metrics.render().decode())
    sweeps = {k[1]: v for k, v in got.items() if k[0] == "gpuguard_sweeps_total"}
    assert sweeps == {(("outcome", "freed"), ("trigger", "manual")): 3}
    assert got[("gpuguard_dry_runs_total", ())] == 4
    assert got[("gpuguard_sweep_duration_seconds_count", ())] == 3
    assert not any(k[0] == "gpuguard_processes_terminated_total" for k in got)


def test_trigger_and_spared_labels_are_read_from_the_codes_never_the_words() -> None:
    """The words say one thing, the codes another: the codes win. A record without codes
    (older than them) counts as manual and other."""
    metrics = Metrics()
    metrics.observe_report(report(requested_by="uid 0 (root) :1.2", requester_kind="hook"))
    metrics.observe_report(report(requested_by="slurm:42", requester_kind="manual", spared=[
        {"why": "management client (no CUDA context)", "code": "protected-unit"},
        {"why": "kernel thread", "code": "ancestor"},
        {"why": "kernel thread"}]))
    metrics.observe_report(Report(requested_by="hook:y.service", requester_kind=RequesterKind.WATCH,
                                  outcome=Outcome.FREED, spared=[
                                      Spared(pid=5, why="PID 1 (init)", code=SpareReason.OTHER_GPU),
                                      Spared(pid=6, code=SpareReason.EXECUTABLE_UNKNOWN)]))
    got = samples(metrics.render().decode())
    sweeps = {dict(k[1])["trigger"]: v for k, v in got.items() if k[0] == "gpuguard_sweeps_total"}
    assert sweeps == {"hook": 1, "manual": 1, "watch": 1}
    spared = {dict(k[1])["why"]: v for k, v in got.items() if k[0] == "gpuguard_processes_spared_total"}
    assert spared == {"protected-unit": 1, "self": 1, "other": 2, "executable-unknown": 1}
    # Every code has its label, and the out-of-scope ones are "other", as they always were.
    assert {code: spared_label(code) for code in SpareReason} == {
        SpareReason.INIT: "init", SpareReason.KERNEL_THREAD: "kernel-thread",
        SpareReason.SELF: "self", SpareReason.ANCESTOR: "self",
        SpareReason.EXECUTABLE_UNKNOWN: "executable-unknown",
        SpareReason.PROTECTED_EXECUTABLE: "protected-executable",
        SpareReason.PROTECTED_UNIT: "protected-unit", SpareReason.MANAGEMENT: "management",
        SpareReason.NO_DEVICE_HERE: "other", SpareReason.OTHER_GPU: "other",
        SpareReason.OTHER_MIG_INSTANCE: "other", SpareReason.OTHER: "other"}
    assert {kind: trigger_of(Report(requester_kind=kind)) for kind in RequesterKind} == {
        RequesterKind.HOOK: "hook", RequesterKind.HOOK_NONROOT: "manual",
        RequesterKind.WATCH: "watch", RequesterKind.SLURM: "slurm",
        RequesterKind.RECOVERED: "recovered", RequesterKind.AUTO_RESET: "manual",
        RequesterKind.MANUAL: "manual"}


def test_per_gpu_gauges_carry_dcgm_labels_and_no_process_details() -> None:
    metrics = Metrics()
    holders = [Holder(pid=10, comm="python3", gpus=[0], kind=HolderKind.COMPUTE, user="alice"),
               Holder(pid=11, comm="nvidia-smi", gpus=[0, 1], kind=HolderKind.MANAGEMENT),
               Holder(pid=12, comm="x", gpus=[0], kind=HolderKind.COMPUTE)]
    metrics.observe_inventory(True, [GpuSummary.from_dict(s) for s in (
        {"index": 0, "uuid": "GPU-aaaa", "state": "in-use", "memory_used": 9 * GiB},
        {"index": 1, "uuid": "GPU-bbbb", "state": "leaked", "memory_used": 3 * GiB},
        {"index": 2, "uuid": "GPU-cccc", "state": "weird", "memory_used": 0})], holders)
    text = metrics.render().decode()
    promtool_check(text)
    got = samples(text)
    ids0, ids1 = (("UUID", "GPU-aaaa"), ("gpu", "0")), (("UUID", "GPU-bbbb"), ("gpu", "1"))
    nvidia = ("vendor", "nvidia")
    assert got[("gpuguard_gpu_holders", (*ids0, ("kind", "compute"), nvidia))] == 2
    assert got[("gpuguard_gpu_holders", (*ids0, ("kind", "management"), nvidia))] == 1
    assert got[("gpuguard_gpu_holders", (*ids1, ("kind", "compute"), nvidia))] == 0
    assert got[("gpuguard_leaked_memory_bytes", (*ids0, nvidia))] == 0
    assert got[("gpuguard_leaked_memory_bytes", (*ids1, nvidia))] == 3 * GiB
    assert got[("gpuguard_gpu_state", (ids0[0], ("gpu", "0"), ("state", "in-use"), nvidia))] == 1
    assert got[("gpuguard_gpu_state", (ids0[0], ("gpu", "0"), ("state", "idle"), nvidia))] == 0
    assert got[("gpuguard_gpu_state", (("UUID", "GPU-cccc"), ("gpu", "2"), ("state", "unknown"), nvidia))] == 1
    assert got[("gpuguard_nvml_up", ())] == 1
    assert any(k[0] == "gpuguard_build_info" for k in got)
    for forbidden in ("pid", "alice", "python3", "nvidia-smi", "memory_total"):
        assert forbidden not in text
    metrics.observe_inventory(False, [], [])
    got = samples(metrics.render().decode())
    assert got[("gpuguard_nvml_up", ())] == 0
    assert not any(k[0] == "gpuguard_gpu_state" for k in got), "a GPU that is gone has no series"


def test_every_per_gpu_series_names_the_vendor() -> None:
    metrics = Metrics()
    holders = [Holder(pid=10, comm="python3", gpus=[1], kind=HolderKind.COMPUTE)]
    metrics.observe_inventory(False, [GpuSummary.from_dict(s) for s in (
        {"index": 0, "uuid": "GPU-aaaa", "state": "idle", "vendor": "nvidia"},
        {"index": 1, "uuid": "AMD-1", "state": "in-use", "vendor": "amd"},
        {"index": 2, "uuid": "AMD-2", "state": "leaked", "vendor": "amd", "memory_used": GiB,
         "leak_kind": "no-process"})], holders)
    text = metrics.render().decode()
    promtool_check(text)
    got = samples(text)
    per_gpu = ("gpuguard_gpu_state", "gpuguard_gpu_holders", "gpuguard_leaked_memory_bytes",
               "gpuguard_leaked_memory_by_kind_bytes")
    seen = {name: {dict(labels)["gpu"]: dict(labels)["vendor"] for n, labels in got if n == name}
            for name in per_gpu}
    for name in per_gpu[:3]:
        assert seen[name] == {"0": "nvidia", "1": "amd", "2": "amd"}, name
    assert seen["gpuguard_leaked_memory_by_kind_bytes"] == {"2": "amd"}
    assert got[("gpuguard_gpu_holders", (("UUID", "AMD-1"), ("gpu", "1"), ("kind", "compute"),
                                         ("vendor", "amd")))] == 1


def test_textfile_is_replaced_atomically_and_readable_by_node_exporter(tmp_path: Path) -> None:
    write_textfile(str(tmp_path), b"gpuguard_nvml_up 1\n")
    target = str(tmp_path / TEXTFILE_NAME)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    old = os.stat(target).st_ino
    write_textfile(str(tmp_path), b"gpuguard_nvml_up 0\n")
    assert os.stat(target).st_ino != old, "renamed over, never rewritten in place"
    assert Path(target).read_text() == "gpuguard_nvml_up 0\n"
    assert os.listdir(tmp_path) == [TEXTFILE_NAME], "no temporary file left behind"
    with pytest.raises(OSError):
        write_textfile(str(tmp_path / "missing"), b"x")

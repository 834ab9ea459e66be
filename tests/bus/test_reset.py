"""GPU resets on a real bus: gpuguardd classifies a leak, resets a GPU nothing holds through
the (fake) nvidia-smi on PATH, refuses while anything holds it, and AutoReset does it alone.

The fake nvidia-smi (tests/fakenvml/nvidia-smi) behaves as the real reset does: it refuses
while persistence mode is on or anyone has the GPU's node open (gpuguardd's own NVML session
included), takes its time, then clears the GPU's memory in the fake NVML's state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import GiB
from tests.dbus_harness import (
    GPU,
    MANAGER_PATH,
    PRIVATE_MINOR,
    BusctlError,
    GuardDaemon,
    SignalRecorder,
    leak_on,
    private_gpu,
    wait_until,
)
from tests.host.test_mig import setup_mig

pytest_plugins = ["tests.dbus_harness"]

FAKE_SMI_DIR = Path(__file__).resolve().parent.parent / "fakenvml"


def start(daemon: GuardDaemon, recovery: str = "", persistence: bool = False,
          nvlink: int | None = None) -> tuple[int, Path]:
    """The private GPU (its node held by gpuguardd's NVML session, as libnvidia-ml holds it),
    gpuguardd started with the fake nvidia-smi first on PATH; the GPU and the smi's log."""
    host = daemon.host
    gpu = private_gpu(host)
    host.state.gpus[gpu].persistence = persistence
    host.state.gpus[gpu].nvlink = nvlink
    host.state.nodes = [host.node("nvidiactl"), str(host.dev / f"nvidia{PRIVATE_MINOR}")]
    host.publish()
    host.write_config("PollIntervalSec=0.25\n" + (f"[Recovery]\n{recovery}" if recovery else ""))
    log = host.root / "smi.log"
    daemon.extra_env.update({"PATH": f"{FAKE_SMI_DIR}:{os.environ['PATH']}",
                             "FAKE_NVIDIA_SMI_LOG": str(log), "FAKE_NVIDIA_SMI_RESET_MS": "300"})
    daemon.start()
    return gpu, log


def smi_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_reset_frees_a_leak_nothing_holds(daemon: GuardDaemon, recorder: SignalRecorder) -> None:
    # LeakGraceSec=0 without AutoReset: the policy is off by default, so nothing resets alone.
    gpu, log = start(daemon, "LeakGraceSec=0\n", persistence=True)
    host = daemon.host
    path = f"{MANAGER_PATH}/gpu/{gpu}"
    leak_on(daemon, recorder, gpu, 5 * GiB)
    assert daemon.get_property(path, GPU, "LeakKind") == "no-process"
    check = daemon.ctl("check", "--gpu", str(gpu))
    assert check.returncode == 7 and "(no-process)" in check.stdout, check.stdout
    by_kind = [line.rsplit(" ", 1) for line in daemon.manager("GetMetrics")[0].splitlines()
               if line.startswith("gpuguard_leaked_memory_by_kind_bytes{")]
    assert [(f'gpu="{gpu}"' in labels and 'kind="no-process"' in labels, float(value))
            for labels, value in by_kind] == [(True, 5 * GiB)], by_kind
    assert smi_calls(log) == [], "the default policy resets nothing"

    done = daemon.ctl("reset", "--gpu", str(gpu), "--reason", "test", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    bus_id = host.state.gpus[gpu].pci_bus_id
    assert smi_calls(log) == [["-r", "-i", bus_id]]
    assert report["kind"] == "reset" and report["outcome"] == "reset" and report["verified"]
    assert report["leaks"] == [{"gpu": gpu, "uuid": host.state.gpus[gpu].uuid, "bytes": 5 * GiB,
                                "kind": "no-process"}]
    assert report["gpus"][0]["memory_used_before"] == 5 * GiB
    assert report["gpus"][0]["memory_used_after"] == 0 and report["gpus"][0]["released"]
    steps = "\n".join(report["steps"])
    assert "turned persistence mode off" in steps and "restored persistence mode" in steps
    assert "closed gpuguardd's NVML session" in steps
    assert (Path(f"{host.state_path}.persistence.{gpu}").read_text().strip() == "1"), \
        "persistence mode restored"
    wait_until(lambda: daemon.property_is(path, GPU, "State", "idle"), 10, "idle after the reset")
    assert daemon.get_property(path, GPU, "LeakKind") == ""
    history = daemon.manager("GetHistory", "u", "1")[0]
    assert history[0]["id"] == report["id"] and history[0]["kind"] == "reset"
    metrics = daemon.manager("GetMetrics")[0]
    assert 'gpuguard_gpu_resets_total{outcome="reset"} 1.0' in metrics
    assert 'gpuguard_sweeps_total{' not in metrics, "a reset is no sweep"
    check = daemon.ctl("check", "--gpu", str(gpu))
    assert check.returncode == 0 and f"GPU {gpu} was recovered by reset {report['id'][:8]}" \
        in check.stderr, check.stderr
    assert f"reset {report['id'][:8]} GPU {gpu}: running" in daemon.stderr()


def test_reset_refused_while_a_management_client_holds_the_gpu(daemon: GuardDaemon,
                                                               recorder: SignalRecorder) -> None:
    gpu, log = start(daemon)
    host = daemon.host
    leak_on(daemon, recorder, gpu, 3 * GiB)
    smi = host.spawn("--hold", str(host.dev / f"nvidia{PRIVATE_MINOR}"))

    def refused() -> dict[str, object] | None:
        report = daemon.manager("ResetGpu", "ua{sv}", str(gpu), "0")[0]
        return report if str(smi.pid) in str(report.get("error")) else None
    report = wait_until(refused, 20, "a refusal naming the client", interval=0.5)
    assert report["outcome"] == "reset-refused" and report["kind"] == "reset"
    assert smi_calls(log) == [], "never asked nvidia-smi"
    assert daemon.get_property(f"{MANAGER_PATH}/gpu/{gpu}", GPU, "State") == "leaked"
    assert 'gpuguard_gpu_resets_total{outcome="reset-refused"}' in daemon.manager("GetMetrics")[0]
    # Anyone else is asked for polkit's reset-gpu action, which nobody here grants.
    try:
        daemon.manager("ResetGpu", "ua{sv}", str(gpu), "0", as_nobody=True)
    except BusctlError as exc:
        assert "not allowed to reset-gpu" in str(exc)
    else:
        raise AssertionError("an unprivileged caller reset a GPU")


def test_reset_refused_on_an_nvlink_gpu(daemon: GuardDaemon, recorder: SignalRecorder) -> None:
    gpu, log = start(daemon, nvlink=4)
    leak_on(daemon, recorder, gpu, 3 * GiB)
    result = daemon.ctl("reset", "--gpu", str(gpu), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 7 and report["outcome"] == "reset-refused"
    assert "NVLink link(s) 0,1,2,3 are active" in report["error"]
    assert smi_calls(log) == []


def test_auto_reset_resets_dead_pid_memory_after_the_grace(daemon: GuardDaemon) -> None:
    gpu, log = start(daemon, "AutoReset=yes\nLeakGraceSec=1\nResetIntervalSec=1h\n")
    host = daemon.host
    path = f"{MANAGER_PATH}/gpu/{gpu}"
    wait_until(lambda: daemon.property_is(path, GPU, "State", "idle"), 10, "idle")
    # 2 GiB on a pid that no process has: memory of the dead.
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = next(p for p in range(pid_max - 1, 300, -1) if not os.path.exists(f"/proc/{p}"))
    host.state.add_proc(gpu, dead, 2 * GiB, raw=True)
    host.publish()
    wait_until(lambda: daemon.get_property(path, GPU, "LeakKind") == "dead-pids", 10, "dead-pids")

    def reset() -> dict[str, object] | None:
        history = daemon.manager("GetHistory", "u", "5")[0]
        return next((r for r in history if r.get("kind") == "reset"), None)
    report = wait_until(reset, 20, "an automatic reset", interval=0.2)
    assert report["requested_by"] == "gpuguardd (AutoReset)" and report["outcome"] == "reset"
    assert "dead-pids" in str(report["reason"])
    assert smi_calls(log) == [["-r", "-i", host.state.gpus[gpu].pci_bus_id]]
    wait_until(lambda: daemon.property_is(path, GPU, "State", "idle"), 10, "idle after it")
    assert "resetting it ([Recovery] AutoReset)" in daemon.stderr()


def test_without_the_privilege_the_reset_fails_having_touched_nothing(
        daemon: GuardDaemon, recorder: SignalRecorder) -> None:
    # What the driver answers a caller without CAP_SYS_ADMIN (the shipped unit's lot).
    gpu, log = start(daemon, persistence=True)
    daemon.host.state.fail = {"nvmlDeviceSetPersistenceMode": 4}  # NVML_ERROR_NO_PERMISSION
    daemon.host.publish()
    leak_on(daemon, recorder, gpu, 3 * GiB)
    report = daemon.manager("ResetGpu", "ua{sv}", str(gpu), "0")[0]
    assert report["outcome"] == "reset-failed" and "CAP_SYS_ADMIN" in report["error"], report
    assert smi_calls(log) == [], "never asked nvidia-smi"
    assert daemon.get_property(f"{MANAGER_PATH}/gpu/{gpu}", GPU, "State") == "leaked"


def test_a_mig_gpu_is_reset_only_once_no_instance_has_a_tenant(daemon: GuardDaemon) -> None:
    mig = setup_mig(daemon.host, "[Daemon]\nPollIntervalSec=0.25\n")
    host = daemon.host
    log = host.root / "smi.log"
    daemon.extra_env.update({"PATH": f"{FAKE_SMI_DIR}:{os.environ['PATH']}",
                             "FAKE_NVIDIA_SMI_LOG": str(log)})
    daemon.start()
    refused = daemon.manager("ResetGpu", "ua{sv}", "1", "0")[0]
    assert refused["outcome"] == "reset-refused" and "live process(es)" in refused["error"]
    assert smi_calls(log) == []

    for tenant in (mig.a, mig.b):
        tenant.stop()
    host.state.procs = []
    host.publish()
    wait_until(lambda: daemon.manager("ListHolders", "a{sv}", "1", "gpus", "as", "1", "1")[0] == [],
               20, "no tenant left", interval=0.25)
    report = daemon.manager("ResetGpu", "ua{sv}", "1", "0")[0]
    assert report["outcome"] == "reset", report
    assert any("MIG mode: its 3 instance(s) are gone" in step for step in report["steps"])
    assert smi_calls(log) == [["-r", "-i", host.state.gpus[1].pci_bus_id]]

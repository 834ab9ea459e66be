"""GPU resets on a real systemd: a leak with nothing holding it is left alone under the default
policy and reset under [Recovery] AutoReset=yes, a reset is refused while a management client
holds the GPU, and the history, the journal and the metrics say what happened.

The reset command is the default one, `nvidia-smi -r -i BUS_ID`, found on gpuguardd's PATH:
tests/fakenvml/nvidia-smi installed as /usr/local/bin/nvidia-smi, which records its argv and
clears the GPU's memory in the fake NVML's state, as a reset does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import FAKE_NVML_STATE, REPO, GiB, Installed, wait_for

pytestmark = pytest.mark.timeout(240)

GPU = 1
GPU_PATH = f"/org/gpuguard/GpuGuard1/gpu/{GPU}"
SMI_LOG = "/run/fake-nvml/smi.log"
# The fake nvidia-smi rewrites the state file and the fake NVML keeps persistence mode beside
# it: the daemon's unit (ProtectSystem=strict) may write there, and nowhere else.
DROPIN = f"[Service]\nEnvironment=FAKE_NVIDIA_SMI_LOG={SMI_LOG}\nReadWritePaths=/run/fake-nvml\n"
RECOVERY = "/etc/gpuguard/gpuguard.conf.d/recovery.conf"


def set_recovery(guard: Installed, text: str) -> None:
    guard.machine.write(RECOVERY, "[Recovery]\n" + text)
    guard.machine.systemctl("reload", "gpuguardd.service")


def leak(guard: Installed, used: int) -> None:
    """Memory in use on the GPU with no process: the fake NVML's `used=` of its gpu line."""
    m = guard.machine
    state = re.sub(rf"(?m)^(gpu {GPU} .*?) used=\d+", rf"\g<1> used={used}", m.read(FAKE_NVML_STATE))
    m.write(FAKE_NVML_STATE, state, 0o666)


def gpu_property(guard: Installed, name: str) -> Any:
    done = guard.busctl("--json=short", "get-property", "org.gpuguard.GpuGuard1", GPU_PATH,
                        "org.gpuguard.GpuGuard1.Gpu", name)
    return json.loads(done.stdout)["data"]


def smi_calls(guard: Installed) -> list[list[str]]:
    done = guard.machine.run(["cat", SMI_LOG], check=False)
    return [json.loads(line) for line in done.stdout.splitlines()]


def resets(guard: Installed) -> list[dict[str, Any]]:
    return [r for r in guard.history() if r.get("kind") == "reset"]


def metric(guard: Installed, outcome: str) -> float:
    text = guard.result("GetMetrics")
    found = re.search(rf'^gpuguard_gpu_resets_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


@pytest.fixture
def recovery(guard: Installed) -> Iterator[Installed]:
    m = guard.machine
    m.copy(REPO / "tests" / "fakenvml" / "nvidia-smi", "/usr/local/bin/nvidia-smi", 0o755)
    m.write("/etc/systemd/system/gpuguardd.service.d/reset.conf", DROPIN)
    m.run(f"rm -f {SMI_LOG} {FAKE_NVML_STATE}.persistence.*")
    m.write(RECOVERY, "[Recovery]\nLeakGraceSec=1\n")
    m.systemctl("daemon-reload")
    m.systemctl("restart", "gpuguardd.service")
    try:
        yield guard
    finally:
        leak(guard, 0)
        m.run(["rm", "-f", RECOVERY, "/etc/systemd/system/gpuguardd.service.d/reset.conf",
               "/usr/local/bin/nvidia-smi"])
        m.systemctl("daemon-reload")
        m.systemctl("restart", "gpuguardd.service")


def test_a_leak_is_reset_only_under_auto_reset(recovery: Installed) -> None:
    guard = recovery
    before = len(resets(guard))
    leak(guard, 3 * GiB)
    wait_for("the GPU leaked", lambda: gpu_property(guard, "State") == "leaked" or None, 20, 0.3)
    assert gpu_property(guard, "LeakKind") == "no-process"
    # The default policy: LeakGraceSec=1 has long passed, and still nothing resets.
    guard.machine.run("sleep 3")
    assert smi_calls(guard) == [] and len(resets(guard)) == before

    set_recovery(guard, "AutoReset=yes\nLeakGraceSec=1\nResetIntervalSec=1h\n")
    report = wait_for("the automatic reset", lambda: next(
        (r for r in resets(guard)[:1] if len(resets(guard)) > before), None), 30, 0.5)
    assert report["requested_by"] == "gpuguardd (AutoReset)" and report["outcome"] == "reset"
    assert report["leaks"][0]["kind"] == "no-process" and report["verified"]
    bus_id = f"00000000:{GPU + 1:02X}:00.0"
    assert smi_calls(guard) == [["-r", "-i", bus_id]]
    wait_for("the GPU idle again", lambda: gpu_property(guard, "State") == "idle" or None, 20, 0.3)
    journal = guard.machine.journal("-u", "gpuguardd.service")
    assert f"reset {report['id'][:8]} GPU {GPU}: running nvidia-smi -r -i {bus_id}" in journal
    assert f"reset {report['id'][:8]} GPU {GPU}: verified" in journal
    assert metric(guard, "reset") == 1.0
    check = guard.machine.run(["gpuguardctl", "check", "--gpu", str(GPU)], check=False)
    assert check.returncode == 0 and f"recovered by reset {report['id'][:8]}" in check.stderr


def test_a_reset_is_refused_while_a_management_client_holds_the_gpu(recovery: Installed) -> None:
    guard = recovery
    m = guard.machine
    # An nvidia-smi-like client in a unit of its own: it holds the GPU's node, no CUDA. The
    # fake node has no driver behind it, so it can only be opened O_PATH; the fd in
    # /proc/<pid>/fd looks the same to a scan.
    m.run(["systemd-run", "--unit=gg-smi-like.service", "/usr/bin/python3", "-c",
           f"import os, time; fd = os.open('/dev/nvidia{GPU}', os.O_PATH); time.sleep(600)"])
    try:
        pid = int(m.show("gg-smi-like.service", "MainPID"))
        wait_for("the client as a holder", lambda: any(
            h["pid"] == pid and h["kind"] == "management" for h in guard.holders()) or None, 20, 0.3)
        leak(guard, 2 * GiB)
        wait_for("the GPU leaked", lambda: gpu_property(guard, "State") == "leaked" or None, 20, 0.3)
        done = m.run(["gpuguardctl", "reset", "--gpu", str(GPU), "--json"], check=False)
        report = json.loads(done.stdout)
        assert done.returncode == 7 and report["outcome"] == "reset-refused", done.stdout + done.stderr
        assert f"pid {pid} " in report["error"] and "gg-smi-like.service" in report["error"]
        assert smi_calls(guard) == [], "never asked nvidia-smi"
        assert resets(guard)[0]["id"] == report["id"]
        assert "refused" in m.journal("-u", "gpuguardd.service", "--grep", report["id"][:8])
        assert metric(guard, "reset-refused") == 1.0
    finally:
        m.systemctl("stop", "gg-smi-like.service", check=False)

"""gpuguardd on a real bus sees a leak past the processes that hold every GPU's node on a real
host: nvidia-persistenced (protected), an nvidia-smi-like management client, and gpuguardd's
own NVML handles (the fake library opens the nodes as libnvidia-ml does)."""

from __future__ import annotations

import json
import os
import shutil

from tests.conftest import GiB
from tests.dbus_harness import (
    GPU,
    MANAGER_PATH,
    PRIVATE_MINOR,
    PYTHON,
    GuardDaemon,
    SignalRecorder,
    leak_on,
    private_gpu,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]


def test_leak_suspected_past_management_and_protected_holders(daemon: GuardDaemon,
                                                              recorder: SignalRecorder) -> None:
    host = daemon.host
    gpu = private_gpu(host)
    node, ctl = str(host.dev / f"nvidia{PRIVATE_MINOR}"), host.node("nvidiactl")
    bindir = host.root / "usr-bin"
    bindir.mkdir()
    persistenced_exe = bindir / "nvidia-persistenced"
    shutil.copy2(os.path.realpath(PYTHON), persistenced_exe)
    host.write_config(f"PollIntervalSec=0.25\n[Sweep]\nProtectedExecutables={persistenced_exe}\n")
    host.state.nodes = [ctl, node]  # what the daemon's libnvidia-ml opens at nvmlInit
    host.publish()
    persistenced = host.spawn("--hold", ctl, "--hold", node, exe=str(persistenced_exe))
    smi = host.spawn("--hold", ctl, "--hold", node)
    daemon.start()
    assert daemon.proc is not None
    path = f"{MANAGER_PATH}/gpu/{gpu}"

    wanted = {persistenced.pid, smi.pid, daemon.proc.pid}

    def holders() -> dict[int, dict[str, object]] | None:
        listed = json.loads(daemon.ctl("holders", "--json", "--gpu", str(gpu)).stdout)
        found = {h["pid"]: h for h in listed}
        return found if wanted <= set(found) else None

    seen = wait_until(holders, 20, "persistenced, the client and gpuguardd itself as holders")
    assert seen[daemon.proc.pid]["kind"] == "management" and seen[daemon.proc.pid]["protected"]
    assert seen[persistenced.pid]["protected"] and seen[smi.pid]["kind"] == "management"
    leak_on(daemon, recorder, gpu, 5 * GiB)
    assert daemon.get_property(path, GPU, "HolderCount") >= 3

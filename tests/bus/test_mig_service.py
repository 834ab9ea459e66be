"""MIG through gpuguardd on a private dbus-daemon: Gpu objects show the instances, gpus options
take MIG UUIDs, and gpuguardctl talks to the daemon about them (see tests/host/test_mig.py)."""

from __future__ import annotations

import time
from typing import Any

from tests.conftest import GiB
from tests.dbus_harness import GPU, MANAGER_PATH, GuardDaemon, SignalRecorder, wait_until
from tests.host.test_mig import MIG_A, MIG_B, MIG_C, setup_mig

pytest_plugins = ["tests.dbus_harness"]

GPU0 = MANAGER_PATH + "/gpu/0"
GPU1 = MANAGER_PATH + "/gpu/1"


def instance(guard: GuardDaemon, uuid: str) -> dict[str, Any]:
    return next(i for i in guard.get_property(GPU1, GPU, "MigInstances") if i["uuid"] == uuid)


def test_gpu_objects_show_instances_and_gpus_options_select_one(
        daemon: GuardDaemon, recorder: SignalRecorder) -> None:
    mig = setup_mig(daemon.host, "[Daemon]\nPollIntervalSec=0.25\n")
    guard = daemon
    guard.start()
    assert guard.get_property(GPU0, GPU, "MigMode") is False
    assert guard.get_property(GPU0, GPU, "MigInstances") == []
    assert guard.get_property(GPU1, GPU, "MigMode") is True
    wait_until(lambda: instance(guard, MIG_A)["holder_count"] == 1, 10, "instance A's tenant")
    assert instance(guard, MIG_A) == {
        "uuid": MIG_A, "gpu_instance_id": 1, "compute_instance_id": 0,
        "device_path": mig.caps["a-ci"], "memory_total": 40 * GiB, "memory_used": 3 * GiB,
        "holder_count": 1, "state": "in-use"}
    assert instance(guard, MIG_C)["state"] == "idle"
    types = guard.busctl("get-property", "--json=short", "org.gpuguard.GpuGuard1", GPU1, GPU,
                         "MigInstances").json
    assert types["type"] == "aa{sv}"
    assert {k: v["type"] for k, v in types["data"][0].items()} == {
        "uuid": "s", "gpu_instance_id": "u", "compute_instance_id": "u", "device_path": "s",
        "memory_total": "t", "memory_used": "t", "holder_count": "u", "state": "s"}

    # ListHolders: gpus as strings, a MIG UUID selecting one instance; holders carry `mig`.
    only_b = guard.manager("ListHolders", "a{sv}", "1", "gpus", "as", "1", MIG_B)[0]
    assert [h["pid"] for h in only_b] == [mig.b.pid]
    assert only_b[0]["mig"] == [MIG_B] and only_b[0]["gpus"] == [1]
    # The released au form still works and means the whole GPU.
    whole = guard.manager("ListHolders", "a{sv}", "1", "gpus", "au", "1", "1")[0]
    assert {h["pid"] for h in whole} >= {mig.a.pid, mig.b.pid}

    # gpuguardctl through the daemon: the instance under its GPU, then a sweep of A alone.
    shown = guard.ctl("gpus")
    assert shown.returncode == 0, shown.stderr
    assert MIG_A in shown.stdout and MIG_B in shown.stdout
    swept = guard.ctl("sweep", "--gpu", MIG_A, "--json")
    assert swept.returncode == 0, swept.stderr
    report = swept.json
    assert [t["pid"] for t in report["terminated"]] == [mig.a.pid]
    assert report["gpus"][0]["mig_uuid"] == MIG_A and report["gpus"][0]["index"] == 1
    assert report["gpus"][0]["released"] is True and report["scope"]["mig"] == [MIG_A]
    assert not mig.a.alive() and mig.b.alive()
    # The instance's properties follow, with PropertiesChanged like every Gpu property.
    wait_until(lambda: instance(guard, MIG_A)["memory_used"] == 0, 10, "A's memory released")
    recorder.wait_for("PropertiesChanged", lambda s: s.path == GPU1 and any(
        i.get("uuid") == MIG_A and i.get("memory_used") == 0 and i.get("holder_count") == 0
        for i in s.body[1].get("MigInstances", [])))
    time.sleep(1.0)
    # Only changes are signalled: GPU 0's (empty) instances never changed.
    assert recorder.property_changes(GPU0, "MigInstances") == []
    # Instance B's tenant goes away on its own and B keeps 2 GiB with no process, while a
    # tenant of C keeps the GPU in-use: the GPU's aggregate hides the leak, the instance's
    # own LeakSuspected (by its MIG UUID) does not.
    host = guard.host
    in_c = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    host.state.add_proc(1, in_c.pid, GiB, mig=MIG_C)
    host.publish()
    wait_until(lambda: instance(guard, MIG_C)["state"] == "in-use", 10, "C in use")
    assert not any(s.body[1] == MIG_B for s in recorder.of("LeakSuspected"))
    mig.b.stop()
    recorder.wait_for("LeakSuspected", lambda s: s.body == [1, MIG_B, 2 * GiB])
    assert instance(guard, MIG_B)["state"] == "leaked"
    assert guard.get_property(GPU1, GPU, "State") == "in-use"
    assert not any(s.body[0] == 1 and s.body[1] != MIG_B for s in recorder.of("LeakSuspected"))


def test_unknown_mig_uuid_is_invalid_argument(guard: GuardDaemon) -> None:
    wrong = "MIG-00000000-dead-4000-8000-000000000000"
    result = guard.gdbus("--object-path", MANAGER_PATH, "--method",
                         "org.gpuguard.GpuGuard1.Manager.Sweep", f"{{'gpus': <['{wrong}']>}}")
    assert result.returncode != 0
    assert "org.gpuguard.GpuGuard1.Error.InvalidArgument" in result.stderr and wrong in result.stderr
    ctl = guard.ctl("holders", "--gpu", wrong)
    assert ctl.returncode == 2 and wrong in ctl.stderr
    assert guard.alive()

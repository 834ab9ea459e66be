"""MIG end to end against the fake NVML's MIG mode and real processes.

GPU 1 runs in MIG mode with instances A (GPU instance 1, compute instance 0), B (GPU
instance 2) and C (GPU instance 1, compute instance 1); A and B have one tenant each. Each
tenant holds what a CUDA process in an instance holds on a real host: /dev/nvidia1,
nvidia-uvm and its instance's two caps nodes (the GPU instance's and the compute instance's
access node, numbered as this test's mig-minors file says).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import GiB, GpuHost, Proc
from tests.helpers import cli_json

MIG_A = "MIG-aaaaaaaa-1111-4000-8000-00000000000a"
MIG_B = "MIG-bbbbbbbb-2222-4000-8000-00000000000b"
MIG_C = "MIG-cccccccc-3333-4000-8000-00000000000c"  # a second compute instance in A's GPU instance


@dataclass
class MigHost:
    host: GpuHost
    caps: dict[str, str]  # "a-gi", "a-ci", "b-gi", "b-ci", "c-ci" -> node path
    a: Proc
    b: Proc


def caps_nodes(host: GpuHost) -> tuple[dict[str, str], str]:
    """Caps nodes under the host's dev/nvidia-caps and the mig-minors text that names them."""
    directory = host.dev / "nvidia-caps"
    directory.mkdir()
    # Private numbers, as conftest does for the GPU nodes: major 120, a random block.
    base = random.randrange(1, 1 << 16) * 8
    minors = {"a-gi": base, "a-ci": base + 1, "b-gi": base + 2, "b-ci": base + 3, "c-ci": base + 4}
    caps: dict[str, str] = {}
    for name, minor in minors.items():
        path = directory / f"nvidia-cap{minor}"
        os.mknod(path, 0o666 | 0o020000, os.makedev(120, minor))
        caps[name] = str(path)
    text = ("config 1\nmonitor 2\n"
            f"gpu1/gi1/access {minors['a-gi']}\ngpu1/gi1/ci0/access {minors['a-ci']}\n"
            f"gpu1/gi2/access {minors['b-gi']}\ngpu1/gi2/ci0/access {minors['b-ci']}\n"
            f"gpu1/gi1/ci1/access {minors['c-ci']}\n")
    return caps, text


def tenant(host: GpuHost, caps: dict[str, str], which: str) -> Proc:
    return host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"),
                      "--hold", caps[f"{which}-gi"], "--hold", caps[f"{which}-ci"],
                      "--comm", f"tenant-{which}")


@pytest.fixture
def mig_host(gpu_host: GpuHost) -> MigHost:
    return setup_mig(gpu_host)


def setup_mig(host: GpuHost, config: str = "") -> MigHost:
    """GPU 1 of `host` in MIG mode with instances A, B, C and tenants in A and B."""
    caps, minors = caps_nodes(host)
    (host.root / "mig-minors").write_text(minors)
    host.write_config(f"[Devices]\nPaths={host.dev}/nvidia-caps/*\n"
                      f"MigMinorsPath={host.root}/mig-minors\n" + config)
    host.state.add_mig(1, MIG_A, gpu_instance_id=1, compute_instance_id=0, memory_total=40 * GiB)
    # Instance B also keeps 2 GiB with no process: a sweep that checked the GPU's aggregate
    # memory instead of instance A's would never see A's memory come back.
    host.state.add_mig(1, MIG_B, gpu_instance_id=2, compute_instance_id=0, memory_total=40 * GiB,
                       base_used=2 * GiB)
    host.state.add_mig(1, MIG_C, gpu_instance_id=1, compute_instance_id=1, memory_total=40 * GiB)
    a = tenant(host, caps, "a")
    b = tenant(host, caps, "b")
    host.state.add_proc(1, a.pid, 3 * GiB, mig=MIG_A, release_delay_ms=200)
    host.state.add_proc(1, b.pid, 5 * GiB, mig=MIG_B)
    host.publish()
    return MigHost(host, caps, a, b)



def test_sweep_of_one_instance_ends_its_tenant_only_and_verifies_its_memory(mig_host: MigHost) -> None:
    host = mig_host.host
    code, report, stderr = cli_json(host, "sweep", "--gpu", MIG_A.lower(), "--grace", "2s")
    assert code == 0, stderr
    assert report["outcome"] == "freed", report
    assert report["verified"] is True
    assert [t["pid"] for t in report["terminated"]] == [mig_host.a.pid]
    assert report["targets"][0]["mig"] == [MIG_A]
    assert not mig_host.a.alive() and mig_host.b.alive()
    assert report["scope"]["mig"] == [MIG_A] and report["scope"]["gpus"] == []
    # Verified on instance A's memory, not on the GPU's aggregate (which B's leak keeps up).
    assert report["gpus"] == [{"index": 1, "uuid": host.state.gpus[1].uuid, "mig_uuid": MIG_A,
                               "memory_total": 40 * GiB, "memory_used_before": 3 * GiB,
                               "memory_used_after": 0, "released": True}]
    assert report["leaks"] == []


@pytest.mark.parametrize("parent_lists", ["empty", "aggregate"])
def test_holders_carry_their_instance_and_filter_by_it(mig_host: MigHost, parent_lists: str) -> None:
    """Whether the parent's lists are empty (unprivileged) or the aggregate (root), each tenant
    is on its instance, once, with its memory counted once."""
    host = mig_host.host
    host.state.gpus[1].mig_parent_lists = parent_lists  # type: ignore[assignment]
    host.publish()
    code, holders, stderr = cli_json(host, "holders")
    assert code == 0, stderr
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[mig_host.a.pid]["mig"] == [MIG_A] and by_pid[mig_host.a.pid]["gpus"] == [1]
    assert by_pid[mig_host.b.pid]["mig"] == [MIG_B] and by_pid[mig_host.b.pid]["gpus"] == [1]
    assert by_pid[mig_host.a.pid]["gpu_memory"] == 3 * GiB
    # NVML's instance lists place a tenant even when it holds no caps node gpuguard watches
    # (a container's own nodes, say).
    listed = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    host.state.add_proc(1, listed.pid, GiB, mig=MIG_B)
    host.publish()
    code, holders, _ = cli_json(host, "holders")
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[listed.pid]["mig"] == [MIG_B] and by_pid[listed.pid]["how"] == ["fd", "nvml"]
    code, only_b, stderr = cli_json(host, "holders", "--gpu", MIG_B)
    assert code == 0, stderr
    assert [h["pid"] for h in only_b] == sorted([mig_host.b.pid, listed.pid])
    # The whole GPU still means every tenant of it.
    code, both, _ = cli_json(host, "holders", "--gpu", "1")
    assert {h["pid"] for h in both} == {mig_host.a.pid, mig_host.b.pid, listed.pid}


def test_caps_nodes_map_to_their_gpu_and_instance(mig_host: MigHost) -> None:
    """Processes NVML does not list (yet) are placed by the caps nodes they hold, and a sweep of
    the other instance leaves them alone."""
    host, caps = mig_host.host, mig_host.caps
    in_b = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"),
                      "--hold", caps["b-gi"], "--hold", caps["b-ci"])
    gi_only = host.spawn("--hold", host.node("nvidia1"), "--hold", caps["a-gi"])
    in_a = host.spawn("--hold", host.node("nvidia1"), "--hold", caps["a-gi"], "--hold", caps["a-ci"])
    code, holders, stderr = cli_json(host, "holders")
    assert code == 0, stderr
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[in_b.pid]["mig"] == [MIG_B] and by_pid[in_b.pid]["gpus"] == [1]
    assert by_pid[in_b.pid]["how"] == ["fd"]
    # A compute instance's node names it; a GPU instance's node alone, all of its instances.
    assert by_pid[in_a.pid]["mig"] == [MIG_A]
    assert by_pid[gi_only.pid]["mig"] == [MIG_A, MIG_C]
    code, report, stderr = cli_json(host, "sweep", "--gpu", MIG_A)
    assert code == 0, stderr
    assert {t["pid"] for t in report["terminated"]} == {mig_host.a.pid}
    assert in_b.alive() and mig_host.b.alive()
    # On A and C, so not inside a scope of A alone: spared, saying why.
    assert gi_only.alive()
    assert any(s["pid"] == gi_only.pid and s["why"] == f"also in MIG instance {MIG_C}"
               for s in report["spared"]), report["spared"]


def test_unknown_mig_uuid_is_a_usage_error_naming_it(mig_host: MigHost) -> None:
    host = mig_host.host
    wrong = "MIG-00000000-dead-4000-8000-000000000000"
    assert host.cli("holders", "--gpu", MIG_A).returncode == 0  # a known one is fine
    for verb in ("sweep", "holders"):
        result = host.cli(verb, "--gpu", wrong)
        assert result.returncode == 2, result
        assert wrong in result.stderr
    assert mig_host.a.alive() and mig_host.b.alive()


def test_gpus_show_instances_under_their_gpu(mig_host: MigHost) -> None:
    host = mig_host.host
    code, gpus, stderr = cli_json(host, "gpus")
    assert code == 0, stderr
    assert [g["mig_mode"] for g in gpus] == [False, True]
    assert gpus[0]["mig_instances"] == []
    a, b, c = gpus[1]["mig_instances"]
    assert a == {"uuid": MIG_A, "gpu_instance_id": 1, "compute_instance_id": 0,
                 "device_path": mig_host.caps["a-ci"], "memory_total": 40 * GiB,
                 "memory_used": 3 * GiB, "holder_count": 1, "state": "in-use"}
    assert b["uuid"] == MIG_B and b["memory_used"] == 7 * GiB and b["holder_count"] == 1
    assert c["uuid"] == MIG_C and c["state"] == "idle" and c["holder_count"] == 0
    result = host.cli("gpus")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    gpu1 = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    # Each instance on its own line right under its GPU, named by its UUID.
    assert MIG_A in lines[gpu1 + 1] and "3.0 GiB / 40.0 GiB" in lines[gpu1 + 1]
    assert MIG_B in lines[gpu1 + 2] and "in-use" in lines[gpu1 + 2]
    result = host.cli("holders")
    row = next(line for line in result.stdout.splitlines() if line.startswith(f"{mig_host.a.pid} "))
    assert MIG_A in row


def test_mig_minors_file_is_untrusted(tmp_path: Path) -> None:
    # Imported here so that the rest of the file also runs against an engine without MIG.
    from gpuguardd.engine.devices import build_device_map, read_mig_minors

    path = tmp_path / "mig-minors"
    path.write_bytes(b"config 1\nmonitor 2\ngpu0/gi1/access 3\ngpu0/gi1/ci0/access 4\n"
                     b"gpu0/gi1/ci0/access\ngpu0/gi99999999999/access 5\n\xff\xfe junk\n"
                     b"gpu1/gi2/access -6\n")
    caps, problem = read_mig_minors(str(path))
    assert problem == ""
    assert sorted(caps) == [3, 4]
    assert caps[4].gpu_minor == 0 and caps[4].gpu_instance_id == 1 and caps[4].compute_instance_id == 0
    assert caps[3].compute_instance_id is None
    assert read_mig_minors(str(tmp_path / "missing")) == ({}, "")
    path.write_bytes(b"x" * (2 << 20))
    caps, problem = read_mig_minors(str(path))
    assert caps == {} and str(path) in problem
    # A caps node's minor is its name's number when its major is no NVIDIA driver's.
    node = tmp_path / "nvidia-caps" / "nvidia-cap4"
    node.parent.mkdir()
    os.mknod(node, 0o600 | 0o020000, os.makedev(120, random.randrange(1, 1 << 16)))
    device_map = build_device_map([str(node)], allow_majors=[120],
                                  mig_minors=str(tmp_path / "missing"))
    assert device_map.nodes[0].role == "caps" and device_map.nodes[0].minor == 4


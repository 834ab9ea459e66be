"""Which GPU a holder is on, as on a real host: every CUDA process holds every GPU's node, so
only NVML's per-GPU lists say which GPU it computes on; management clients (persistenced,
dcgm-exporter, gpuguard's own NVML handles) hold every node too and must not hide a leak."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from tests.conftest import GiB, GpuHost, MiB
from tests.helpers import cli_json


def cuda(host: GpuHost, gpu: int | None, used: int = 2 * GiB, *extra: str) -> Any:
    """A CUDA-like process: holds every GPU node, nvidiactl and nvidia-uvm; NVML lists it on
    `gpu` only (on none when None, like a process that ran cuInit and made no context)."""
    return host.spawn("--cuda", str(host.dev), *extra,
                      nvml=None if gpu is None else (gpu, used))


def test_sweep_of_one_gpu_spares_the_tenant_of_another(gpu_host: GpuHost) -> None:
    host = gpu_host
    on0 = cuda(host, 0, 4 * GiB)
    on1 = cuda(host, 1, 2 * GiB)
    code, report, stderr = cli_json(host, "sweep", "--gpu", "1")
    assert code == 0, stderr
    assert [t["pid"] for t in report["terminated"]] == [on1.pid]
    assert on0.alive() and not on1.alive()
    assert report["outcome"] == "freed" and report["verified"] is True
    assert [t["pid"] for t in report["targets"]] == [on1.pid]


def test_holder_shows_nvml_gpus_and_node_gpus_apart(gpu_host: GpuHost) -> None:
    host = gpu_host
    listed = cuda(host, 1)
    unlisted = cuda(host, None)
    _, holders, _ = cli_json(host, "holders")
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[listed.pid]["gpus"] == [1]
    assert by_pid[listed.pid]["nvml_gpus"] == [1]
    assert by_pid[listed.pid]["node_gpus"] == [0, 1]
    assert by_pid[listed.pid]["gpus_from"] == "nvml"
    assert by_pid[unlisted.pid]["gpus"] == [0, 1]
    assert by_pid[unlisted.pid]["nvml_gpus"] == []
    assert by_pid[unlisted.pid]["gpus_from"] == "nodes"
    # ListHolders' GPU filter follows the same rule as a sweep.
    _, on0, _ = cli_json(host, "holders", "--gpu", "0")
    assert listed.pid not in {h["pid"] for h in on0}


def _unlisted_holders_follow_the_fd_rule(host: GpuHost, exit_code: int) -> None:
    everywhere = cuda(host, None)
    only1 = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidiactl"),
                       "--hold", host.node("nvidia-uvm"))
    code, report, stderr = cli_json(host, "sweep", "--gpu", "1")
    assert [t["pid"] for t in report["terminated"]] == [only1.pid], report
    assert everywhere.alive() and not only1.alive()
    spared = {s["pid"]: s["why"] for s in report["spared"]}
    assert spared[everywhere.pid] == "also holds GPU 0; NVML lists it on no GPU"
    # Every GPU node it holds in the scope: it goes.
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0", "--gpu", "1")
    assert code == exit_code, stderr
    assert [t["pid"] for t in report["terminated"]] == [everywhere.pid], stderr


def test_process_nvml_does_not_list_is_in_scope_only_if_all_its_gpus_are(gpu_host: GpuHost) -> None:
    _unlisted_holders_follow_the_fd_rule(gpu_host, 0)


def test_without_nvml_the_same_fd_rule_applies(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    host.publish()
    _unlisted_holders_follow_the_fd_rule(host, 6)  # unverified: no NVML to prove memory back


def test_unit_and_whole_host_scopes_are_unchanged(gpu_host: GpuHost) -> None:
    host = gpu_host
    everywhere = cuda(host, None)
    code, report, stderr = cli_json(host, "sweep")
    assert code == 0, stderr
    assert [t["pid"] for t in report["terminated"]] == [everywhere.pid], stderr


def protected_persistenced(host: GpuHost) -> tuple[str, str]:
    """A copy of python named nvidia-persistenced, and the config line that protects it."""
    bindir = host.root / "usr-bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "nvidia-persistenced"
    shutil.copy2(os.path.realpath(sys.executable), exe)
    return str(exe), f"[Sweep]\nProtectedExecutables={exe}\n"


def test_management_and_protected_holders_do_not_hide_a_leak(gpu_host: GpuHost) -> None:
    """GPU 0 has memory used and no process NVML lists: leaked, though persistenced (protected),
    an nvidia-smi-like client and gpuguardctl's own NVML handles hold every GPU's node."""
    host = gpu_host
    exe, protect = protected_persistenced(host)
    host.write_config(protect)
    host.state.nodes = [host.node("nvidiactl"), host.node("nvidia0"), host.node("nvidia1")]
    host.state.gpus[0].base_used = 6 * GiB
    host.state.gpus[1].reserved = 700 * MiB
    host.state.gpus[1].base_used = 1 * MiB
    host.publish()
    persistenced = host.spawn("--hold", host.node("nvidiactl"), "--hold", host.node("nvidia0"),
                              "--hold", host.node("nvidia1"), exe=exe)
    smi = host.spawn("--hold", host.node("nvidiactl"), "--hold", host.node("nvidia0"),
                     "--hold", host.node("nvidia1"))
    _, holders, _ = cli_json(host, "holders")
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[persistenced.pid]["protected"] is True
    assert by_pid[smi.pid]["kind"] == "management"
    own = [h for h in holders if h["comm"].startswith("python") and h["kind"] == "management"
           and h["protected"] and h["pid"] not in (persistenced.pid, smi.pid)]
    assert own, f"gpuguardctl's own NVML handles are not among the holders: {holders}"
    _, gpus, _ = cli_json(host, "gpus")
    states = {g["index"]: g["state"] for g in gpus}
    assert states == {0: "leaked", 1: "idle"}, gpus
    assert {g["index"]: g["holder_count"] for g in gpus}[0] >= 3
    # A compute process NVML lists makes it in-use, whatever else holds it.
    worker = cuda(host, 0)
    _, gpus, _ = cli_json(host, "gpus")
    assert {g["index"]: g["state"] for g in gpus}[0] == "in-use"
    worker.stop()


def test_idle_h200_reads_idle_and_verifies_freed(gpu_host: GpuHost) -> None:
    """nvmlDeviceGetMemoryInfo_v2 leaves the driver's ~700 MiB out of "used"; v1 would read
    701 MiB on an idle H200 and fail every verification (ReleasedBelowMiB=64 here)."""
    host = gpu_host
    for gpu in host.state.gpus:
        gpu.name, gpu.memory_total = "NVIDIA H200", 143771 * MiB
        gpu.base_used, gpu.reserved = 1 * MiB, 700 * MiB
    host.publish()
    proc = cuda(host, 0, 40 * GiB)
    _, gpus, _ = cli_json(host, "gpus")
    assert [(g["state"], g["memory_used"]) for g in gpus] == [("in-use", 40 * GiB + MiB),
                                                              ("idle", MiB)]
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0")
    assert code == 0, stderr
    assert report["outcome"] == "freed" and report["gpus"][0]["memory_used_after"] == MiB
    assert not proc.alive()


def test_process_in_compute_and_graphics_lists_is_counted_once(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = cuda(host, 0, 3 * GiB)
    host.state.add_proc(0, proc.pid, 3 * GiB, kind="graphics")
    host.publish()
    _, holders, _ = cli_json(host, "holders")
    assert {h["pid"]: h["gpu_memory"] for h in holders}[proc.pid] == 3 * GiB
    # The driver counts it once too (the fake once summed the two lists).
    _, gpus, _ = cli_json(host, "gpus")
    assert [(g["state"], g["memory_used"]) for g in gpus] == [("in-use", 3 * GiB), ("idle", 0)]
    code, report, stderr = cli_json(host, "sweep", "--gpu", "0")
    assert code == 0, stderr
    assert report["outcome"] == "freed", report
    assert [(g["memory_used_before"], g["memory_used_after"]) for g in report["gpus"]] == [
        (3 * GiB, 0)]



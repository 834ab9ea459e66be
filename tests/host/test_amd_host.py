"""AMD GPUs end to end through `gpuguardctl --local`: a fake KFD/DRM sysfs tree (tests/amd_sysfs.py)
beside the fake NVML, holders as real processes on mknod'd /dev/kfd and render nodes.

The render nodes' minors are the GPUs' `drm_render_minor`s, drawn at random per test (like the
NVIDIA nodes' in tests/conftest.py) so that no other test run's holder has the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd.cli.exits import EXIT_NOT_FREE, EXIT_OK, EXIT_USAGE
from tests.amd_sysfs import AmdHost, make_amd_host
from tests.conftest import GiB, GpuHost
from tests.helpers import alive, gone, wait_until


@pytest.fixture
def mixed(gpu_host: GpuHost, tmp_path: Path) -> Iterator[AmdHost]:
    """Two fake H100s (NVML indices 0, 1) and two fake MI300X (2, 3)."""
    amd = make_amd_host(gpu_host, tmp_path, nvidia=True)
    yield amd
    amd.close()


@pytest.fixture
def amd_only(gpu_host: GpuHost, tmp_path: Path) -> Iterator[AmdHost]:
    """A host with AMD GPUs and no NVML at all (no libnvidia-ml, no NVIDIA node)."""
    amd = make_amd_host(gpu_host, tmp_path, nvidia=False)
    yield amd
    amd.close()


def test_both_vendors_are_listed_nvidia_first(mixed: AmdHost) -> None:
    code, gpus = mixed.cli_json("gpus")
    assert code == EXIT_OK
    assert isinstance(gpus, list)
    assert [(g["index"], g["vendor"]) for g in gpus] == [(0, "nvidia"), (1, "nvidia"), (2, "amd"), (3, "amd")]
    amd = gpus[2]
    assert amd["pci_bus_id"] == "0000:c3:00.0"
    assert amd["device_path"] == f"/dev/dri/renderD{mixed.gpus[0].render_minor}"
    assert amd["name"].startswith("AMD"), amd
    assert amd["uuid"].startswith("GPU-") and amd["uuid"] != gpus[3]["uuid"]
    # 300 MiB used by the driver itself: idle, not a leak.
    assert [g["state"] for g in gpus[2:]] == ["idle", "idle"], gpus


def test_a_rocm_holder_is_placed_by_kfd_and_checked_by_pci_bus_id(mixed: AmdHost) -> None:
    pid = mixed.holder(mixed.gpus[0], 8 * GiB)
    code, holders = mixed.cli_json("holders")
    assert code == EXIT_OK and isinstance(holders, list)
    [mine] = [h for h in holders if h["pid"] == pid]
    assert (mine["gpus"], mine["gpus_from"], mine["kind"]) == ([2], "kfd", "compute"), mine
    assert "kfd" in mine["how"] and "fd" in mine["how"]
    assert mixed.cli("check", "--gpu", "2").returncode == EXIT_NOT_FREE
    # The other MI300X is free: by index, and by PCI bus id in NVML's spelling and any case.
    for selector in ("3", "00000000:C4:00.0", "0000:c4:00.0"):
        done = mixed.cli("check", "--gpu", selector)
        assert (done.returncode, done.stdout) == (EXIT_OK, ""), (selector, done.stdout, done.stderr)


def test_a_kfd_holder_of_no_known_gpu_counts_on_every_amd_gpu_only(mixed: AmdHost) -> None:
    pid = mixed.holder(None)
    _, holders = mixed.cli_json("holders")
    [mine] = [h for h in holders if h["pid"] == pid]
    assert mine["gpus"] == [2, 3] and mine["kind"] == "compute", mine
    assert mixed.cli("check", "--gpu", "3").returncode == EXIT_NOT_FREE
    assert mixed.cli("check", "--gpu", "0").returncode == EXIT_OK
    # A sweep of one AMD GPU leaves it alone: it may be the other's tenant.
    done = mixed.cli("sweep", "--gpu", "3")
    assert alive(pid), done.stdout + done.stderr


def test_a_sweep_of_one_vendors_gpu_never_touches_the_others(mixed: AmdHost) -> None:
    host = mixed.host
    nvidia = host.spawn("--comm", "cuda-worker", "--hold", host.node("nvidia0"), "--hold",
                        host.node("nvidia-uvm"), nvml=(0, 4 * GiB)).pid
    on_c3 = mixed.holder(mixed.gpus[0], 8 * GiB, comm="rocm-c3")
    on_c4 = mixed.holder(mixed.gpus[1], 8 * GiB, comm="rocm-c4")
    # KFD frees the memory in a worker after the exit, and its proc entry outlives the PID.
    mixed.release_after_exit(on_c3, memory_after=1.0, entry_after=1.5)
    code, report = mixed.cli_json("sweep", "--gpu", "0000:c3:00.0", "--grace", "2s")
    assert isinstance(report, dict)
    assert (code, report["outcome"]) == (EXIT_OK, "freed"), report
    assert [t["pid"] for t in report["terminated"]] == [on_c3]
    assert gone(on_c3) and alive(on_c4) and alive(nvidia)
    # "freed" only once KFD let go: the entry went 1.5 s after the holder exited.
    assert report["duration_ms"] >= 1000, report
    [gpu] = report["gpus"]
    assert gpu["index"] == 2 and gpu["released"] and gpu["memory_used_after"] < 1 << 30, gpu
    # And the NVIDIA sweep leaves both MI300X tenants alone.
    code, report = mixed.cli_json("sweep", "--gpu", "0")
    assert [t["pid"] for t in report["terminated"]] == [nvidia], report
    assert alive(on_c4)


def test_memory_kfd_never_lets_go_is_reported_not_released(mixed: AmdHost) -> None:
    pid = mixed.holder(mixed.gpus[1], 8 * GiB)
    _, report = mixed.cli_json("sweep", "--gpu", "3", "--grace", "1s")
    assert isinstance(report, dict)
    assert report["outcome"] == "memory-not-released", report
    assert gone(pid)


def test_leaks_on_amd_gpus(mixed: AmdHost) -> None:
    mixed.sysfs.set_used(mixed.gpus[1], 40 * GiB)
    _, gpus = mixed.cli_json("gpus")
    assert [(g["state"], g.get("leak_kind", "")) for g in gpus[2:]] == [
        ("idle", ""), ("leaked", "no-process")], gpus
    # KFD lists VRAM only for a PID that does not exist.
    mixed.sysfs.add_proc_entry(str(2**22 - 3), {"vram_52345": f"{40 * GiB}\n", "pasid": "1\n"})
    _, gpus = mixed.cli_json("gpus")
    assert gpus[3]["leak_kind"] == "dead-pids", gpus
    assert mixed.cli("check", "--gpu", "3").returncode == EXIT_NOT_FREE


def test_a_suspended_gpu_is_not_woken(mixed: AmdHost) -> None:
    mixed.sysfs.suspend(mixed.gpus[1])  # its mem_info files turn into traps
    _, gpus = mixed.cli_json("gpus")
    assert (gpus[3]["state"], gpus[3]["error"]) == ("suspended", ""), gpus
    assert gpus[2]["state"] == "idle"


def test_bad_sysfs_makes_one_gpu_unknown(mixed: AmdHost) -> None:
    mixed.sysfs.break_file(mixed.gpus[0].device_dir / "mem_info_vram_used", "\u0663\n")
    code, gpus = mixed.cli_json("gpus")
    assert code == EXIT_OK
    bad = gpus[2]
    assert bad["state"] == "unknown" and "mem_info_vram_used" in bad["error"], bad
    assert gpus[3]["state"] == "idle"
    assert mixed.cli("check", "--gpu", "2").returncode == EXIT_NOT_FREE


def test_an_amd_host_without_nvml_runs_every_command(amd_only: AmdHost) -> None:
    env = amd_only.no_nvml_env()
    code, gpus = amd_only.cli_json("gpus", env=env)
    assert [(g["index"], g["vendor"], g["state"]) for g in gpus] == [
        (0, "amd", "idle"), (1, "amd", "idle")], gpus
    code, status = amd_only.cli_json("status", env=env)
    assert code == EXIT_OK and status["gpu_count"] == 2 and status["nvml_available"] is False
    assert amd_only.cli("check", env=env).returncode == EXIT_OK
    done = amd_only.cli("wait", "--gpu", "1", "--timeout", "5s", "--stable", "0s", env=env)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    pid = amd_only.holder(amd_only.gpus[1], 8 * GiB)
    code, holders = amd_only.cli_json("holders", "--gpu", "1", env=env)
    assert [(h["pid"], h["gpus"]) for h in holders] == [(pid, [1])], holders
    assert amd_only.cli("check", "--gpu", "1", env=env).returncode == EXIT_NOT_FREE
    amd_only.release_after_exit(pid, memory_after=0.5, entry_after=0.8)
    code, report = amd_only.cli_json("sweep", "--gpu", "1", env=env)
    assert (code, report["outcome"]) == (EXIT_OK, "freed"), report
    wait_until(lambda: gone(pid), 5, "the holder gone")
    done = amd_only.cli("hook", "list", env=env)
    assert done.returncode == EXIT_OK, done.stderr


def test_reset_names_its_gpu_by_pci_bus_id(mixed: AmdHost) -> None:
    pid = mixed.holder(None)  # any ROCm process: AMD's reset would end it, whichever GPU it uses
    _, report = mixed.cli_json("reset", "--gpu", "0000:C4:00.0")
    assert report["outcome"] == "reset-refused" and f"pid {pid} " in report["error"], report
    assert report["scope"]["gpus"] == [3], report
    assert alive(pid)
    done = mixed.cli("reset", "--gpu", "0000:c9:00.0")
    assert done.returncode == EXIT_USAGE and "unknown PCI bus id '0000:c9:00.0'" in done.stderr, done.stderr

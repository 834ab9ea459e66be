"""`gpuguardctl wait --local`: the start gate's rule on the local engine's scans,
for root when no gpuguardd runs; the same verdicts as the daemon's."""

from __future__ import annotations

from tests.conftest import GiB, GpuHost


def test_local_wait_passes_a_free_gpu_and_times_out_on_a_held_one(gpu_host: GpuHost) -> None:
    holder = gpu_host.spawn("--hold", gpu_host.node("nvidia1"), nvml=(1, 2 * GiB))
    free = gpu_host.cli("wait", "--gpu", "0", "--stable", "0.3", "--timeout", "10")
    assert free.returncode == 0, free.stdout + free.stderr
    assert free.stdout.startswith("gpuguard: free after ") and "GPU 0" in free.stdout
    held = gpu_host.cli("wait", "--gpu", "1", "--stable", "0.3", "--timeout", "1")
    assert held.returncode == 8, held.stdout + held.stderr
    assert f"compute holder pid {holder.pid}" in held.stdout


def test_local_wait_fails_closed_without_nvml(gpu_host: GpuHost) -> None:
    gpu_host.state.init_error = 9
    gpu_host.publish()
    closed = gpu_host.cli("wait", "--stable", "0", "--timeout", "1")
    assert closed.returncode == 8, closed.stdout + closed.stderr
    assert "NVML unavailable" in closed.stdout
    allowed = gpu_host.cli("wait", "--stable", "0", "--timeout", "2", "--allow-unverified")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


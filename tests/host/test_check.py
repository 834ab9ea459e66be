"""`gpuguardctl check`: the read-only "is this GPU free for the next job?" of schedulers and
pre-start hooks, against real holder processes and the fake NVML (through --local; the
daemon's path is covered in tests/bus/test_service.py's D-Bus backend, which returns the same dicts).
"""

from __future__ import annotations

import json

from gpuguardd.cli.exits import EXIT_NOT_FREE, EXIT_OK, EXIT_USAGE
from tests.conftest import GiB, GpuHost


def test_free_gpus_pass_and_a_compute_holder_fails_only_its_gpu(gpu_host: GpuHost) -> None:
    host = gpu_host
    done = host.cli("check")
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    assert done.stdout == ""
    worker = host.spawn("--comm", "vllm-worker", "--hold", host.node("nvidia0"),
                        "--hold", host.node("nvidia-uvm"), nvml=(0, 3 * GiB))
    done = host.cli("check")
    assert done.returncode == EXIT_NOT_FREE, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"GPU 0: compute holder pid {worker.pid} (vllm-worker)"), lines
    # GPU 1 is free: by index and by UUID.
    for selector in ("1", host.state.gpus[1].uuid):
        done = host.cli("check", "--gpu", selector)
        assert (done.returncode, done.stdout) == (EXIT_OK, ""), (selector, done.stdout, done.stderr)
    done = host.cli("check", "--gpu", host.state.gpus[0].uuid, "--json")
    assert done.returncode == EXIT_NOT_FREE
    data = json.loads(done.stdout)
    assert data["ok"] is False
    assert [(p["gpu"], p["kind"], p["pid"]) for p in data["problems"]] == [(0, "holder", worker.pid)]
    assert [g["index"] for g in data["gpus"]] == [0]
    # Read-only: the holder is still there.
    assert worker.alive()


def test_management_clients_do_not_make_a_gpu_busy(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.spawn("--comm", "nvidia-smi", "--hold", host.node("nvidiactl"), "--hold", host.node("nvidia0"))
    done = host.cli("check", "--gpu", "0")
    assert (done.returncode, done.stdout) == (EXIT_OK, ""), done.stdout + done.stderr


def test_leaked_memory_and_lost_gpus_are_problems(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[1].base_used = 6 * GiB
    host.publish()
    done = host.cli("check")
    assert done.returncode == EXIT_NOT_FREE
    assert done.stdout.splitlines() == [
        f"GPU 1 ({host.state.gpus[1].uuid}, nvidia {host.state.gpus[1].name}): leaked, 6.0 GiB memory in use with "
        "no process holding it (no-process)"]
    assert host.cli("check", "--gpu", "0").returncode == EXIT_OK
    host.state.gpus[0].lost = True
    host.publish()
    done = host.cli("check", "--gpu", "0", "--json")
    assert done.returncode == EXIT_NOT_FREE
    assert [p["kind"] for p in json.loads(done.stdout)["problems"]] == ["lost"]


def test_without_nvml_nothing_can_be_called_free(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    host.publish()
    done = host.cli("check")
    assert done.returncode == EXIT_NOT_FREE
    assert "NVML unavailable" in done.stdout and "cannot be checked" in done.stdout


def test_an_unknown_gpu_is_a_usage_error(gpu_host: GpuHost) -> None:
    done = gpu_host.cli("check", "--gpu", "7")
    assert done.returncode == EXIT_USAGE
    assert "7" in done.stderr



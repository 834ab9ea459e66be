"""`gpuguardctl sweep --slurm-epilog --reset-leaked`: when leaked memory alone would drain the
node, the epilog resets the GPU (through the fake nvidia-smi on PATH and the fake NVML) and
drains only if that fails; `gpuguardctl reset --local` is the same reset without a daemon."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests.conftest import GiB, GpuHost

FAKE_SMI_DIR = Path(__file__).resolve().parents[1] / "fakenvml"


def epilog(host: GpuHost, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**host.env, "SLURM_JOB_ID": str(random.randrange(10_000, 10_000_000)),
           "SLURM_JOB_UID": "65534", "SLURM_JOB_GPUS": "0",
           "PATH": f"{FAKE_SMI_DIR}:{os.environ['PATH']}",
           "FAKE_NVIDIA_SMI_LOG": str(host.root / "smi.log")}
    return subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "sweep", "--slurm-epilog",
                           "--local", "--config", str(host.config_path), *extra],
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_leak_alone_is_reset_instead_of_draining(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[0].base_used = 3 * GiB
    host.state.gpus[0].persistence = True
    host.publish()
    drained = epilog(host)
    assert drained.returncode == 4 and "memory-not-released" in drained.stdout, drained.stderr
    assert not (host.root / "smi.log").exists(), "no reset without --reset-leaked"

    done = epilog(host, "--reset-leaked")
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr
    calls = [json.loads(line) for line in (host.root / "smi.log").read_text().splitlines()]
    assert calls == [["-r", "-i", host.state.gpus[0].pci_bus_id]]
    assert "Outcome: reset" in done.stderr and "restored persistence mode" in done.stderr


def test_a_refused_reset_still_drains(gpu_host: GpuHost) -> None:
    host = gpu_host
    host.state.gpus[0].base_used = 3 * GiB
    host.state.gpus[0].nvlink = 2  # the driver resets NVLink peers only together
    host.publish()
    done = epilog(host, "--reset-leaked")
    assert done.returncode == 4 and "memory-not-released" in done.stdout, done.stderr
    assert "NVLink link(s) 0,1 are active" in done.stderr
    assert not (host.root / "smi.log").exists()

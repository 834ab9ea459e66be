"""The same checks against a real NVIDIA GPU and a real CUDA process.

Runs only where an NVIDIA driver is loaded (a lent GPU machine); skipped elsewhere, CI included,
because CI machines have no GPU. Needs root and a CUDA-capable Python (torch or cupy) or
`nvidia-smi`-style load via the driver's own libcuda through ctypes.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not Path("/proc/driver/nvidia/version").exists(), reason="no NVIDIA driver on this machine")

# A CUDA process that allocates 1 GiB through the driver API (libcuda ships with the driver,
# so no toolkit or framework is needed), prints "ready" and sleeps.
CUDA_HOLDER = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev = ctypes.c_int(); assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p(); assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
ptr = ctypes.c_uint64(); assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)) == 0
print("ready", flush=True)
time.sleep(3600)
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuguardd.cli", *args, "--local"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_real_cuda_process_is_found_swept_and_memory_verified() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("libcuda.so.1 not present")
    proc = subprocess.Popen([sys.executable, "-c", CUDA_HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        holders = json.loads(cli("holders", "--json").stdout)
        mine = [h for h in holders if h["pid"] == proc.pid]
        assert mine, holders
        assert mine[0]["kind"] == "compute"
        assert "fd" in mine[0]["how"] and "nvml" in mine[0]["how"]
        assert mine[0]["gpu_memory"] >= 1 << 30
        assert mine[0]["gpus"] == [0]
        before = json.loads(cli("gpus", "--json").stdout)[0]["memory_used"]
        result = cli("sweep", "--json", "--gpu", "0", "--grace", "5")
        report = json.loads(result.stdout)
        print(json.dumps(report, indent=2))
        assert [t["pid"] for t in report["terminated"]] == [proc.pid]
        assert report["outcome"] == "freed", report
        assert result.returncode == 0
        assert report["gpus"][0]["memory_used_before"] >= 1 << 30
        assert report["gpus"][0]["memory_used_after"] < before - (1 << 29)
    finally:
        proc.kill()
        proc.wait()

"""bench/bench_gate.py runs and prints its figures and verdicts, at a tiny size, so it cannot
rot (tests/host/test_bench_smoke.py does the same for the others; speed is never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gate_smoke() -> None:
    if os.geteuid() != 0:
        pytest.skip("the benchmarks need root (mknod, signalling); CI runs as root")
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)  # the benchmark sets up the fake NVML itself
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gate.py"), "--rounds", "1",
                           "--waiters", "2", "--cpu-sec", "1", "--stable", "0.2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exited {proc.returncode}\n{out}\n{proc.stderr}"
    assert "gate latency (memory back on the fake NVML's clock -> Wait reply" in out, out
    assert "gpuguardctl wait to its exit, 1 rounds" in out, out
    assert "gpuguardd CPU with 2 waiters: " in out, out
    assert "the same daemon with nobody waiting: " in out and "the waiters' cost: " in out, out
    assert "target gate latency at most 50 ms: " in out, out
    assert "target 2 waiters cost the daemon under 1 % of a core: " in out, out

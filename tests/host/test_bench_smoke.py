"""The benchmarks run, agree with their peers, and print their verdicts: at a tiny size, so they
cannot rot. Speed itself is never asserted here; bench/ measures it (bench/README.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _require(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the benchmarks need root (mknod, signalling); CI runs as root")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip("missing " + " ".join(missing) + " (make deps installs them)")


def _run(script: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)  # bench_sweep sets up the fake NVML itself
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_bench_scan_smoke() -> None:
    _require("fuser", "lsof")
    out = _run("bench_scan.py", "--procs", "20", "--files", "5", "--holders", "5", "--repeat", "1")
    assert "same holders: 5 pids in every run" in out, out
    assert "ratio gpuguard/fuser: " in out, out
    assert "ratio gpuguard/lsof: " in out, out
    for tool in ("gpuguard find_holders", "gpuguard Engine.scan()", "gpuguardctl holders --local",
                 "fuser -v", "lsof -w -n -P", "floor: the bare pass"):
        assert tool in out, out
    assert "target gpuguardctl holders --local (whole process) no slower than fuser -v: " in out, out
    assert "target the daemon's scan in half fuser's time: " in out, out
    assert "the floor here, the bare pass: " in out, out


def test_bench_scan_light_smoke() -> None:
    """The big-host population (--light) at a tiny size: its plain processes exec sleep."""
    _require("fuser", "lsof")
    out = _run("bench_scan.py", "--procs", "30", "--fds", "5", "--holders", "5", "--repeat", "1", "--light")
    assert "the plain ones exec sleep infinity" in out, out
    assert "same holders: 5 pids in every run" in out, out


def test_bench_scan_amd_smoke() -> None:
    """The two-AMD-GPU host: the same population on /dev/kfd and render nodes, a fake sysfs."""
    _require("fuser", "lsof")
    out = _run("bench_scan.py", "--procs", "20", "--files", "5", "--holders", "5", "--repeat", "1", "--amd")
    assert "same holders: 5 pids in every run" in out, out
    assert "holders of a render node placed on its AMD GPU" in out, out
    assert "target (2 AMD GPUs) the scan within 1.0x of fuser over the same nodes: " in out, out


def test_bench_sweep_smoke() -> None:
    _require("fuser", "pkill")
    out = _run("bench_sweep.py", "--holders", "5", "--files", "5", "--repeat", "1")
    assert "same holders: 5 pids in every run" in out, out
    assert "ratio gpuguard/manual: " in out and "; gpuguard/by device: " in out, out
    # The floor: the holders' fd tables read cold (each showing its three nodes), plus their exit.
    assert "evidence: the holders' fd tables, read cold" in out, out
    assert "floor of a verified sweep (evidence + own exit): " in out, out
    # The skeleton signalled exactly the population's holders (or the run fails) and is compared.
    assert "skeleton: scan, safety checks, SIGTERM, NVML" in out, out
    assert "skeleton signalled = gpuguard terminated" in out, out
    assert "; skeleton/manual: " in out and "; gpuguard over the skeleton: " in out, out
    assert "overhead gpuguard over the processes' own exit: " in out, out
    assert "budget (bench/README.md), no slower than the manual pipeline: " in out, out
    # With gcc the fake NVML is built and the sweep's verification is real; without, it can't be.
    expected = "gpuguard outcome freed" if shutil.which("gcc") else "gpuguard outcome unverified"
    assert expected in out, out


def test_bench_dbus_smoke() -> None:
    _require("dbus-daemon", "gcc", "setpriv")
    out = _run("bench_dbus.py", "--seconds", "1", "--rounds", "1", "--idle-sec", "2", "--starts", "1",
               "--history", "3", "--holders", "2", "--clients", "4", "--client-procs", "2",
               "--rate", "20")
    assert "reply sizes on the wire: ListHolders " in out, out
    for method in ("ListHolders", "GetHistory(10)"):
        assert f"ratio gpuguardd/peer ({method}): " in out, out
    assert "calls that failed" not in out, out
    assert "startup to READY=1: median " in out, out
    # The idle row's peer ran beside gpuguardd over the same window.
    assert "a bare NVML poller (pynvml, every 2 s): " in out and " RSS " in out, out


def test_bench_startup_smoke() -> None:
    _require("dbus-daemon", "gcc", "setpriv")
    out = _run("bench_startup.py", "--repeat", "1", "--peer", str(ROOT))
    for command in ("python -c pass", "gpuguardctl --version (now)", "gpuguardctl status (now)",
                    "gpuguardctl holders --local (peer)", "ratio now/peer, gpuguardctl status: "):
        assert command in out, out

"""The engine without the pynvml module at all: it degrades, it does not crash."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import GpuHost


def test_missing_pynvml_module_degrades_to_device_files(gpu_host: GpuHost) -> None:
    host = gpu_host
    proc = host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"))
    # Simulate a system without nvidia-ml-py: a pynvml that cannot be imported shadows it.
    shadow = host.root / "shadow"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise ImportError('pynvml is not installed here')\n")
    env = dict(host.env, PYTHONPATH=f"{shadow}:{host.env['PYTHONPATH']}")
    run = [sys.executable, "-m", "gpuguardd.cli.main", "--local", "--config", str(host.config_path)]
    status = json.loads(subprocess.run([*run, "status", "--json"], env=env, capture_output=True,
                                       text=True, check=True).stdout)
    assert status["nvml_available"] is False
    assert "nvidia-ml-py" in status["nvml_error"]
    result = subprocess.run([*run, "sweep", "--json"], env=env, capture_output=True, text=True, check=False)
    report = json.loads(result.stdout)
    assert [t["pid"] for t in report["terminated"]] == [proc.pid]
    assert report["outcome"] == "unverified" and result.returncode == 6

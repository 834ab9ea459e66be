"""The GPU reset (engine/reset.py) on a real GPU: never part of `make test`, skipped without one.

By default it only checks what touches nothing: a reset of the test GPU is refused, naming the
holder, while a process of the test's own holds the GPU through NVML (a management client,
as nvidia-smi or an exporter would), and the refusal left persistence mode as it was. The reset
itself runs only with GPUGUARD_TEST_RESET=1, on a GPU the operator can spare (it ends whatever
the GPU still runs that gpuguard cannot see): it must then be done and verified, or refused or
failed with the driver's word in the report, and persistence mode must be as before either way.

Environment: GPUGUARD_TEST_GPU (NVML index, default 0), GPUGUARD_TEST_RESET (1: really reset).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if not Path("/proc/driver/nvidia/version").exists():
    pytest.skip("no NVIDIA driver on this machine (/proc/driver/nvidia/version)",
                allow_module_level=True)
try:
    import pynvml
    pynvml.nvmlInit()
    _COUNT = pynvml.nvmlDeviceGetCount()
    # Not kept open: this process's handles would keep the GPU busy for a real reset.
    pynvml.nvmlShutdown()
except Exception as _exc:  # no module, no library, or a driver NVML cannot talk to
    pytest.skip(f"NVML unusable here: {_exc}", allow_module_level=True)
if _COUNT == 0:
    pytest.skip("NVML lists no GPU", allow_module_level=True)

# After the skips: nothing to import for without a GPU.
from gpuguardd.config import Config
from gpuguardd.engine.engine import Engine
from gpuguardd.records.enums import Outcome

INDEX = int(os.environ.get("GPUGUARD_TEST_GPU", "0"))
HOLD = ("import pynvml, sys, time; pynvml.nvmlInit(); pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1])); "
        "print('ready', flush=True); time.sleep(600)")


def persistence() -> int:
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetPersistenceMode(pynvml.nvmlDeviceGetHandleByIndex(INDEX)))
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def engine() -> Iterator[Engine]:
    with tempfile.TemporaryDirectory(prefix="gg-reset-") as runtime:
        engine = Engine(Config(runtime_directory=runtime, verify_timeout_sec=60))
        try:
            yield engine
        finally:
            engine.nvml.shutdown()


def test_a_reset_is_refused_while_a_client_holds_the_gpu(engine: Engine) -> None:
    before = persistence()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(INDEX)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        report = engine.reset_gpu(INDEX, "tests/gpu", "refusal check")
    finally:
        holder.kill()
        holder.wait()
    print(f"\nrefused: {report.error}")
    assert report.kind == "reset" and report.outcome == Outcome.RESET_REFUSED
    assert f"pid {holder.pid}" in report.error or "NVLink" in report.error, report.error
    assert not any(step.startswith("running ") for step in report.steps), "nothing was run"
    assert persistence() == before


@pytest.mark.skipif(os.environ.get("GPUGUARD_TEST_RESET") != "1",
                    reason="resets the GPU: set GPUGUARD_TEST_RESET=1 on a GPU you can spare")
def test_a_real_reset_is_verified_or_says_why(engine: Engine) -> None:
    before = persistence()
    report = engine.reset_gpu(INDEX, "tests/gpu", "real reset check")
    print("\n" + "\n".join(report.steps))
    assert report.kind == "reset"
    if report.outcome == Outcome.RESET:
        assert report.verified and report.gpus[0].released
    else:
        assert report.error, "a refusal or failure says why"
    assert persistence() == before, "persistence mode is as it was"

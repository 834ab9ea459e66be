"""The start gate's client side: `hook install --start` writes its own drop-in next
to the stop hook's, and `gpuguardctl wait` takes its GPUs from CUDA_VISIBLE_DEVICES as CUDA
does, refusing what names no GPU."""

from __future__ import annotations

import argparse

import pytest

from gpuguardd.cli.main import build_parser
from gpuguardd.cli.wait import selectors_from, visible_devices
from gpuguardd.errors import InvalidArgument


def wait_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["wait", *argv])


@pytest.mark.parametrize(("value", "wanted"), [
    ("0,1", ["0", "1"]),
    (" 2 ", ["2"]),
    ("GPU-4e1f0000-0000-4000-8000-000000000000", ["GPU-4e1f0000-0000-4000-8000-000000000000"]),
    ("1,-1,0", ["1"]),  # CUDA stops at the first negative ordinal
    ("-1", []),
    ("", []),
    ("none", []),
    ("void", []),
    ("NoDevFiles", []),
    ("all", None),
])
def test_visible_devices_as_cuda_reads_them(value: str, wanted: list[str] | None) -> None:
    assert visible_devices(value, "CUDA_VISIBLE_DEVICES") == wanted


@pytest.mark.parametrize("value", ["0,x", "\u0661", "99999999999", "0,,1"])
def test_visible_devices_refuse_what_names_no_gpu(value: str) -> None:
    with pytest.raises(InvalidArgument, match="CUDA_VISIBLE_DEVICES"):
        visible_devices(value, "CUDA_VISIBLE_DEVICES")


def test_selection_order_gpu_then_option_then_environment() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "0"}
    assert selectors_from(wait_args("--gpu", "0"), env) == ["0"]
    assert selectors_from(wait_args("--cuda-visible-devices", "0,1"), env) == ["0", "1"]
    assert selectors_from(wait_args(), env) == ["1"]
    assert selectors_from(wait_args(), {"NVIDIA_VISIBLE_DEVICES": "0"}) == ["0"]
    assert selectors_from(wait_args(), {}) is None  # every GPU


def test_bad_numbers_on_the_command_line_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--free-below", "0"], ["--free-below", "\u0661"], ["--stable", "2h"],
                 ["--timeout", "forever"]):
        with pytest.raises(SystemExit) as exit_:
            wait_args(*argv)
        assert exit_.value.code == 2
        assert "Traceback" not in capsys.readouterr().err



def test_local_waits_say_each_warning_once_and_leave_no_filter_behind() -> None:
    """Every --local poll scans again and meets the same oddities: gpuguardctl's own handler
    says each once; a handler it did not set up (the caller's) is left as it was."""
    import logging
    from types import SimpleNamespace

    from gpuguardd.cli.wait import local_call
    from gpuguardd.config import Config
    from gpuguardd.records.models import NvmlSnapshot, ScanResult

    said: list[str] = []
    ours = logging.Handler()
    ours.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("gpuguard")
    logger.addHandler(ours)
    scans = 0

    def scan() -> ScanResult:
        nonlocal scans
        scans += 1
        logging.getLogger("gpuguard.engine").warning("an odd device node")
        return ScanResult(holders=[], nvml=NvmlSnapshot(available=False, error="no NVML"))
    try:
        engine = SimpleNamespace(scan=scan, config=Config())
        local_call(SimpleNamespace(engine=engine), ["0"], 256 << 20, 0.0, False, 0)(0.6)
    finally:
        logger.removeHandler(ours)
    assert scans >= 2 and said == ["an odd device node"], (scans, said)
    assert not any(h.filters for h in logging.getLogger().handlers) and not logger.filters

"""The start gate's client side: `hook install --start` writes its own drop-in next
to the stop hook's, and `gpuguardctl wait` takes its GPUs from CUDA_VISIBLE_DEVICES as CUDA
does, refusing what names no GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpuguardd.cli.main import build_parser
from gpuguardd.cli.main import run as ctl
from gpuguardd.cli.wait import selectors_from, visible_devices
from gpuguardd.errors import InvalidArgument


def test_start_dropin_is_its_own_file_next_to_the_stop_hook(tmp_path: Path) -> None:
    assert ctl(["hook", "install", "sglang-", "--root", str(tmp_path)]) == 0
    assert ctl(["hook", "install", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    directory = tmp_path / "etc/systemd/system/sglang-.service.d"
    stop, start = directory / "gpuguard.conf", directory / "gpuguard-start.conf"
    text = start.read_text()
    assert "ExecStopPost" not in text
    exec_lines = [line for line in text.splitlines() if line.startswith("Exec")]
    assert len(exec_lines) == 1
    assert exec_lines[0].startswith("ExecStartPre=+") and exec_lines[0].endswith(
        " wait --timeout 60s $GPUGUARD_WAIT_OPTIONS")
    assert "TimeoutStartSec" in text  # the guidance is in the file the admin reads
    # Removing the gate leaves the stop hook, and the other way round.
    assert ctl(["hook", "remove", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    assert not start.exists() and "ExecStopPost" in stop.read_text()
    assert ctl(["hook", "install", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    assert ctl(["hook", "remove", "sglang-", "--root", str(tmp_path)]) == 0
    assert start.exists() and not stop.exists()


def test_start_dropin_refuses_to_overwrite_an_admins_file(tmp_path: Path) -> None:
    directory = tmp_path / "etc/systemd/system/vllm-qwen.service.d"
    directory.mkdir(parents=True)
    (directory / "gpuguard-start.conf").write_text("[Service]\nExecStartPre=/bin/true\n")
    assert ctl(["hook", "install", "--start", "vllm-qwen", "--root", str(tmp_path)]) == 1
    assert (directory / "gpuguard-start.conf").read_text().endswith("/bin/true\n")


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


def wait_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["wait", *argv])


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

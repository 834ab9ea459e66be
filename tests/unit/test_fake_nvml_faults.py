"""The fake NVML's driver faults, driven through the real pynvml:
calls that hang holding the library's lock, per-GPU handle-lookup errors, and memory that
stays held after the process has left NVML's lists."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.fakenvml import GIB, FakeNvmlState
from tests.unit.test_fake_nvml import (  # noqa: F401  (fixtures are used by name)
    Spawn,
    StartSession,
    kill_and_reap,
    spawn,
    start,
    state_path,
)


def two_gpus() -> FakeNvmlState:
    state = FakeNvmlState()
    state.add_gpu(uuid="GPU-zero")
    state.add_gpu(uuid="GPU-one")
    return state


def timed(session: object, expr: str) -> tuple[object, float]:
    started = time.monotonic()
    result = session.call(expr)  # type: ignore[attr-defined]
    return result, time.monotonic() - started


def test_a_hang_blocks_only_the_named_function_on_the_named_gpu(
        start: StartSession, state_path: Path) -> None:  # noqa: F811
    state = two_gpus()
    state.hang = [("nvmlDeviceGetMemoryInfo_v2", 700, 1)]
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    _, fast = timed(nvml, "mem2(0)")
    _, v1 = timed(nvml, "mem(1)")
    used, slow = timed(nvml, "mem2(1)")
    assert fast < 0.3 and v1 < 0.3
    assert slow >= 0.7
    assert used == {"total": 80 * GIB, "reserved": 0, "free": 80 * GIB, "used": 0}


def test_a_hung_call_holds_the_library_lock_like_a_stuck_ioctl(
        start: StartSession, state_path: Path) -> None:  # noqa: F811
    state = two_gpus()
    state.hang = [("nvmlDeviceGetMemoryInfo_v2", 1000, None)]
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    # A thread enters the hung call; 0.2 s later an unrelated call must wait for it.
    waited = nvml.call(
        "(lambda t: (t.start(), time.sleep(0.2), "
        "(lambda s: (N.nvmlDeviceGetCount(), time.monotonic() - s)[1])(time.monotonic()), "
        "t.join())[2])(threading.Thread(target=mem2, args=(0,)))")
    assert waited >= 0.6
    state.hang = []
    state.write(state_path)
    _, after = timed(nvml, "mem2(0)")
    assert after < 0.3


def test_init_can_hang_too(start: StartSession, state_path: Path) -> None:  # noqa: F811
    state = two_gpus()
    state.hang = [("nvmlInitWithFlags", 500, None)]
    state.write(state_path)
    nvml = start()
    _, took = timed(nvml, "init()")
    assert took >= 0.5


@pytest.mark.parametrize(("code", "name"), [(15, "NVMLError_GpuIsLost"),
                                            (999, "NVMLError_Unknown"),
                                            (4, "NVMLError_NoPermission")])
def test_per_gpu_handle_lookup_faults(start: StartSession, state_path: Path,  # noqa: F811
                                      code: int, name: str) -> None:
    state = two_gpus()
    state.gpus[1].handle_error = code
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("count()") == 2
    err = nvml.error("h(1)")
    assert (err.name, err.code) == (name, code)
    assert nvml.call("info(0)")["uuid"] == "GPU-zero"


def test_memory_held_after_the_process_left_the_list(
        start: StartSession, state_path: Path, spawn: Spawn) -> None:  # noqa: F811
    holder = spawn()
    state = two_gpus()
    state.add_proc(0, holder.pid, 20 * GIB, release_delay_ms=1000, listed_ms=0)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("pids(0)") == [holder.pid]
    kill_and_reap(holder)
    # Gone from the list at once, its memory still held: sglang issue 31871.
    assert nvml.call("pids(0)") == []
    assert nvml.call("mem2(0)")["used"] == 20 * GIB
    time.sleep(1.2)
    assert nvml.call("mem2(0)")["used"] == 0


def test_fault_records_render_and_are_validated() -> None:
    state = two_gpus()
    state.gpus[1].handle_error = 999
    state.hang = [("nvmlDeviceGetMemoryInfo_v2", 60000, 1), ("nvmlInit_v2", 5, None)]
    state.add_proc(0, os.getpid(), GIB, listed_ms=0)
    text = state.render()
    assert "hang nvmlDeviceGetMemoryInfo_v2 60000 1\n" in text
    assert "hang nvmlInit_v2 5\n" in text
    assert " handle_error=999" in text
    assert " listed_ms=0" in text
    bads: list[list[tuple[str, int, int | None]]] = [
        [("not a function", 1, None)], [("nvmlInit", -1, None)], [("nvmlInit", 1, 64)]]
    for bad in bads:
        state.hang = bad
        with pytest.raises(ValueError):
            state.render()


def test_library_rejects_malformed_fault_records(start: StartSession, state_path: Path) -> None:  # noqa: F811
    nvml = start()
    for line, message in (("hang nvmlInit", "expected 'hang FUNCTION MS [GPU]'"),
                          ("hang nvmlInit 10 99", "expected 'hang FUNCTION MS [GPU]'"),
                          ("gpu 0 uuid=G name=X pci=0:1:0.0 total=1 handle_error=x",
                           "bad handle_error")):
        state_path.write_text(f"driver 1\n{line}\n")
        assert nvml.error("init()").name == "NVMLError_Unknown"
        assert message in nvml.stderr()

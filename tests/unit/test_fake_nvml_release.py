"""The fake NVML's unkind release: memory that comes back over time after the
process exits, memory that grows back before it settles, both inside a MIG instance too, and
the events file that says when the library found the process gone (its own clock)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tests.fakenvml import EVENTS_ENV, GIB, FakeNvmlState, env_for
from tests.unit.test_fake_nvml import (  # noqa: F401  (fixtures are used by name)
    NvmlSession,
    Spawn,
    StartSession,
    kill_and_reap,
    spawn,
    start,
    state_path,
)

MIG_A = "MIG-aaaaaaaa-0000-4000-8000-000000000001"
MIG_USED = "N.nvmlDeviceGetMemoryInfo(N.nvmlDeviceGetMigDeviceHandleByIndex(h(0), 0), version=N.nvmlMemory_v2).used"


def sample(read: Callable[[], int], seconds: float) -> list[tuple[float, int]]:
    """(seconds since the start, figure) every 20 ms for `seconds`."""
    started = time.monotonic()
    seen = []
    while (now := time.monotonic() - started) < seconds:
        seen.append((now, read()))
        time.sleep(0.02)
    return seen


def test_release_over_time_falls_gradually_after_the_delay(
        start: StartSession, state_path: Path, spawn: Spawn) -> None:  # noqa: F811
    holder = spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_proc(0, holder.pid, 20 * GIB, release_delay_ms=300, release_ms=1000)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    kill_and_reap(holder)
    seen = sample(lambda: int(nvml.call("mem2(0)")["used"]), 1.8)
    # Held whole during the delay; then strictly between full and nothing for a while, never
    # growing; nothing at the end. Not listed once the delay is over.
    assert all(used == 20 * GIB for t, used in seen if t < 0.25)
    between = [used for _, used in seen if 0 < used < 20 * GIB]
    assert len(between) >= 10, seen
    figures = [used for _, used in seen]
    assert figures == sorted(figures, reverse=True)
    assert figures[-1] == 0
    assert nvml.call("pids(0)") == []


def test_wobble_grows_back_then_settles(
        start: StartSession, state_path: Path, spawn: Spawn) -> None:  # noqa: F811
    holder = spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_proc(0, holder.pid, 8 * GIB, release_delay_ms=0, release_ms=200,
                   wobble=2 * GIB, wobble_ms=500)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    kill_and_reap(holder)
    seen = [used for _, used in sample(lambda: int(nvml.call("mem2(0)")["used"]), 1.2)]
    assert seen[-1] == 0
    # Down below the wobble on the way, then up at the wobble again, then 0: not monotonic.
    first_wobble = seen.index(2 * GIB)
    assert any(used < 2 * GIB for used in seen[:first_wobble]), seen
    assert seen[first_wobble:].count(2 * GIB) >= 10
    assert seen[seen.index(0, first_wobble):] == [0] * len(seen[seen.index(0, first_wobble):])


def test_mig_instance_memory_lingers_and_wobbles_alone(
        start: StartSession, state_path: Path, spawn: Spawn) -> None:  # noqa: F811
    holder = spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_mig(0, MIG_A, gpu_instance_id=1, slot=0, memory_total=20 * GIB)
    state.add_proc(0, holder.pid, 6 * GIB, mig=MIG_A, release_ms=300, wobble=GIB, wobble_ms=400)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call(MIG_USED) == 6 * GIB
    kill_and_reap(holder)
    seen = [used for _, used in sample(lambda: int(nvml.call(MIG_USED)), 1.0)]
    assert any(0 < used < GIB for used in seen), seen  # falling through the wobble's level
    assert GIB in seen and seen[-1] == 0
    assert nvml.call("mem2(0)")["used"] == 0  # the parent's aggregate follows


def test_events_file_records_when_the_pid_was_found_gone(
        fake_nvml_libdir: Path, state_path: Path, tmp_path: Path, spawn: Spawn) -> None:  # noqa: F811
    holder = spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_proc(0, holder.pid, GIB, release_delay_ms=100)
    state.write(state_path)
    events = tmp_path / "events"
    session = NvmlSession({**os.environ, **env_for(fake_nvml_libdir, state_path),
                           EVENTS_ENV: str(events)}, tmp_path / "child.stderr")
    try:
        session.call("init()")
        session.call("mem2(0)")
        assert not events.exists()  # alive: nothing to say
        kill_and_reap(holder)
        before = time.monotonic_ns()
        session.call("mem2(0)")
        after = time.monotonic_ns()
        session.call("mem2(0)")  # once per death, not per call
    finally:
        session.close()
    lines = events.read_text().splitlines()
    assert len(lines) == 1
    word, pid, ns = lines[0].split()
    assert (word, int(pid)) == ("dead", holder.pid)
    assert before <= int(ns) <= after


def test_state_lines_carry_the_new_fields() -> None:
    state = FakeNvmlState()
    state.add_gpu()
    state.add_proc(0, 4242, GIB, release_ms=5, wobble=7, wobble_ms=9)
    assert "proc 0 4242 1073741824 compute release_delay_ms=0 release_ms=5 wobble=7 wobble_ms=9" \
        in state.render()

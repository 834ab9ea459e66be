"""The real-GPU check: what gpuguard assumes about NVIDIA's driver, measured on a real GPU.

Run it in one go on a machine with an NVIDIA GPU, from the checkout, with no pip and no
network (it needs only pytest, psutil and nvidia-ml-py, plus the driver's libcuda.so.1):

    python3 -m pytest tests/gpu            # -s shows the progress lines as they come

It is never part of `make test` (CI has no GPU) and skips as a whole where there is none. It
prints the driver, nvidia-ml-py, kernel, persistence and MIG mode; checks that NVML reports
a child's PID as the child's; records the idle memory (v1 used, v2 used, reserved); records
the device fds and mappings of a process with a CUDA context (the primary context through
ctypes on libcuda.so.1), of one that only called cuInit and of one that only uses pynvml, and
asserts gpuguard calls the last `management`; then, after a dry run whose plan must hold only
the test's own processes, sweeps a SIGTERM-ignoring holder and a forked child that inherited
its fds, and times exit -> NVML list empty -> memory freed, without and with pinned host memory
(cuMemHostAlloc). The last test prints a summary to paste into docs/real-hosts.md; with
GPUGUARD_GPU_SUMMARY=FILE it is also written there.

Environment: GPUGUARD_TEST_GPU (NVML index, default 0), GPUGUARD_TEST_PINNED_GIB (default 8),
GPUGUARD_TEST_DEVICE_GIB (default 2). Every process it starts is its own and is killed at the
end; the sweeps are scoped to the test GPU and run only after the dry run showed that nothing
but the test's processes would be ended.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if not Path("/proc/driver/nvidia/version").exists():
    pytest.skip("no NVIDIA driver on this machine (/proc/driver/nvidia/version)",
                allow_module_level=True)
try:
    import pynvml
    pynvml.nvmlInit()
    _COUNT = pynvml.nvmlDeviceGetCount()
except Exception as _exc:  # no module, no library, or a driver NVML cannot talk to
    pytest.skip(f"NVML unusable here: {_exc}", allow_module_level=True)
if _COUNT == 0:
    pytest.skip("NVML lists no GPU", allow_module_level=True)
try:
    ctypes.CDLL("libcuda.so.1")
except OSError as _exc:
    pytest.skip(f"libcuda.so.1 missing: {_exc}", allow_module_level=True)

# After the skips: nothing to import for without a GPU.
from gpuguardd.config import Config
from gpuguardd.engine.engine import Engine
from gpuguardd.records.models import Holder, SweepRequest

MiB = 1 << 20
GiB = 1 << 30
INDEX = int(os.environ.get("GPUGUARD_TEST_GPU", "0"))
PINNED_BYTES = int(float(os.environ.get("GPUGUARD_TEST_PINNED_GIB", "8")) * GiB)
DEVICE_BYTES = int(float(os.environ.get("GPUGUARD_TEST_DEVICE_GIB", "2")) * GiB)
READY_TIMEOUT = 120.0
GRACE_SEC = 2.0
FREED_MARGIN = 64 * MiB  # memory counts as back within this of the idle reading
# Filled by the tests in order, printed by the last one.
SUMMARY: dict[str, str] = {}
IDLE: list[int] = []  # v2 used with nothing of ours on the GPU

# One program for every kind of holder, run as `python3 -c CHILD MODE [options]`:
#   context  cuInit, the primary context of device 0 (CUDA_VISIBLE_DEVICES is the test GPU),
#            DEVICE_BYTES of device memory; options pinned=BYTES (cuMemHostAlloc),
#            ignore-term, fork (a child that inherits every fd and sleeps)
#   cuinit   cuInit only
#   nvml     pynvml only: nvmlInit and a handle on NVML index argv[2]
CHILD = r"""
import ctypes, os, signal, sys, time
mode, options = sys.argv[1], sys.argv[2:]


def check(rc, what):
    if rc != 0:
        print(f"error {what} returned {rc}", flush=True)
        sys.exit(1)


if mode == "nvml":
    import pynvml
    pynvml.nvmlInit()
    pynvml.nvmlDeviceGetHandleByIndex(int(options[0]))
else:
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    if mode == "context":
        dev = ctypes.c_int()
        check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        ptr = ctypes.c_uint64()
        check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(options[0]))), "cuMemAlloc_v2")
        for option in options[1:]:
            if option.startswith("pinned="):
                host = ctypes.c_void_p()
                check(cuda.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(int(option[7:])), 0),
                      "cuMemHostAlloc")
if "ignore-term" in options:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
extra = ""
if "fork" in options:
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(3600)
    extra = f" child={child}"
print(f"ready {os.getpid()}{extra}", flush=True)
while True:
    time.sleep(3600)
"""


@dataclass
class Gpu:
    index: int
    handle: Any
    uuid: str
    name: str


@dataclass
class Child:
    popen: subprocess.Popen[str]
    pid: int
    forked: int = 0  # the fork's pid, for mode "context ... fork"


@dataclass
class Children:
    started: list[Child] = field(default_factory=list)

    def start(self, gpu: Gpu, mode: str, *options: str) -> Child:
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=gpu.uuid)
        popen = subprocess.Popen([sys.executable, "-c", CHILD, mode, *options],
                                 stdout=subprocess.PIPE, text=True, env=env)
        child = Child(popen, popen.pid)
        self.started.append(child)
        # Reaped the moment it exits, as systemd reaps a service's processes: a zombie child of
        # the test would otherwise stand for a process that has not gone.
        threading.Thread(target=popen.wait, daemon=True).start()
        assert popen.stdout is not None
        ready, _, _ = select.select([popen.stdout], [], [], READY_TIMEOUT)
        line = popen.stdout.readline().split() if ready else ["(nothing)"]
        assert line[:1] == ["ready"], f"{mode} child: {' '.join(line)}"
        for word in line[2:]:
            if word.startswith("child="):
                child.forked = int(word[6:])
        return child

    def stop_all(self) -> None:
        for child in self.started:
            for pid in (child.forked, child.pid):
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            child.popen.wait(timeout=60)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_pids(handle: Any) -> set[int]:
    pids: set[int] = set()
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            pids.update(int(p.pid) for p in getattr(pynvml, name)(handle))
        except pynvml.NVMLError:
            pass
    return pids


def used_v2(handle: Any) -> int:
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)


def device_files(pid: int) -> tuple[list[str], list[str]]:
    """The NVIDIA device files `pid` has open, and those it maps (with counts)."""
    fds: dict[str, int] = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            fds[target] = fds.get(target, 0) + 1
    maps: dict[str, int] = {}
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
            if path.startswith("/dev/nvidia"):
                maps[path] = maps.get(path, 0) + 1
    return ([f"{p} x{n}" if n > 1 else p for p, n in sorted(fds.items())],
            [f"{p} x{n}" if n > 1 else p for p, n in sorted(maps.items())])


def engine_for(tmp: Path) -> Engine:
    return Engine(Config(runtime_directory=str(tmp / "run"), grace_sec=GRACE_SEC))


def holder_of(engine: Engine, pid: int) -> Holder:
    found = [h for h in engine.scan().holders if h.pid == pid]
    assert found, f"gpuguard does not see pid {pid} as a holder"
    return found[0]


@pytest.fixture(scope="module")
def gpu() -> Iterator[Gpu]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(INDEX)
    yield Gpu(INDEX, handle, text(pynvml.nvmlDeviceGetUUID(handle)),
              text(pynvml.nvmlDeviceGetName(handle)))


def mig_mode(gpu: Gpu) -> str:
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(gpu.handle)
    except pynvml.NVMLError as exc:
        return f"n/a ({exc})"
    return "on" if current else "off"


def settle(gpu: Gpu) -> int:
    """Wait (up to 30 s) for memory a previous test's processes held to come back; the v2
    used figure the next measurement starts from."""
    deadline = time.monotonic() + 30
    while IDLE and used_v2(gpu.handle) > IDLE[0] + FREED_MARGIN and time.monotonic() < deadline:
        time.sleep(0.1)
    return used_v2(gpu.handle)


@pytest.fixture
def children(gpu: Gpu) -> Iterator[Children]:
    if mig_mode(gpu) == "on":
        pytest.skip("MIG mode is on: CUDA contexts here need a whole GPU")
    settle(gpu)
    started = Children()
    try:
        yield started
    finally:
        started.stop_all()


def test_environment(gpu: Gpu) -> None:
    mig = mig_mode(gpu)
    try:
        persistence = "on" if pynvml.nvmlDeviceGetPersistenceMode(gpu.handle) else "off"
    except pynvml.NVMLError as exc:
        persistence = f"n/a ({exc})"
    SUMMARY["GPU"] = f"{gpu.name} (NVML index {gpu.index} of {_COUNT}, {gpu.uuid})"
    SUMMARY["driver"] = text(pynvml.nvmlSystemGetDriverVersion())
    SUMMARY["nvidia-ml-py"] = importlib.metadata.version("nvidia-ml-py")
    SUMMARY["kernel"] = platform.release()
    SUMMARY["persistence mode"] = persistence
    SUMMARY["MIG mode"] = mig
    print("\n".join(f"{k}: {v}" for k, v in SUMMARY.items()))
    assert SUMMARY["driver"]


def test_idle_memory(gpu: Gpu) -> None:
    v1 = pynvml.nvmlDeviceGetMemoryInfo(gpu.handle)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(gpu.handle, version=pynvml.nvmlMemory_v2)
    others = nvml_pids(gpu.handle)
    IDLE[:] = [int(v2.used)]
    SUMMARY["idle memory"] = (f"v1 used {v1.used // MiB} MiB, v2 used {v2.used // MiB} MiB, "
                              f"reserved {v2.reserved // MiB} MiB, total {v2.total // MiB} MiB"
                              + (f" (NVML lists {len(others)} other process(es))" if others else ""))
    print(SUMMARY["idle memory"])
    # What gpuguard relies on: v1 used = v2 used + reserved.
    assert abs(int(v1.used) - int(v2.used) - int(v2.reserved)) <= 2 * MiB


def test_nvml_reports_the_childs_pid(gpu: Gpu, children: Children) -> None:
    child = children.start(gpu, "context", str(DEVICE_BYTES))
    deadline = time.monotonic() + 10
    while child.pid not in (listed := nvml_pids(gpu.handle)) and time.monotonic() < deadline:
        time.sleep(0.05)
    SUMMARY["NVML PID = child's PID"] = ("yes" if child.pid in listed else
                                         f"NO: child {child.pid}, NVML lists {sorted(listed)}")
    assert child.pid in listed, ("NVML does not list the child's PID: another PID namespace "
                                 f"(a container?) or a bad process struct; lists {sorted(listed)}")


@pytest.mark.parametrize("mode", ["context", "cuinit", "nvml"])
def test_holder_files_and_kind(gpu: Gpu, children: Children, tmp_path: Path, mode: str) -> None:
    args = {"context": [str(DEVICE_BYTES)], "cuinit": [], "nvml": [str(gpu.index)]}[mode]
    child = children.start(gpu, mode, *args)
    time.sleep(0.5)  # let the driver settle what the child opened
    fds, maps = device_files(child.pid)
    holder = holder_of(engine_for(tmp_path), child.pid)
    SUMMARY[f"{mode} process"] = (
        f"fds {', '.join(fds) or 'none'}; maps {', '.join(maps) or 'none'}; gpuguard: "
        f"{holder.kind} via {'+'.join(holder.how)}, GPUs {holder.gpus}, "
        f"{holder.gpu_memory // MiB} MiB")
    print(SUMMARY[f"{mode} process"])
    if mode == "nvml":
        assert holder.kind == "management", "a pynvml-only process must not count as compute"
    if mode == "context":
        assert holder.kind == "compute" and gpu.index in holder.gpus


@dataclass
class Timeline:
    """Seconds after the sweep started at which each thing was first seen."""

    started: float
    exited: dict[int, float] = field(default_factory=dict)
    nvml_empty: float | None = None
    freed: float | None = None

    def since(self, at: float | None) -> str:
        return "never" if at is None else f"{(at - self.started) * 1000:.0f} ms"


def watch(gpu: Gpu, child: Child, idle: int, timeline: Timeline, stop: threading.Event) -> None:
    pidfds = {pid: os.pidfd_open(pid) for pid in (child.pid, child.forked) if pid}
    held = False  # memory counts as freed only after it was seen held
    try:
        while not stop.is_set():
            now = time.monotonic()
            for pid, fd in list(pidfds.items()):
                if select.select([fd], [], [], 0)[0]:
                    timeline.exited[pid] = now
                    os.close(pidfds.pop(pid))
            if timeline.nvml_empty is None and not ({child.pid, child.forked} & nvml_pids(gpu.handle)):
                timeline.nvml_empty = now
            used = used_v2(gpu.handle)
            held = held or used > idle + FREED_MARGIN
            if timeline.freed is None and held and used <= idle + FREED_MARGIN:
                timeline.freed = now
            if timeline.freed is not None and timeline.nvml_empty is not None and not pidfds:
                return
            time.sleep(0.005)
    finally:
        for fd in pidfds.values():
            os.close(fd)


@pytest.mark.parametrize("pinned", [0, PINNED_BYTES], ids=["device-memory-only", "pinned-host-memory"])
def test_sweep_times_exit_list_and_release(gpu: Gpu, children: Children, tmp_path: Path,
                                           pinned: int) -> None:
    idle = settle(gpu)
    options = [str(DEVICE_BYTES), "ignore-term", "fork"] + ([f"pinned={pinned}"] if pinned else [])
    child = children.start(gpu, "context", *options)
    ours = {child.pid, child.forked}
    engine = engine_for(tmp_path)
    plan = engine.sweep(SweepRequest(gpus=[str(gpu.index)], dry_run=True, requested_by="tests/gpu"))
    planned = {t.pid for t in plan.targets}
    assert child.pid in planned
    assert planned <= ours, f"the plan would end processes this test did not start: {plan.targets}"

    timeline = Timeline(started=time.monotonic())
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(gpu, child, idle, timeline, stop), daemon=True)
    watcher.start()
    try:
        report = engine.sweep(SweepRequest(gpus=[str(gpu.index)], requested_by="tests/gpu"))
        watcher.join(timeout=30)
    finally:
        stop.set()
    ended = {t.pid: t.to_dict() for t in report.terminated}
    spared = [f"{s.pid} ({s.why})" for s in report.spared if s.pid in ours]
    key = f"sweep, {f'{pinned / GiB:g} GiB pinned host memory' if pinned else 'no pinned memory'}"
    SUMMARY[key] = (
        f"outcome {report.outcome} in {report.duration_ms} ms; holder {child.pid} "
        f"{ended.get(child.pid, {}).get('signal', 'not ended')} after "
        f"{ended.get(child.pid, {}).get('exited_after_ms', '?')} ms, fork {child.forked} "
        f"{ended.get(child.forked, {}).get('signal', 'not ended')}"
        + (f" (spared: {'; '.join(spared)})" if spared else "")
        + f"; seen: exit {timeline.since(timeline.exited.get(child.pid))} / fork exit "
        f"{timeline.since(timeline.exited.get(child.forked))} -> NVML list empty "
        f"{timeline.since(timeline.nvml_empty)} -> memory freed {timeline.since(timeline.freed)}")
    print(SUMMARY[key])
    assert report.targets and {t.pid for t in report.targets} <= ours
    assert ended.get(child.pid, {}).get("signal") == "SIGKILL", "SIGTERM was ignored: SIGKILL must end it"
    assert report.outcome == "freed", report.to_dict()
    assert timeline.freed is not None


def test_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Printed whatever -s says, for docs/real-hosts.md ("The real-GPU test")."""
    lines = ["Real-GPU test (`python3 -m pytest tests/gpu`):", ""]
    lines += [f"* {key}: {value}" for key, value in SUMMARY.items()]
    summary = "\n".join(lines) + "\n"
    target = os.environ.get("GPUGUARD_GPU_SUMMARY")
    if target:
        Path(target).write_text(summary, encoding="utf-8")
    with capsys.disabled():
        print("\n" + summary)
    assert SUMMARY

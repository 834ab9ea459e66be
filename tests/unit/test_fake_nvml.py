"""Tests for the fake NVML, driven through the real pynvml.

pynvml binds ``libnvidia-ml.so.1`` once per process and the loader reads
``LD_LIBRARY_PATH`` only at start-up, so every scenario runs pynvml in a child
interpreter (:class:`NvmlSession`).  The child evaluates one expression per
line from the test and answers with one JSON line; it stays up for the whole
test so that what the library remembers across calls (init refcount, when a
pid was first seen dead) is exercised the way a long-running daemon sees it.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests import fakenvml
from tests.fakenvml import (
    GIB,
    LIBRARY_NAME,
    FakeGpu,
    FakeNvmlBuildError,
    FakeNvmlState,
    build_library,
    env_for,
)

NOT_MIG = 0xFFFFFFFF
CALL_TIMEOUT_S = 30.0

# Runs in the child.  Helpers return plain JSON-able values so a failing
# assertion shows exactly what pynvml handed back.
SERVER = r"""
import ctypes, json, sys, threading, time
from ctypes import byref, c_char_p, c_uint, c_ubyte, c_ulonglong, c_void_p
import pynvml as N


def init():
    N.nvmlInit()
    return True


def shutdown():
    N.nvmlShutdown()
    return True


def h(i):
    return N.nvmlDeviceGetHandleByIndex(i)


def count():
    return N.nvmlDeviceGetCount()


def info(i):
    handle = h(i)
    pci = N.nvmlDeviceGetPciInfo_v3(handle)
    # pynvml's structs hand char arrays back already decoded to str.
    return {
        "index": N.nvmlDeviceGetIndex(handle),
        "name": N.nvmlDeviceGetName(handle),
        "uuid": N.nvmlDeviceGetUUID(handle),
        "minor": N.nvmlDeviceGetMinorNumber(handle),
        "busId": pci.busId,
        "busIdLegacy": pci.busIdLegacy,
        "domain": pci.domain,
        "bus": pci.bus,
        "device": pci.device,
        "pciDeviceId": pci.pciDeviceId,
    }


def mem(i):
    m = N.nvmlDeviceGetMemoryInfo(h(i))
    return {"total": m.total, "free": m.free, "used": m.used}


def mem2(i, version=N.nvmlMemory_v2):
    m = N.nvmlDeviceGetMemoryInfo(h(i), version=version)
    return {"total": m.total, "reserved": m.reserved, "free": m.free, "used": m.used}


LISTS = {
    "compute": N.nvmlDeviceGetComputeRunningProcesses,
    "graphics": N.nvmlDeviceGetGraphicsRunningProcesses,
    "mps": N.nvmlDeviceGetMPSComputeRunningProcesses,
    "compute_v2": N.nvmlDeviceGetComputeRunningProcesses_v2,
    "graphics_v2": N.nvmlDeviceGetGraphicsRunningProcesses_v2,
    "mps_v2": N.nvmlDeviceGetMPSComputeRunningProcesses_v2,
}


def procs(i, kind="compute"):
    return [
        [p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
        for p in LISTS[kind](h(i))
    ]


def pids(i, kind="compute"):
    return [p[0] for p in procs(i, kind)]


def handle_index(handle):
    return N.nvmlDeviceGetIndex(handle)


# Direct ctypes calls, for entry points and corner cases pynvml's wrappers
# never reach.

class ProcV1(ctypes.Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]


def raw_procs(i, function, capacity, null=False, v1=False):
    struct = ProcV1 if v1 else N.c_nvmlProcessInfo_v2_t
    n = c_uint(capacity)
    buf = None if null else (struct * max(capacity, 1))()
    rc = getattr(N.nvmlLib, function)(h(i), byref(n), buf)
    rows = [[e.pid, e.usedGpuMemory] for e in buf[: n.value]] if rc == 0 and buf else []
    return [rc, n.value, rows]


def raw_pci_legacy(i, function):
    # A canary after the legacy struct catches a writer that fills in the
    # 16-byte-longer v3 layout instead.
    class Guarded(ctypes.Structure):
        _fields_ = [("info", N.nvmlPciInfo_v2_t), ("canary", c_ubyte * 32)]

    g = Guarded()
    for k in range(32):
        g.canary[k] = 0xAA
    rc = getattr(N.nvmlLib, function)(h(i), byref(g.info))
    return {
        "rc": rc,
        "busId": g.info.busId,
        "domain": g.info.domain,
        "bus": g.info.bus,
        "device": g.info.device,
        "canary_intact": all(b == 0xAA for b in g.canary),
    }


def raw_string(i, function, length):
    buf = ctypes.create_string_buffer(length)
    rc = getattr(N.nvmlLib, function)(h(i), buf, c_uint(length))
    return [rc, buf.value.decode()]


def raw_driver(length):
    buf = ctypes.create_string_buffer(length)
    rc = N.nvmlLib.nvmlSystemGetDriverVersion(buf, c_uint(length))
    return [rc, buf.value.decode()]


def raw(function, *args):
    return getattr(N.nvmlLib, function)(*args)


def raw_count_v1():
    n = c_uint(12345)
    rc = N.nvmlLib.nvmlDeviceGetCount(byref(n))
    return [rc, n.value]


def raw_handle_v1_matches(i):
    legacy = N.c_nvmlDevice_t()
    rc = N.nvmlLib.nvmlDeviceGetHandleByIndex(c_uint(i), byref(legacy))
    same = ctypes.cast(legacy, c_void_p).value == ctypes.cast(h(i), c_void_p).value
    return [rc, same]


def bogus_handle(address):
    return ctypes.cast(c_void_p(address), N.c_nvmlDevice_t)


def error_string(code):
    N.nvmlLib.nvmlErrorString.restype = c_char_p
    return N.nvmlLib.nvmlErrorString(code).decode()


def hammer(seconds, threads=4):
    seen, errors = set(), set()
    stop = time.monotonic() + seconds

    def work():
        while time.monotonic() < stop:
            try:
                seen.add(N.nvmlDeviceGetMemoryInfo(h(0)).used)
            except N.NVMLError as e:
                errors.add(e.value)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"seen": sorted(seen), "errors": sorted(errors)}


for line in sys.stdin:
    try:
        reply = {"ok": eval(line)}
    except N.NVMLError as e:
        reply = {"error": type(e).__name__, "code": e.value, "message": str(e)}
    # default=repr: a bare handle is not JSON, and a test that merely needs
    # the call to succeed should not have to wrap it.
    print(json.dumps(reply, default=repr), flush=True)
"""


class NvmlCallError(Exception):
    """pynvml raised NVMLError in the child."""

    def __init__(self, name: str, code: int, message: str) -> None:
        super().__init__(f"{name} ({code}): {message}")
        self.name = name
        self.code = code
        self.message = message


class NvmlSession:
    """A child interpreter running pynvml against the fake library."""

    def __init__(self, env: dict[str, str], stderr_path: Path) -> None:
        self._stderr_path = stderr_path
        self._stderr: IO[bytes] = stderr_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )

    def send(self, expr: str) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(expr + "\n")
        self._proc.stdin.flush()

    def ready(self, timeout: float) -> bool:
        """Whether a reply can be read without blocking."""
        assert self._proc.stdout is not None
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return bool(readable)

    def recv(self) -> Any:
        assert self._proc.stdout is not None
        if not self.ready(CALL_TIMEOUT_S):
            raise AssertionError(f"no reply from the pynvml child in {CALL_TIMEOUT_S}s")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=CALL_TIMEOUT_S)
            raise AssertionError(f"pynvml child exited; stderr:\n{self.stderr()}")
        reply = json.loads(line)
        if "error" in reply:
            raise NvmlCallError(reply["error"], reply["code"], reply["message"])
        return reply["ok"]

    def call(self, expr: str) -> Any:
        self.send(expr)
        return self.recv()

    def error(self, expr: str) -> NvmlCallError:
        """The NVMLError ``expr`` raises; fails the test if it succeeds."""
        with pytest.raises(NvmlCallError) as caught:
            self.call(expr)
        return caught.value

    def stderr(self) -> str:
        self._stderr.flush()
        return self._stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=CALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


StartSession = Callable[[], NvmlSession]
Spawn = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "nvml-state"


@pytest.fixture
def start(fake_nvml_libdir: Path, state_path: Path, tmp_path: Path) -> Iterator[StartSession]:
    sessions: list[NvmlSession] = []

    def _start() -> NvmlSession:
        env = {**os.environ, **env_for(fake_nvml_libdir, state_path)}
        session = NvmlSession(env, tmp_path / f"child{len(sessions)}.stderr")
        sessions.append(session)
        return session

    yield _start
    for session in sessions:
        session.close()


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start real processes to stand in for GPU users; kills leftovers."""
    children: list[subprocess.Popen[bytes]] = []

    def _spawn(*argv: str) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(argv or ("sleep", "600"))
        children.append(child)
        return child

    yield _spawn
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def kill_and_reap(child: subprocess.Popen[bytes]) -> None:
    child.kill()
    child.wait()


def dead_pid(spawn: Spawn) -> int:
    child = spawn("true")
    child.wait()
    return child.pid


def one_gpu(**kwargs: Any) -> FakeNvmlState:
    state = FakeNvmlState()
    state.add_gpu(**kwargs)
    return state


# ---- building ----------------------------------------------------------------


def test_library_compiles_warning_free_as_strict_c99(tmp_path: Path, fake_nvml_libdir: Path) -> None:
    # fake_nvml_libdir: gcc exists, or the fixture skipped (a failure in tests/unit and in CI:
    # tests/conftest.py).
    result = subprocess.run(
        [
            "gcc",
            "-std=c99",
            "-pedantic",
            "-Werror",
            "-Wall",
            "-Wextra",
            "-Wshadow",
            "-Wconversion",
            "-shared",
            "-fPIC",
            "-O2",
            "-pthread",
            "-o",
            str(tmp_path / LIBRARY_NAME),
            str(fakenvml.SOURCE),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_build_library_reuses_a_fresh_library(fake_nvml_libdir: Path) -> None:
    target = fake_nvml_libdir / LIBRARY_NAME
    before = target.stat().st_mtime_ns
    assert build_library(fake_nvml_libdir) == fake_nvml_libdir
    assert target.stat().st_mtime_ns == before


def test_build_library_reports_gcc_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_nvml_libdir: Path
) -> None:
    # fake_nvml_libdir only for its gcc check, as above.
    broken = tmp_path / "broken.c"
    broken.write_text("int main(void) { return undeclared_identifier; }\n")
    monkeypatch.setattr(fakenvml, "SOURCE", broken)
    with pytest.raises(FakeNvmlBuildError, match="undeclared_identifier"):
        build_library(tmp_path / "out")
    assert not (tmp_path / "out" / LIBRARY_NAME).exists()
    assert list((tmp_path / "out").iterdir()) == [], "temporary output left behind"


# ---- Python helpers ------------------------------------------------------------


def test_render_matches_the_documented_format() -> None:
    state = FakeNvmlState(driver_version="535.129.03", init_error=9)
    state.fail["nvmlDeviceGetComputeRunningProcesses_v3"] = 999
    state.add_gpu(uuid="GPU-a", pci_bus_id="00000000:17:00.0", base_used=5)
    state.add_gpu(uuid="GPU-b", name="Tesla T4", minor=7, memory_total=16 * GIB, lost=True)
    state.add_proc(1, 4242, 3 * GIB, kind="mps", release_delay_ms=250)
    assert state.render().splitlines() == [
        "driver 535.129.03",
        "init_error 9",
        "fail nvmlDeviceGetComputeRunningProcesses_v3 999",
        f"gpu 0 uuid=GPU-a name=NVIDIA_H100_80GB_HBM3 minor=0 pci=00000000:17:00.0 total={80 * GIB} used=5",
        f"gpu 1 uuid=GPU-b name=Tesla_T4 minor=7 pci=00000000:02:00.0 total={16 * GIB} used=0 lost",
        f"proc 1 4242 {3 * GIB} mps release_delay_ms=250",
    ]


def test_defaults_derive_from_the_index() -> None:
    state = FakeNvmlState()
    first, second = state.add_gpu(), state.add_gpu()
    assert (first.minor, second.minor) == (0, 1)
    assert first.pci_bus_id != second.pci_bus_id
    assert first.uuid != second.uuid
    assert FakeGpu(index=3, uuid="GPU-x").minor == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: setattr(s.gpus[0], "name", "Bad_Name"), "must not contain '_'"),
        (lambda s: setattr(s.gpus[0], "uuid", "GPU x"), "uuid"),
        (lambda s: setattr(s.gpus[0], "pci_bus_id", "17:00"), "pci_bus_id"),
        (lambda s: setattr(s.gpus[0], "index", 1), "in order"),
        (lambda s: s.procs.append(fakenvml.FakeProc(gpu=5, pid=1, used=0)), "GPU 5"),
        (lambda s: s.procs.append(fakenvml.FakeProc(gpu=0, pid=0, used=0)), "pid 0"),
        (lambda s: s.fail.update({"not a function": 1}), "NVML function"),
        (lambda s: setattr(s, "driver_version", ""), "driver_version"),
    ],
)
def test_render_rejects_what_the_library_would_misread(
    mutate: Callable[[FakeNvmlState], object], message: str, tmp_path: Path
) -> None:
    state = one_gpu()
    mutate(state)
    with pytest.raises(ValueError, match=message):
        state.write(tmp_path / "state")
    assert not (tmp_path / "state").exists()


def test_add_and_remove_proc() -> None:
    state = one_gpu()
    state.add_gpu()
    state.add_proc(0, 100, 1)
    state.add_proc(1, 100, 2, kind="graphics")
    state.add_proc(0, 200, 3)
    with pytest.raises(ValueError, match="no GPU 2"):
        state.add_proc(2, 300, 1)
    state.remove_proc(100)
    assert [(p.gpu, p.pid) for p in state.procs] == [(0, 200)]
    with pytest.raises(KeyError):
        state.remove_proc(100)


def test_write_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state"
    one_gpu().write(path)
    first_inode = path.stat().st_ino
    state = one_gpu()
    state.driver_version = "999.1"
    state.write(path)
    assert path.read_text().startswith("driver 999.1\n")
    assert path.stat().st_ino != first_inode, "rewritten in place, not replaced"
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["state"]


def test_env_for_puts_the_fake_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/cuda/lib64")
    env = env_for(Path("/x/lib"), Path("/x/state"))
    assert env == {
        "LD_LIBRARY_PATH": "/x/lib:/usr/local/cuda/lib64",
        "FAKE_NVML_STATE": "/x/state",
    }
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert env_for(Path("/x/lib"), Path("/x/state"))["LD_LIBRARY_PATH"] == "/x/lib"


# ---- loading and init ----------------------------------------------------------


def test_library_not_found_without_the_fake_on_the_path(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("a real NVML is installed, so pynvml would find it")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_STATE")}
    session = NvmlSession(env, tmp_path / "stderr")
    try:
        assert session.error("init()").name == "NVMLError_LibraryNotFound"
    finally:
        session.close()


def test_missing_state_file_means_driver_not_loaded(start: StartSession) -> None:
    nvml = start()
    err = nvml.error("init()")
    assert (err.name, err.code, err.message) == ("NVMLError_DriverNotLoaded", 9, "Driver Not Loaded")
    # Init never succeeded, so nothing else may work either.
    assert nvml.error("count()").name == "NVMLError_Uninitialized"


@pytest.mark.parametrize(
    ("code", "name"),
    [(9, "NVMLError_DriverNotLoaded"), (18, "NVMLError_LibRmVersionMismatch")],
)
def test_init_error(start: StartSession, state_path: Path, code: int, name: str) -> None:
    state = one_gpu()
    state.init_error = code
    state.write(state_path)
    nvml = start()
    assert nvml.error("init()").name == name
    assert nvml.error("count()").name == "NVMLError_Uninitialized"
    # The driver "comes back": the next init reads the file afresh.
    state.init_error = 0
    state.write(state_path)
    assert nvml.call("init()") is True
    assert nvml.call("count()") == 1


def test_every_init_entry_point_and_refcounted_shutdown(start: StartSession, state_path: Path) -> None:
    one_gpu().write(state_path)
    nvml = start()
    assert nvml.error("count()").code == 1, "calls before init must be Uninitialized"
    assert nvml.call("init()") is True  # pynvml: nvmlInitWithFlags
    assert nvml.call("raw('nvmlInit')") == 0
    assert nvml.call("raw('nvmlInit_v2')") == 0
    for remaining in (2, 1, 0):
        assert nvml.call("raw('nvmlShutdown')") == 0
        if remaining:
            assert nvml.call("count()") == 1
    assert nvml.error("count()").name == "NVMLError_Uninitialized"
    assert nvml.error("shutdown()").name == "NVMLError_Uninitialized"


# ---- enumeration and identity --------------------------------------------------


def test_devices_report_their_identity(start: StartSession, state_path: Path) -> None:
    state = FakeNvmlState(driver_version="535.129.03")
    state.add_gpu(uuid="GPU-8f2d0c11-aaaa-bbbb-cccc-000000000001", pci_bus_id="00000000:17:00.0")
    state.add_gpu(
        uuid="GPU-8f2d0c11-aaaa-bbbb-cccc-000000000002",
        name="NVIDIA A100-SXM4-40GB",
        minor=5,
        pci_bus_id="00000001:ab:1f.0",
    )
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("count()") == 2
    assert nvml.call("N.nvmlSystemGetDriverVersion()") == "535.129.03"
    assert nvml.call("N.nvmlSystemGetNVMLVersion()") == "12.535.129.03"
    assert nvml.call("info(0)") == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-8f2d0c11-aaaa-bbbb-cccc-000000000001",
        "minor": 0,
        "busId": "00000000:17:00.0",
        "busIdLegacy": "0000:17:00.0",
        "domain": 0,
        "bus": 0x17,
        "device": 0,
        "pciDeviceId": 0x10DE,
    }
    assert nvml.call("info(1)") == {
        "index": 1,
        "name": "NVIDIA A100-SXM4-40GB",
        "uuid": "GPU-8f2d0c11-aaaa-bbbb-cccc-000000000002",
        "minor": 5,
        "busId": "00000001:AB:1F.0",
        "busIdLegacy": "0001:AB:1F.0",
        "domain": 1,
        "bus": 0xAB,
        "device": 0x1F,
        "pciDeviceId": 0x10DE,
    }


def test_handle_lookups(start: StartSession, state_path: Path) -> None:
    state = FakeNvmlState()
    state.add_gpu(uuid="GPU-first", pci_bus_id="00000000:17:00.0")
    state.add_gpu(uuid="GPU-second", pci_bus_id="00000000:2A:00.0")
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("handle_index(N.nvmlDeviceGetHandleByUUID('GPU-second'))") == 1
    # NVML accepts the bus id in any of its spellings and either case.
    for spelling in ("00000000:2A:00.0", "0000:2a:00.0", "2a:00.0"):
        assert nvml.call(f"handle_index(N.nvmlDeviceGetHandleByPciBusId('{spelling}'))") == 1
    assert nvml.call("raw_handle_v1_matches(1)") == [0, True]
    assert nvml.error("N.nvmlDeviceGetHandleByUUID('GPU-nope')").name == "NVMLError_NotFound"
    assert nvml.error("N.nvmlDeviceGetHandleByPciBusId('0000:99:00.0')").code == 6
    assert nvml.error("N.nvmlDeviceGetHandleByPciBusId('garbage')").code == 2
    assert nvml.error("h(2)").name == "NVMLError_InvalidArgument"


def test_bad_handles_are_invalid_arguments(start: StartSession, state_path: Path) -> None:
    one_gpu().write(state_path)
    nvml = start()
    nvml.call("init()")
    for address in (0, 16, "ctypes.cast(h(0), c_void_p).value + 1"):
        err = nvml.error(f"N.nvmlDeviceGetName(bogus_handle({address}))")
        assert err.name == "NVMLError_InvalidArgument"


def test_legacy_entry_points_use_legacy_layouts(start: StartSession, state_path: Path) -> None:
    state = one_gpu(pci_bus_id="00000000:17:00.0")
    state.add_proc(0, os.getpid(), 7 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("raw_count_v1()") == [0, 1]
    for function in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2"):
        assert nvml.call(f"raw_pci_legacy(0, '{function}')") == {
            "rc": 0,
            "busId": "0000:17:00.0",
            "domain": 0,
            "bus": 0x17,
            "device": 0,
            "canary_intact": True,
        }
    # The v1 process struct is 16 bytes, not 24: reading it back with the
    # v1 layout only lines up if the library wrote that layout.
    assert nvml.call("raw_procs(0, 'nvmlDeviceGetComputeRunningProcesses', 4, v1=True)") == [
        0,
        1,
        [[os.getpid(), 7 * GIB]],
    ]


def test_error_strings_are_nvmls(start: StartSession, state_path: Path) -> None:
    one_gpu().write(state_path)
    nvml = start()
    nvml.call("init()")
    expected = {
        0: "Success",
        1: "Uninitialized",
        2: "Invalid Argument",
        6: "Not Found",
        7: "Insufficient Size",
        9: "Driver Not Loaded",
        15: "GPU is lost",
        25: "Argument version mismatch",
        999: "Unknown Error",
        12345: "Unknown Error",
    }
    assert {code: nvml.call(f"error_string({code})") for code in expected} == expected


def test_string_buffers_too_small(start: StartSession, state_path: Path) -> None:
    one_gpu(uuid="GPU-0123456789").write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("raw_string(0, 'nvmlDeviceGetUUID', 14)") == [7, ""]
    assert nvml.call("raw_string(0, 'nvmlDeviceGetUUID', 15)") == [0, "GPU-0123456789"]
    assert nvml.call("raw_string(0, 'nvmlDeviceGetName', 8)") == [7, ""]
    assert nvml.call("raw_driver(9)")[0] == 7
    assert nvml.call("raw_driver(10)") == [0, "550.54.15"]


# ---- memory and processes ------------------------------------------------------


def test_memory_info_sums_base_and_every_kind_of_process(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    graphics, mps = spawn(), spawn()
    state = FakeNvmlState()
    state.add_gpu(memory_total=80 * GIB, base_used=1 * GIB)
    state.add_gpu(memory_total=40 * GIB)
    state.add_proc(0, os.getpid(), 10 * GIB)
    state.add_proc(0, graphics.pid, 2 * GIB, kind="graphics")
    state.add_proc(0, mps.pid, 3 * GIB, kind="mps")
    state.add_proc(1, os.getpid(), 5 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("mem(0)") == {"total": 80 * GIB, "used": 16 * GIB, "free": 64 * GIB}
    assert nvml.call("mem2(0)") == {
        "total": 80 * GIB,
        "reserved": 0,
        "used": 16 * GIB,
        "free": 64 * GIB,
    }
    assert nvml.call("mem(1)") == {"total": 40 * GIB, "used": 5 * GIB, "free": 35 * GIB}


def test_memory_info_v2_checks_the_struct_version(start: StartSession, state_path: Path) -> None:
    one_gpu().write(state_path)
    nvml = start()
    nvml.call("init()")
    # What nvmlMemory_v1 would be: same size, version 1.
    err = nvml.error("mem2(0, version=0x01000028)")
    assert err.name == "NVMLError_ArgumentVersionMismatch"


def test_overcommitted_gpu_reports_no_free_memory(start: StartSession, state_path: Path) -> None:
    state = one_gpu(memory_total=10 * GIB, base_used=8 * GIB)
    state.add_proc(0, os.getpid(), 4 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("mem(0)") == {"total": 10 * GIB, "used": 12 * GIB, "free": 0}


@pytest.mark.parametrize("version", ["", "_v2"])
def test_process_lists_split_by_kind(start: StartSession, state_path: Path, spawn: Spawn, version: str) -> None:
    a, b, c, d = spawn(), spawn(), spawn(), spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_gpu()
    state.add_proc(0, a.pid, 1 * GIB)
    state.add_proc(0, b.pid, 2 * GIB, kind="graphics")
    state.add_proc(0, c.pid, 3 * GIB, kind="mps")
    state.add_proc(0, d.pid, 4 * GIB)
    state.add_proc(1, a.pid, 5 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call(f"procs(0, 'compute{version}')") == [
        [a.pid, 1 * GIB, NOT_MIG, NOT_MIG],
        [d.pid, 4 * GIB, NOT_MIG, NOT_MIG],
    ]
    assert nvml.call(f"procs(0, 'graphics{version}')") == [[b.pid, 2 * GIB, NOT_MIG, NOT_MIG]]
    assert nvml.call(f"procs(0, 'mps{version}')") == [[c.pid, 3 * GIB, NOT_MIG, NOT_MIG]]
    assert nvml.call(f"procs(1, 'compute{version}')") == [[a.pid, 5 * GIB, NOT_MIG, NOT_MIG]]
    assert nvml.call(f"procs(1, 'graphics{version}')") == []
    assert nvml.call(f"procs(1, 'mps{version}')") == []


def test_two_call_protocol(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    state = FakeNvmlState()
    state.add_gpu()
    state.add_gpu()
    state.add_proc(0, a.pid, 1 * GIB)
    state.add_proc(0, b.pid, 2 * GIB)
    state.add_proc(0, a.pid, 3 * GIB, kind="graphics")
    state.add_proc(1, b.pid, 4 * GIB, kind="mps")
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    f = "'nvmlDeviceGetComputeRunningProcesses_v3'"
    # The size query counts only this GPU's processes of this kind.
    assert nvml.call(f"raw_procs(0, {f}, 0, null=True)") == [7, 2, []]
    assert nvml.call("raw_procs(0, 'nvmlDeviceGetGraphicsRunningProcesses_v3', 0, null=True)") == [7, 1, []]
    assert nvml.call(f"raw_procs(0, {f}, 1)") == [7, 2, []]
    assert nvml.call(f"raw_procs(0, {f}, 8)") == [0, 2, [[a.pid, 1 * GIB], [b.pid, 2 * GIB]]]
    assert nvml.call(f"raw_procs(1, {f}, 0, null=True)") == [0, 0, []]
    # Room claimed but no buffer: NVML refuses rather than write to NULL.
    assert nvml.call(f"raw_procs(0, {f}, 8, null=True)") == [2, 8, []]


def test_memory_released_when_process_dies(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    holder = spawn()
    state = one_gpu(base_used=1 * GIB)
    state.add_proc(0, holder.pid, 20 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("pids(0)") == [holder.pid]
    assert nvml.call("mem(0)")["used"] == 21 * GIB
    kill_and_reap(holder)
    assert nvml.call("pids(0)") == []
    assert nvml.call("mem(0)")["used"] == 1 * GIB


def test_a_process_on_two_lists_counts_once_in_memory(start: StartSession, state_path: Path,
                                                     spawn: Spawn) -> None:
    """An OpenGL+CUDA process is on the compute and the graphics list, each with its one figure;
    a driver counts its memory once, so the GPU's used memory is not the sum of the lists."""
    both, other = spawn(), spawn()
    state = one_gpu(base_used=1 * GIB)
    state.add_proc(0, both.pid, 3 * GIB)
    state.add_proc(0, both.pid, 3 * GIB, kind="graphics")
    state.add_proc(0, other.pid, 2 * GIB, kind="graphics")
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("pids(0)") == [both.pid]
    assert nvml.call("pids(0, 'graphics')") == [both.pid, other.pid]
    assert nvml.call("mem(0)")["used"] == 6 * GIB
    assert nvml.call("mem2(0)")["used"] == 6 * GIB
    kill_and_reap(both)
    assert nvml.call("mem2(0)")["used"] == 3 * GIB


def test_host_pid_lists_the_host_pid_while_the_local_process_lives(
        start: StartSession, state_path: Path, spawn: Spawn) -> None:
    """Foreign-PID mode: a caller in a container sees its process as `pid`, NVML lists the
    host's pid; the entry and its memory go when the process does."""
    local = spawn()
    host_pid = 4_000_000  # past this machine's pids: names nothing here
    state = one_gpu()
    state.add_proc(0, local.pid, 2 * GIB, host_pid=host_pid)
    state.add_proc(0, local.pid, 2 * GIB, kind="graphics", host_pid=host_pid)
    assert f"proc 0 {local.pid} {2 * GIB} compute release_delay_ms=0 host_pid={host_pid}" \
        in state.render().splitlines()
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("pids(0)") == [host_pid]
    assert nvml.call("pids(0, 'graphics')") == [host_pid]
    assert nvml.call("mem2(0)")["used"] == 2 * GIB
    kill_and_reap(local)
    assert nvml.call("pids(0)") == []
    assert nvml.call("mem2(0)")["used"] == 0


def test_host_pid_is_no_raw_record() -> None:
    with pytest.raises(ValueError, match="host_pid"):
        FakeNvmlState(gpus=[FakeGpu(0, "GPU-x")],
                      procs=[fakenvml.FakeProc(0, 7, 1, raw=True, host_pid=8)]).render()


def test_release_delay_counts_from_the_kill(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    holder = spawn()
    state = one_gpu()
    state.add_proc(0, holder.pid, 20 * GIB, release_delay_ms=1000)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("mem(0)")["used"] == 20 * GIB
    kill_and_reap(holder)
    # Dead, but the driver has not let go yet: still used and still listed.
    assert nvml.call("mem(0)")["used"] == 20 * GIB
    assert nvml.call("pids(0)") == [holder.pid]
    time.sleep(1.3)
    assert nvml.call("mem(0)")["used"] == 0
    assert nvml.call("pids(0)") == []


def test_release_delay_starts_when_first_observed_dead(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    pid = dead_pid(spawn)
    state = one_gpu()
    state.add_proc(0, pid, 20 * GIB, release_delay_ms=1000)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    # Dead longer than the delay already, but nobody had looked: the clock
    # starts now.
    time.sleep(1.2)
    assert nvml.call("mem(0)")["used"] == 20 * GIB
    time.sleep(1.2)
    assert nvml.call("mem(0)")["used"] == 0
    # A new client process has its own view, like a fresh nvmlInit would.
    other = start()
    other.call("init()")
    assert other.call("mem(0)")["used"] == 20 * GIB


def test_zombies_still_hold_memory(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    child = spawn("true")
    # Exited but not reaped: the pid exists as a zombie until wait().
    deadline = time.monotonic() + 10
    stat = Path(f"/proc/{child.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "child never became a zombie"
        time.sleep(0.01)
    state = one_gpu()
    state.add_proc(0, child.pid, 6 * GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("mem(0)")["used"] == 6 * GIB
    assert nvml.call("pids(0)") == [child.pid]
    child.wait()
    assert nvml.call("mem(0)")["used"] == 0
    assert nvml.call("pids(0)") == []


# ---- failures ------------------------------------------------------------------


def test_lost_gpu(start: StartSession, state_path: Path) -> None:
    state = FakeNvmlState()
    state.add_gpu(uuid="GPU-ok")
    state.add_gpu(uuid="GPU-lost", pci_bus_id="00000000:2A:00.0", lost=True)
    state.add_proc(1, os.getpid(), GIB)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("count()") == 2
    nvml.call("h(1)")
    for expr in (
        "N.nvmlDeviceGetName(h(1))",
        "N.nvmlDeviceGetUUID(h(1))",
        "N.nvmlDeviceGetMinorNumber(h(1))",
        "N.nvmlDeviceGetIndex(h(1))",
        "N.nvmlDeviceGetPciInfo(h(1))",
        "mem(1)",
        "mem2(1)",
        "procs(1, 'compute')",
        "procs(1, 'graphics')",
        "procs(1, 'mps')",
        "N.nvmlDeviceGetHandleByUUID('GPU-lost')",
        "N.nvmlDeviceGetHandleByPciBusId('00000000:2A:00.0')",
    ):
        err = nvml.error(expr)
        assert (err.name, err.code) == ("NVMLError_GpuIsLost", 15), expr
    assert nvml.call("info(0)")["uuid"] == "GPU-ok"


def test_fail_injection(start: StartSession, state_path: Path) -> None:
    state = one_gpu()
    state.add_proc(0, os.getpid(), GIB)
    state.fail = {"nvmlDeviceGetComputeRunningProcesses_v3": 999, "nvmlDeviceGetMemoryInfo": 15}
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.error("procs(0, 'compute')").name == "NVMLError_Unknown"
    assert nvml.error("mem(0)").code == 15
    # Only the named entry points fail, not their siblings.
    assert nvml.call("procs(0, 'compute_v2')")[0][0] == os.getpid()
    assert nvml.call("mem2(0)")["used"] == GIB
    state.fail = {}
    state.write(state_path)
    assert nvml.call("pids(0)") == [os.getpid()]


def test_fail_injection_on_init_and_shutdown(start: StartSession, state_path: Path) -> None:
    state = one_gpu()
    state.fail = {"nvmlInitWithFlags": 17}
    state.write(state_path)
    nvml = start()
    assert nvml.error("init()").name == "NVMLError_OperatingSystem"
    assert nvml.error("count()").code == 1
    state.fail = {"nvmlShutdown": 999}
    state.write(state_path)
    nvml.call("init()")
    assert nvml.error("shutdown()").code == 999
    assert nvml.call("count()") == 1, "a failed shutdown must leave NVML initialised"


def test_state_is_reread_on_every_call(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    state = one_gpu()
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("count()") == 1
    assert nvml.call("mem(0)")["used"] == 0

    holder = spawn()
    state.add_gpu(uuid="GPU-hotplug")
    state.add_gpu()
    state.gpus[0].base_used = 3 * GIB
    state.add_proc(0, holder.pid, 2 * GIB)
    state.driver_version = "560.28.03"
    state.write(state_path)
    assert nvml.call("count()") == 3
    assert nvml.call("N.nvmlDeviceGetUUID(h(1))") == "GPU-hotplug"
    assert nvml.call("mem(0)")["used"] == 5 * GIB
    assert nvml.call("pids(0)") == [holder.pid]
    assert nvml.call("N.nvmlSystemGetDriverVersion()") == "560.28.03"

    state.remove_proc(holder.pid)
    state.gpus = state.gpus[:1]
    state.write(state_path)
    assert nvml.call("pids(0)") == []
    assert nvml.call("count()") == 1
    assert nvml.error("h(2)").name == "NVMLError_InvalidArgument"


def test_unreadable_or_malformed_state_after_init(start: StartSession, state_path: Path) -> None:
    state = one_gpu()
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    state_path.write_text("driver 1\ngpu 0 uuid=GPU-x name=X pci=nonsense total=1\n")
    assert nvml.error("count()").name == "NVMLError_Unknown"
    assert "nvml-state:2: bad pci bus id 'nonsense'" in nvml.stderr()
    state_path.unlink()
    assert nvml.error("count()").name == "NVMLError_DriverNotLoaded"
    state.write(state_path)
    assert nvml.call("count()") == 1


def test_concurrent_callers_see_whole_states(start: StartSession, state_path: Path) -> None:
    light, heavy = one_gpu(base_used=1 * GIB), one_gpu(base_used=2 * GIB)
    light.write(state_path)
    nvml = start()
    nvml.call("init()")
    nvml.send("hammer(1.0)")
    flips = 0
    while not nvml.ready(0):
        (heavy if flips % 2 == 0 else light).write(state_path)
        flips += 1
        time.sleep(0.002)
    result = nvml.recv()
    assert flips > 10
    assert result == {"seen": [1 * GIB, 2 * GIB], "errors": []}


# ---- what real drivers do that a kind fake would not ----------------------------------


def fd_targets(pid: int) -> list[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    targets = []
    for name in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(fd_dir / name))
        except OSError:
            pass
    return targets


def test_h200_idle_reserved_memory_is_used_only_for_v1(start: StartSession, state_path: Path) -> None:
    """An idle H200: 1 MiB used and ~700 MiB reserved through v2; v1 calls it all used."""
    mib = 1024 * 1024
    one_gpu(name="NVIDIA H200", memory_total=143771 * mib, base_used=1 * mib,
            reserved=700 * mib).write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("mem2(0)") == {"total": 143771 * mib, "reserved": 700 * mib,
                                    "used": 1 * mib, "free": 143070 * mib}
    assert nvml.call("mem(0)") == {"total": 143771 * mib, "used": 701 * mib, "free": 143070 * mib}


def test_library_holds_the_device_nodes_while_initialised(start: StartSession, state_path: Path,
                                                          tmp_path: Path) -> None:
    """libnvidia-ml opens nvidiactl and every GPU node: a process using NVML is a holder."""
    nodes = [tmp_path / "nvidiactl", tmp_path / "nvidia0", tmp_path / "nvidia1"]
    for node in nodes:
        node.touch()
    state = one_gpu()
    state.nodes = [str(n) for n in nodes]
    state.write(state_path)
    nvml = start()
    pid = nvml._proc.pid
    assert not set(map(str, nodes)) & set(fd_targets(pid))
    nvml.call("init()")
    nvml.call("init()")
    assert set(map(str, nodes)) <= set(fd_targets(pid))
    nvml.call("shutdown()")
    assert set(map(str, nodes)) <= set(fd_targets(pid)), "closed before the last shutdown"
    nvml.call("shutdown()")
    assert not set(map(str, nodes)) & set(fd_targets(pid))


def test_raw_pids_are_listed_as_written(start: StartSession, state_path: Path) -> None:
    state = one_gpu()
    for pid in (0, 4294967295, 99999999):
        state.add_proc(0, pid, GIB, raw=True)
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call("pids(0)") == [0, 4294967295, 99999999]
    assert nvml.call("mem(0)")["used"] == 3 * GIB


def test_raw_is_the_only_way_to_list_pid_zero() -> None:
    with pytest.raises(ValueError):
        FakeNvmlState(gpus=[FakeGpu(0, "GPU-x")], procs=[fakenvml.FakeProc(0, 0, GIB)]).render()
    assert "proc 0 0 1 compute release_delay_ms=0 raw" in FakeNvmlState(
        gpus=[FakeGpu(0, "GPU-x")], procs=[fakenvml.FakeProc(0, 0, 1, raw=True)]).render()


DETAIL = (
    "[[p.pid, p.usedGpuMemory] for p in "
    "N.nvmlDeviceGetRunningProcessDetailList(h(0), N.nvmlProcessDetailList_v1, {mode})]"
)


def test_running_process_detail_list(start: StartSession, state_path: Path, spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    state = one_gpu()
    state.add_proc(0, a.pid, 1 * GIB)
    state.add_proc(0, b.pid, 2 * GIB)
    state.add_proc(0, a.pid, 3 * GIB, kind="graphics")
    state.write(state_path)
    nvml = start()
    nvml.call("init()")
    assert nvml.call(DETAIL.format(mode="N.NVML_PROCESS_MODE_COMPUTE")) == [
        [a.pid, 1 * GIB], [b.pid, 2 * GIB]]
    assert nvml.call(DETAIL.format(mode="N.NVML_PROCESS_MODE_GRAPHICS")) == [[a.pid, 3 * GIB]]
    assert nvml.call(DETAIL.format(mode="N.NVML_PROCESS_MODE_MPS")) == []
    err = nvml.error("N.nvmlDeviceGetRunningProcessDetailList(h(0), 0x2000018, 0)")
    assert err.name == "NVMLError_ArgumentVersionMismatch"
    assert nvml.call("hasattr(N.nvmlLib, 'nvmlDeviceGetConfComputeMemSizeInfo')") is True


def test_driver_535_early_v3_stride_makes_pynvml_read_garbage(
        fake_nvml_libdir: Path, state_path: Path, tmp_path: Path, spawn: Spawn) -> None:
    """Drivers 535.43-535.86 write 32-byte entries through the _v3 lists; pynvml reads 24, so
    the third process comes back as pid 4294967295 and the second as pid 0 (nvitop #75, #88)."""
    libdir = build_library(fake_nvml_libdir, "r535")
    assert libdir != fake_nvml_libdir
    a, b, c = spawn(), spawn(), spawn()
    state = one_gpu()
    state.driver_version = "535.54.03"
    for child, used in ((a, 1 * GIB), (b, 2 * GIB), (c, 3 * GIB)):
        state.add_proc(0, child.pid, used)
    state.write(state_path)
    nvml = NvmlSession({**os.environ, **env_for(libdir, state_path)}, tmp_path / "r535.stderr")
    try:
        nvml.call("init()")
        listed = nvml.call("pids(0)")
        assert listed[0] == a.pid and listed[1] == 0 and listed[2] == 4294967295, listed
        assert nvml.call("hasattr(N.nvmlLib, 'nvmlDeviceGetRunningProcessDetailList')") is False
        assert nvml.call("hasattr(N.nvmlLib, 'nvmlDeviceGetConfComputeMemSizeInfo')") is True
        # The same call read with the stride the driver used gives the real pids.
        wide = nvml.call(
            "(lambda S: (lambda n, buf: (N.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3("
            "h(0), byref(n), buf), [e.pid for e in buf[:n.value]])[1])(c_uint(8), (S * 8)()))"
            "(type('W', (ctypes.Structure,), {'_fields_': [('pid', c_uint), ('used', c_ulonglong),"
            " ('gi', c_uint), ('ci', c_uint), ('cc', c_ulonglong)]}))")
        assert wide == [a.pid, b.pid, c.pid]
    finally:
        nvml.close()

"""Shared fixtures: a fake GPU host (device nodes, fake NVML, config) and real holder processes.

Device nodes use major 120 (reserved for local use, no driver on any machine) with minors drawn
at random per host, so nothing outside the test, not even another test run on the same machine,
holds the same device. They can only be opened O_PATH, which looks the same in /proc/<pid>/fd.
A process that holds a node by its mapping alone needs a node a driver can mmap:
`GpuHost.mappable_uvm()` makes one with /dev/zero's numbers, in a directory of its own.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fakenvml import FakeNvmlState, build_library, process_env

# Every run, whatever its selection, is held to leaving nothing behind (tests/leftovers.py).
from tests.leftovers import pytest_configure, pytest_sessionfinish  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
HOLDER = Path(__file__).resolve().parent / "holder.py"
MiB = 1024 * 1024
GiB = 1024 * MiB

NODES = {
    "nvidia0": (120, 0),
    "nvidia1": (120, 1),
    "nvidiactl": (120, 255),
    "nvidia-modeset": (120, 254),
    "nvidia-uvm": (120, 253),
}


def node_numbers() -> dict[str, tuple[int, int]]:
    """NODES with the major-120 minors moved to a random block: two test runs on one machine
    (or a leftover from a killed one) then never see each other's holders by device number.
    The GPU minor comes from the node's name, since major 120 is no NVIDIA driver's."""
    base = random.randrange(1, 1 << 18) * 4
    return {name: (major, base + i if major == 120 else minor)
            for i, (name, (major, minor)) in enumerate(NODES.items())}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """The one rule for skips. A test skips where what it needs is missing (root, a tool):
    fine on a developer's machine, a failure in CI (CI is set: .ci/run), which runs as root
    with everything `make deps` installs, so a skip there is a test that did not run. A
    test in tests/unit needs neither root nor a service, so its skip fails everywhere."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        unit = item.nodeid.startswith("tests/unit/")
        if os.environ.get("CI") or unit:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = (
                f"a unit test skipped ({reason}): tests/unit needs no root and no service (else "
                "move it to its kind), and its tools come from make deps" if unit else
                f"skipped in CI ({reason}): CI runs as root and make deps installs every tool")
    return report


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the suite needs root (mknod, signalling, cgroups); CI runs as root")


@pytest.fixture(scope="session")
def fake_nvml_libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is required to build the fake NVML library (make deps installs it)")
    return build_library(tmp_path_factory.mktemp("fakenvml"))


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    pid: int
    zombie: int = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=10)


@dataclass
class GpuHost:
    root: Path
    dev: Path
    config_path: Path
    state_path: Path
    libdir: Path
    state: FakeNvmlState
    procs: list[Proc] = field(default_factory=list)
    config_extra: str = ""

    def node(self, name: str) -> str:
        return str(self.dev / name)

    def mappable_uvm(self) -> str:
        """An nvidia-uvm node that can really be mapped ((1,5), /dev/zero's driver), in its own
        directory; callers add `dirname/nvidia*` to the watched paths. Any other holder of a
        (1,5) node would match it too, so only tests that sweep nothing use it."""
        directory = self.root / "mappable"
        directory.mkdir(exist_ok=True)
        path = directory / "nvidia-uvm"
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(1, 5))
        return str(path)

    @property
    def env(self) -> dict[str, str]:
        return process_env(self.libdir, self.state_path, ROOT)

    def publish(self) -> None:
        self.state.write(self.state_path)

    def write_config(self, extra: str = "") -> None:
        self.config_extra = extra
        self.config_path.write_text(
            "[Devices]\n"
            # Only this host's nodes (not the machine's /dev/nvidia*), of the local-use majors:
            # 120 here, 122 for tests/dbus_harness.py's private GPU.
            "Paths=\n"
            f"Paths={self.dev}/nvidia*\n"
            "AllowMajors=120 122\n"
            "[Sweep]\n"
            "GraceSec=2\n"
            "KillTimeoutSec=3\n"
            "VerifyTimeoutSec=3\n"
            "ReleasedBelowMiB=64\n"
            "[Daemon]\n"
            f"RuntimeDirectory={self.root}/run\n"
            f"StateDirectory={self.root}/state\n" + extra)

    def spawn(self, *args: str, exe: str | None = None, nvml: tuple[int, int] | None = None,
              release_delay_ms: int = 0, kind: str = "compute") -> Proc:
        """Start tests/holder.py with `args`; `nvml=(gpu, bytes)` lists it in the fake NVML."""
        proc = self.start([exe or sys.executable, str(HOLDER), *args])
        if nvml is not None:
            self.state.add_proc(nvml[0], proc.pid, nvml[1], kind=kind,  # type: ignore[arg-type]
                                release_delay_ms=release_delay_ms)
            self.publish()
        return proc

    def start(self, argv: list[str] | list[bytes], pass_fds: Sequence[int] = ()) -> Proc:
        """Run a holder (argv runs tests/holder.py) until it says "ready <pid> [zombie=N]";
        it is ended with the host. `pass_fds`: open files it inherits."""
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)
        assert popen.stdout is not None
        line = popen.stdout.readline().split()
        assert line and line[0] == "ready", f"holder did not start: {line}"
        proc = Proc(popen, int(line[1]))
        # Reap it the moment it exits, as systemd would: an unreaped zombie still counts as
        # alive for the fake NVML (kill(pid, 0) succeeds), which no real service leaves behind.
        threading.Thread(target=popen.wait, daemon=True).start()
        for word in line[2:]:
            if word.startswith("zombie="):
                proc.zombie = int(word.split("=", 1)[1])
        self.procs.append(proc)
        return proc

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuguardd.cli.main", *args, "--local", "--config",
             str(self.config_path)],
            check=False, env=self.env, capture_output=True, text=True, timeout=timeout)


def make_host(root: Path, libdir: Path) -> GpuHost:
    dev = root / "dev"
    dev.mkdir()
    for name, (major, minor) in node_numbers().items():
        os.mknod(dev / name, 0o666 | 0o020000, os.makedev(major, minor))
    state = FakeNvmlState()
    state.add_gpu(minor=0, memory_total=80 * GiB)
    state.add_gpu(minor=1, memory_total=80 * GiB)
    # Like libnvidia-ml, the fake holds nvidiactl and every GPU's node while initialised: every
    # process that uses NVML (gpuguardd, gpuguardctl --local, an in-process engine) is a holder.
    state.nodes = [str(dev / name) for name in ("nvidiactl", "nvidia0", "nvidia1")]
    host = GpuHost(root=root, dev=dev, config_path=root / "gpuguard.conf",
                   state_path=root / "nvml.state", libdir=libdir, state=state)
    host.write_config()
    host.publish()
    return host


@pytest.fixture
def gpu_host(tmp_path: Path, fake_nvml_libdir: Path) -> Iterator[GpuHost]:
    require_root()
    host = make_host(tmp_path, fake_nvml_libdir)
    try:
        yield host
    finally:
        for proc in host.procs:
            proc.stop()


@pytest.fixture
def inproc_nvml(gpu_host: GpuHost, monkeypatch: pytest.MonkeyPatch) -> GpuHost:
    """Point this process's real pynvml at the fake library and this test's state file.

    pynvml loads libnvidia-ml.so.1 once per process through LD_LIBRARY_PATH, which cannot be
    changed after start-up; handing pynvml the already-loaded library is the supported seam
    (`nvmlLib` is what `_LoadNvmlLibrary` fills in).
    """
    import ctypes

    import pynvml

    monkeypatch.setenv("FAKE_NVML_STATE", str(gpu_host.state_path))
    if pynvml.nvmlLib is None:
        pynvml.nvmlLib = ctypes.CDLL(str(gpu_host.libdir / "libnvidia-ml.so.1"))
    return gpu_host


@dataclass
class CgroupDir:
    """A directory in the named systemd v1 hierarchy, so /proc/<pid>/cgroup shows a unit path."""

    path: Path

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))


@pytest.fixture
def systemd_cgroup() -> Iterator[Callable[[str], CgroupDir]]:
    """Make cgroups like systemd's (`system.slice/x.service`, `lxc/129/...`) for attribution.

    Uses the name=systemd v1 hierarchy where it is mounted (hybrid hosts, these CI machines);
    otherwise the v2 root. Each is removed after the test, its remaining processes moved to
    the root; what stays (another run's child in a shared parent) tests/leftovers.py lists.
    """
    base = None
    for candidate in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(candidate, "cgroup.procs")):
            base = Path(candidate)
            break
    if base is None:
        pytest.fail("no writable cgroup hierarchy to place test processes in")
    made: list[Path] = []

    def make(relative: str) -> CgroupDir:
        path = base / relative.strip("/")
        parts = Path(relative.strip("/")).parts
        for i in range(1, len(parts) + 1):
            p = base.joinpath(*parts[:i])
            try:
                p.mkdir()
                made.append(p)
            except FileExistsError:
                pass  # ours from an earlier level, or another run's: removed by whoever made it
        return CgroupDir(path)

    yield make
    for path in reversed(made):
        # A process the test leaves running (ended later by gpu_host's teardown, which comes
        # after this one) would keep its cgroup forever: it moves to the root first.
        try:
            pids = (path / "cgroup.procs").read_text().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                (base / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # gone meanwhile
        for _ in range(100):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


@contextmanager
def v1_freezer(name: str) -> Iterator[Path]:
    """A fresh cgroup in the host's v1 freezer: a process frozen there sleeps uninterruptibly
    and no signal ends it until it is thawed (a worker stuck in the driver). Thawed and
    removed afterwards."""
    freezer = Path("/sys/fs/cgroup/freezer")
    if not (freezer / "cgroup.procs").exists():
        pytest.fail("the v1 freezer (needed to make a process that survives SIGKILL) is not mounted")
    path = freezer / name
    path.mkdir()
    try:
        yield path
    finally:
        (path / "freezer.state").write_text("THAWED")
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture
def frozen_cgroup() -> Iterator[Path]:
    with v1_freezer(f"gg-test-{os.getpid()}") as path:
        yield path

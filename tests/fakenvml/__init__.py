"""Fake NVML for tests: build the C library and describe the GPUs it reports.

``fake_nvml.c`` compiles into a ``libnvidia-ml.so.1`` that the real, unmodified
pynvml loads when its directory leads ``LD_LIBRARY_PATH``.  What it reports
comes from a text state file that it re-reads on every call, so a test can
change GPUs and processes underneath a running daemon.  The dynamic loader
reads ``LD_LIBRARY_PATH`` only at process start and pynvml keeps the library
it loaded for the life of the process, so code under test must run in a
subprocess started with :func:`env_for`.

Typical use::

    libdir = build_library(tmp_path / "lib")
    state = FakeNvmlState()
    state.add_gpu()
    state.add_proc(gpu=0, pid=child.pid, used=4 * GIB)
    state.write(tmp_path / "state")
    subprocess.run(cmd, env={**os.environ, **env_for(libdir, tmp_path / "state")})
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "CALLS_ENV",
    "DEFAULT_GPU_NAME",
    "EVENTS_ENV",
    "GIB",
    "LIBRARY_NAME",
    "STATE_ENV",
    "FakeGpu",
    "FakeMig",
    "FakeNvmlBuildError",
    "FakeNvmlState",
    "FakeProc",
    "ProcKind",
    "Variant",
    "build_library",
    "calls_per_gpu",
    "env_for",
]

GIB = 2**30
LIBRARY_NAME = "libnvidia-ml.so.1"
STATE_ENV = "FAKE_NVML_STATE"
# A file that gets "dead PID NS" (CLOCK_MONOTONIC) when the library first finds a pid gone.
EVENTS_ENV = "FAKE_NVML_EVENTS"
# A file that gets a line "<gpu index> <function>" per NVML call naming a GPU (count_call in
# fake_nvml.c): what a test reads to prove a GPU was never asked.
CALLS_ENV = "FAKE_NVML_CALLS"
DEFAULT_GPU_NAME = "NVIDIA H100 80GB HBM3"
SOURCE = Path(__file__).with_name("fake_nvml.c")

ProcKind = Literal["compute", "graphics", "mps"]
# "": a current driver (550). "r535": drivers 535.43-535.86, whose _v3 process lists write
# 32-byte entries where pynvml reads 24 and which lack nvmlDeviceGetRunningProcessDetailList.
Variant = Literal["", "r535"]
_VARIANT_FLAGS: dict[str, list[str]] = {"": [], "r535": ["-DFAKE_NVML_R535_EARLY"]}
_PROC_KINDS: frozenset[str] = frozenset(("compute", "graphics", "mps"))

# The limits fake_nvml.c enforces, checked here as well so that a bad state
# fails in the test that built it rather than as NVML_ERROR_UNKNOWN from
# whatever the code under test happened to call next.
_MAX_GPUS = 64
_MAX_PROCS = 4096
MIG_SLOTS = 7  # nvmlDeviceGetMaxMigDeviceCount on A100/H100/H200
_MAX_UUID_LEN = 95
_MAX_NAME_LEN = 95
_MAX_DRIVER_LEN = 79
_MAX_FUNCTION_LEN = 127
_PCI_RE = re.compile(r"[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[01]?[0-9A-Fa-f]\.[0-7]")
_TOKEN_RE = re.compile(r"[^\s#=]+")
_FUNCTION_RE = re.compile(r"nvml\w+")
_MAX_NODES = 64
_MAX_NODE_PATH = 511


class FakeNvmlBuildError(RuntimeError):
    """The fake library could not be compiled."""


def build_library(outdir: Path, variant: Variant = "") -> Path:
    """Compile ``fake_nvml.c`` into ``outdir/libnvidia-ml.so.1``.

    Returns the directory to put first on ``LD_LIBRARY_PATH``.  An existing
    library newer than the source is reused, so a session-scoped fixture and
    repeated calls cost one compile.  A ``variant`` other than the default
    is built in a subdirectory named for it (the one returned), so the two
    never stand in for each other.
    """
    if variant not in _VARIANT_FLAGS:
        raise ValueError(f"unknown fake NVML variant {variant!r}")
    if variant:
        outdir = outdir / variant
    outdir.mkdir(parents=True, exist_ok=True)
    target = outdir / LIBRARY_NAME
    if target.exists() and target.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns:
        return outdir

    gcc = shutil.which("gcc")
    if gcc is None:
        raise FakeNvmlBuildError("gcc not found on PATH; it is needed to build the fake NVML")

    # Compile beside the target and rename into place, so parallel test
    # workers sharing outdir never dlopen a half-written library.
    fd, tmp_name = tempfile.mkstemp(prefix=".fake_nvml.", suffix=".so", dir=outdir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run(
            [
                gcc,
                "-std=c99",
                "-shared",
                "-fPIC",
                "-O2",
                "-Wall",
                "-Wextra",
                "-pthread",
                *_VARIANT_FLAGS[variant],
                "-o",
                str(tmp),
                str(SOURCE),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise FakeNvmlBuildError(f"gcc failed (exit {result.returncode}) building {SOURCE}:\n{result.stderr}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return outdir


def env_for(libdir: Path, state_path: Path) -> dict[str, str]:
    """Environment variables that point a new process at the fake NVML.

    Merge them over ``os.environ``; any ``LD_LIBRARY_PATH`` already set is
    kept, after ``libdir``, so the fake wins over an installed driver.
    """
    inherited = os.environ.get("LD_LIBRARY_PATH", "")
    search = str(libdir) if not inherited else f"{libdir}{os.pathsep}{inherited}"
    return {"LD_LIBRARY_PATH": search, STATE_ENV: str(state_path)}


def calls_per_gpu(path: Path) -> dict[int, int]:
    """{GPU index: NVML calls that named it} from a ``CALLS_ENV`` file (absent: none)."""
    counts: dict[int, int] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return counts
    for line in text.splitlines():
        index = int(line.split(" ", 1)[0])
        counts[index] = counts.get(index, 0) + 1
    return counts


def process_env(libdir: Path, state_path: Path, pythonpath: Path) -> dict[str, str]:
    """This process's environment plus env_for() and PYTHONPATH: for a gpuguard subprocess."""
    env = dict(os.environ)
    env.update(env_for(libdir, state_path))
    env["PYTHONPATH"] = str(pythonpath)
    return env


def _check_token(what: str, value: str, max_len: int) -> None:
    # The file is whitespace-separated key=value text: a space, '#' or '='
    # inside a value would silently change what the library reads.
    if not value.isascii() or not _TOKEN_RE.fullmatch(value) or len(value) > max_len:
        raise ValueError(f"{what} {value!r} must be 1-{max_len} ASCII characters without whitespace, '#' or '='")


@dataclass
class FakeGpu:
    """One GPU as the fake NVML reports it.

    ``minor`` defaults to ``index`` and ``pci_bus_id`` to a distinct bus per
    index.  ``base_used`` is memory in use with no process to show for it: a
    driver reservation, or a leak gpuguard has to notice.  A ``lost`` GPU
    still enumerates but answers every query with NVML_ERROR_GPU_IS_LOST; a
    non-zero ``handle_error`` makes nvmlDeviceGetHandleByIndex fail for it with
    that code (15 GPU_IS_LOST, 999 UNKNOWN, 4 NO_PERMISSION), as some drivers do.
    ``reserved`` is the driver's own reservation: apart in
    nvmlDeviceGetMemoryInfo_v2, counted as used by the v1 call.
    """

    index: int
    uuid: str
    name: str = DEFAULT_GPU_NAME
    minor: int | None = None
    pci_bus_id: str | None = None
    memory_total: int = 80 * GIB
    base_used: int = 0
    lost: bool = False
    handle_error: int = 0
    reserved: int = 0
    # None: the GPU cannot do MIG; True/False: MIG mode on/off. In MIG mode the parent's
    # process lists are empty unless mig_parent_lists is "aggregate" (what root sees).
    mig: bool | None = None
    mig_parent_lists: Literal["empty", "aggregate"] = "empty"
    # Persistence mode at start (nvmlDeviceSetPersistenceMode then keeps its own record, which
    # tests/fakenvml/nvidia-smi reads); nvlink: active NVLink links (None: no NVLink).
    persistence: bool = False
    nvlink: int | None = None

    def __post_init__(self) -> None:
        if self.minor is None:
            self.minor = self.index
        if self.pci_bus_id is None:
            self.pci_bus_id = f"00000000:{self.index + 1:02X}:00.0"

    def _line(self) -> str:
        _check_token("uuid", self.uuid, _MAX_UUID_LEN)
        # '_' stands for a space in the file, so a literal one would come
        # back as a space; no NVIDIA product name contains one.
        if "_" in self.name:
            raise ValueError(f"GPU name {self.name!r} must not contain '_'")
        file_name = self.name.replace(" ", "_")
        _check_token("GPU name", file_name, _MAX_NAME_LEN)
        pci = self.pci_bus_id
        if pci is None or not _PCI_RE.fullmatch(pci):
            raise ValueError(f"pci_bus_id {pci!r} is not domain:bus:device.function")
        minor = self.index if self.minor is None else self.minor
        for what, number in (
            ("minor", minor),
            ("memory_total", self.memory_total),
            ("base_used", self.base_used),
            ("reserved", self.reserved),
        ):
            if number < 0:
                raise ValueError(f"GPU {self.index}: {what} must not be negative, got {number}")
        line = (
            f"gpu {self.index} uuid={self.uuid} name={file_name} minor={minor}"
            f" pci={pci} total={self.memory_total} used={self.base_used}"
        )
        if self.handle_error:
            line += f" handle_error={FakeNvmlState._code('handle_error', self.handle_error)}"
        if self.reserved:
            line += f" reserved={self.reserved}"
        if self.mig is not None:
            line += f" mig={'on' if self.mig else 'off'} mig_parent_lists={self.mig_parent_lists}"
        if self.persistence:
            line += " persistence=on"
        if self.nvlink is not None:
            if not 0 <= self.nvlink <= 18:
                raise ValueError(f"GPU {self.index}: nvlink must be 0-18 active links, got {self.nvlink}")
            line += f" nvlink={self.nvlink}"
        return line + " lost" if self.lost else line


@dataclass
class FakeMig:
    """A MIG device of GPU ``gpu``, found by nvmlDeviceGetMigDeviceHandleByIndex at ``slot``
    (0-6; gaps are allowed, as on real drivers), with its own memory."""

    gpu: int
    slot: int
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    memory_total: int = 10 * GIB
    base_used: int = 0

    def _line(self) -> str:
        _check_token("uuid", self.uuid, _MAX_UUID_LEN)
        if not 0 <= self.slot < MIG_SLOTS:
            raise ValueError(f"MIG slot {self.slot} is not 0-{MIG_SLOTS - 1}")
        for what, number in (("gpu_instance_id", self.gpu_instance_id),
                             ("compute_instance_id", self.compute_instance_id),
                             ("memory_total", self.memory_total), ("base_used", self.base_used)):
            if number < 0:
                raise ValueError(f"MIG {self.uuid}: {what} must not be negative, got {number}")
        return (f"mig {self.gpu} {self.slot} uuid={self.uuid} gi={self.gpu_instance_id}"
                f" ci={self.compute_instance_id} total={self.memory_total} used={self.base_used}")


@dataclass
class FakeProc:
    """A process holding ``used`` bytes on GPU ``gpu``.

    The library checks ``pid`` with ``kill(pid, 0)`` on every call: while
    it exists (zombies included) the memory is in use and the process is
    listed; once gone, both last ``release_delay_ms`` more, timed from the
    first call that found it gone. ``listed_ms``, when set, is how long of
    that it stays listed: real drivers can drop a process from their lists
    while its memory is still held.  A ``raw`` one is listed as written,
    any 32-bit value and never checked for liveness: the garbage a driver
    can return (pid 0, 4294967295, a pid of another PID namespace).
    ``host_pid`` is the foreign-PID mode, for a caller in its own PID
    namespace (a daemon in a container): ``pid`` is the process as that
    caller sees it, which liveness follows, and the lists show ``host_pid``,
    as a real driver shows the host's pid to every caller.  Records of one
    listed pid on one GPU (or instance), e.g. compute and graphics, are one
    process: its memory counts once (the largest record), as on a driver.
    """

    gpu: int
    pid: int
    used: int
    kind: ProcKind = "compute"
    release_delay_ms: int = 0
    listed_ms: int | None = None
    raw: bool = False
    mig_slot: int | None = None  # the MIG instance (slot on ``gpu``) it runs in
    host_pid: int | None = None
    # After the delay the memory falls to nothing over release_ms, then wobble bytes are in
    # use again for wobble_ms before it settles (fake_nvml.c's header comment).
    release_ms: int = 0
    wobble: int = 0
    wobble_ms: int = 0

    def _line(self) -> str:
        if self.kind not in _PROC_KINDS:
            raise ValueError(f"proc kind {self.kind!r} is not one of {sorted(_PROC_KINDS)}")
        # pid 0 and negative pids would make kill(pid, 0) probe a process
        # group, never this process.
        if not (0 <= self.pid <= 2**32 - 1 if self.raw else 0 < self.pid <= 2**31 - 1):
            raise ValueError(f"pid {self.pid} is not a valid process id")
        if self.used < 0 or self.release_delay_ms < 0:
            raise ValueError(f"pid {self.pid}: used and release_delay_ms must not be negative")
        line = f"proc {self.gpu} {self.pid} {self.used} {self.kind} release_delay_ms={self.release_delay_ms}"
        if self.listed_ms is not None:
            if self.listed_ms < 0:
                raise ValueError(f"pid {self.pid}: listed_ms must not be negative")
            line += f" listed_ms={self.listed_ms}"
        if self.mig_slot is not None:
            line += f" mig={self.mig_slot}"
        if self.host_pid is not None:
            if self.raw or not 0 < self.host_pid <= 2**31 - 1:
                raise ValueError(f"pid {self.pid}: bad host_pid {self.host_pid} (or a raw record)")
            line += f" host_pid={self.host_pid}"
        for key in ("release_ms", "wobble", "wobble_ms"):
            value = getattr(self, key)
            if value < 0:
                raise ValueError(f"pid {self.pid}: {key} must not be negative")
            if value:
                line += f" {key}={value}"
        return line + " raw" if self.raw else line


@dataclass
class FakeNvmlState:
    """Everything the fake NVML reports; :meth:`write` publishes it.

    ``init_error``, when non-zero, is what nvmlInit returns.  ``fail`` maps an
    exported function name (e.g. ``"nvmlDeviceGetComputeRunningProcesses_v3"``)
    to the NVML return code it is forced to give. ``hang`` lists
    ``(function, ms, gpu)``: calls of that function (for that GPU, or any when
    ``gpu`` is None) block for ``ms`` milliseconds, holding the library's lock.
    ``nodes`` are device nodes the library opens at nvmlInit and holds until
    the last nvmlShutdown, as libnvidia-ml does.
    """

    driver_version: str = "550.54.15"
    gpus: list[FakeGpu] = field(default_factory=list)
    procs: list[FakeProc] = field(default_factory=list)
    migs: list[FakeMig] = field(default_factory=list)
    init_error: int = 0
    fail: dict[str, int] = field(default_factory=dict)
    hang: list[tuple[str, int, int | None]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)

    def add_gpu(
        self,
        *,
        uuid: str | None = None,
        name: str = DEFAULT_GPU_NAME,
        minor: int | None = None,
        pci_bus_id: str | None = None,
        memory_total: int = 80 * GIB,
        base_used: int = 0,
        lost: bool = False,
        handle_error: int = 0,
        reserved: int = 0,
    ) -> FakeGpu:
        """Append a GPU at the next index; ``uuid`` defaults to one derived from it."""
        index = len(self.gpus)
        gpu = FakeGpu(
            index=index,
            uuid=uuid if uuid is not None else f"GPU-00000000-0000-4000-8000-{index:012x}",
            name=name,
            minor=minor,
            pci_bus_id=pci_bus_id,
            memory_total=memory_total,
            base_used=base_used,
            lost=lost,
            handle_error=handle_error,
            reserved=reserved,
        )
        self.gpus.append(gpu)
        return gpu

    def add_mig(self, gpu: int, uuid: str, gpu_instance_id: int, compute_instance_id: int = 0,
                slot: int | None = None, memory_total: int = 10 * GIB, base_used: int = 0) -> FakeMig:
        """Add a MIG device to GPU ``gpu`` (turning its MIG mode on), at the next free slot
        unless ``slot`` is given."""
        if not 0 <= gpu < len(self.gpus):
            raise ValueError(f"no GPU {gpu}; add it first (have {len(self.gpus)})")
        self.gpus[gpu].mig = True
        used = {m.slot for m in self.migs if m.gpu == gpu}
        if slot is None:
            slot = min(set(range(MIG_SLOTS)) - used)
        elif slot in used:
            raise ValueError(f"GPU {gpu} already has a MIG device in slot {slot}")
        mig = FakeMig(gpu=gpu, slot=slot, uuid=uuid, gpu_instance_id=gpu_instance_id,
                      compute_instance_id=compute_instance_id, memory_total=memory_total,
                      base_used=base_used)
        self.migs.append(mig)
        return mig

    def add_proc(
        self,
        gpu: int,
        pid: int,
        used: int,
        kind: ProcKind = "compute",
        release_delay_ms: int = 0,
        listed_ms: int | None = None,
        raw: bool = False,
        mig: str | None = None,
        host_pid: int | None = None,
        release_ms: int = 0,
        wobble: int = 0,
        wobble_ms: int = 0,
    ) -> FakeProc:
        """Add a process holding ``used`` bytes on GPU ``gpu`` (in its MIG device ``mig``, by
        UUID, on a GPU in MIG mode)."""
        if not 0 <= gpu < len(self.gpus):
            raise ValueError(f"no GPU {gpu}; add it first (have {len(self.gpus)})")
        slot = None
        if mig is not None:
            found = [m.slot for m in self.migs if m.gpu == gpu and m.uuid == mig]
            if not found:
                raise ValueError(f"GPU {gpu} has no MIG device {mig}")
            slot = found[0]
        proc = FakeProc(gpu=gpu, pid=pid, used=used, kind=kind, release_delay_ms=release_delay_ms,
                        listed_ms=listed_ms, raw=raw, mig_slot=slot, host_pid=host_pid,
                        release_ms=release_ms, wobble=wobble, wobble_ms=wobble_ms)
        self.procs.append(proc)
        return proc

    def remove_proc(self, pid: int) -> None:
        """Drop every record for ``pid``, on all GPUs and of every kind."""
        kept = [p for p in self.procs if p.pid != pid]
        if len(kept) == len(self.procs):
            raise KeyError(f"no proc with pid {pid}")
        self.procs = kept

    def render(self) -> str:
        """The state file text; raises ValueError if the library would reject it."""
        _check_token("driver_version", self.driver_version, _MAX_DRIVER_LEN)
        if len(self.gpus) > _MAX_GPUS or len(self.procs) > _MAX_PROCS:
            raise ValueError(f"at most {_MAX_GPUS} GPUs and {_MAX_PROCS} procs")
        # The library numbers GPUs by their order in the file, so a gap or
        # reordering here would silently shift every later GPU's identity.
        indices = [g.index for g in self.gpus]
        if indices != list(range(len(self.gpus))):
            raise ValueError(f"GPU indices must be 0..{len(self.gpus) - 1} in order, got {indices}")
        lines = [f"driver {self.driver_version}"]
        if self.init_error:
            lines.append(f"init_error {self._code('init_error', self.init_error)}")
        for function, code in self.fail.items():
            if not _FUNCTION_RE.fullmatch(function) or len(function) > _MAX_FUNCTION_LEN:
                raise ValueError(f"fail: {function!r} is not an NVML function name")
            lines.append(f"fail {function} {self._code(function, code)}")
        for function, ms, gpu in self.hang:
            if not _FUNCTION_RE.fullmatch(function) or len(function) > _MAX_FUNCTION_LEN:
                raise ValueError(f"hang: {function!r} is not an NVML function name")
            if ms < 0 or (gpu is not None and not 0 <= gpu < _MAX_GPUS):
                raise ValueError(f"hang {function}: bad time {ms} or GPU {gpu}")
            lines.append(f"hang {function} {ms}" + ("" if gpu is None else f" {gpu}"))
        if len(self.nodes) > _MAX_NODES:
            raise ValueError(f"at most {_MAX_NODES} nodes")
        for node in self.nodes:
            _check_token("node", node, _MAX_NODE_PATH)
            lines.append(f"node {node}")
        lines.extend(g._line() for g in self.gpus)
        # The library wants instances after their GPU and before the procs that name them.
        lines.extend(m._line() for m in self.migs)
        for proc in self.procs:
            if not 0 <= proc.gpu < len(self.gpus):
                raise ValueError(f"pid {proc.pid} is on GPU {proc.gpu}, which does not exist")
            lines.append(proc._line())
        return "\n".join(lines) + "\n"

    @staticmethod
    def _code(what: str, code: int) -> int:
        if not 0 <= code <= 2**31 - 1:
            raise ValueError(f"{what}: {code} is not an NVML return code")
        return code

    def write(self, path: Path) -> None:
        """Publish the state to ``path`` atomically.

        The library may read the file at any instant from another process;
        replacing it whole means it sees the old state or the new, never a
        torn one.
        """
        text = self.render()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        tmp = Path(tmp_name)
        try:
            # mkstemp creates 0600; the reader may be a daemon running as
            # another user.
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

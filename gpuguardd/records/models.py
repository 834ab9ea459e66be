"""Plain data passed between the engine's modules, the service and the CLI."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from gpuguardd.records.codec import WireRecord
from gpuguardd.records.enums import GpusFrom, GpuState, HolderKind, RequesterKind, SpareReason, Vendor

if TYPE_CHECKING:
    from gpuguardd.records.report import ReportScope


@dataclass(frozen=True)
class DeviceNode:
    path: str
    role: str  # gpu, control, uvm, modeset, caps, other
    minor: int | None = None  # the GPU's minor number, for role "gpu"
    rdev: int | None = None  # for character devices
    inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the node itself, for mmaps


@dataclass
class MigInstance:
    """A compute instance in a GPU instance of a GPU in MIG mode."""

    uuid: str  # "MIG-...", what users name it by
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int = 0
    memory_used: int = 0
    error: str = ""
    processes: dict[int, int | None] = field(default_factory=dict)  # as GpuInfo.processes
    device_path: str = ""  # the caps node its processes open (/dev/nvidia-caps/nvidia-capN)


@dataclass
class GpuInfo:
    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    minor: int | None = None
    memory_total: int = 0
    memory_used: int = 0
    lost: bool = False
    unknown: bool = False  # state unreadable (GpuState.UNKNOWN); memory_used means nothing then
    suspended: bool = False  # runtime-suspended (driverinfo.py): not woken; memory as last read
    error: str = ""
    # pid -> bytes (None: NVML does not know), over compute/graphics/MPS, each process once
    # (nvmlprocs.merge); in MIG mode also every instance's, as the parent's may be empty.
    processes: dict[int, int | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # entries of NVML's lists left out
    mig_mode: bool = False
    mig: list[MigInstance] = field(default_factory=list)
    vendor: Vendor = Vendor.NVIDIA
    card_minor: int | None = None  # AMD: card<N>'s (`minor` is renderD<minor>'s); None without one
    gpu_id: int = 0  # AMD: KFD's (0 without KFD: an APU or Radeon card driven by DRM alone)
    released_below: int | None = None  # bytes, where the backend knows better ([Sweep] AmdReleasedBelowMiB)

    @property
    def device_path(self) -> str:
        if self.minor is None:
            return ""
        return f"/dev/dri/renderD{self.minor}" if self.vendor == Vendor.AMD else f"/dev/nvidia{self.minor}"


@dataclass
class MigSummary(WireRecord):
    """One MIG instance as its GPU object's MigInstances shows it (gpustate.mig_summaries)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"leak_kind"})

    uuid: str = ""
    gpu_instance_id: int = 0
    compute_instance_id: int = 0
    device_path: str = ""
    memory_total: int = 0
    memory_used: int = 0
    holder_count: int = 0
    state: GpuState = field(default=GpuState.UNKNOWN, metadata={"unread": GpuState.UNKNOWN})  # never "idle"
    leak_kind: str = ""  # a LeakKind while state is "leaked" (engine/judge.py), else ""


@dataclass
class GpuSummary(WireRecord):
    """A GPU as its D-Bus object and `gpuguardctl gpus` show it (gpustate.gpu_summaries)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"mig_mode", "mig_instances", "leak_kind", "vendor"})

    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    minor: int = 0
    device_path: str = ""
    memory_total: int = 0
    memory_used: int = 0
    holder_count: int = 0
    state: GpuState = field(default=GpuState.UNKNOWN, metadata={"unread": GpuState.UNKNOWN})
    error: str = ""
    mig_mode: bool | None = None  # None: not known (no NVML: GPUs from device nodes alone)
    mig_instances: list[MigSummary] | None = None
    leak_kind: str = ""  # a LeakKind while state is "leaked" (engine/judge.py), else ""
    vendor: Vendor = Vendor.NVIDIA
    # Bytes, judge.released_line; not sent: the gate beside the scan must not wait on an idle AMD GPU's VRAM.
    released_below: int = field(default=0, metadata={"wire": False})


@dataclass
class NvmlSnapshot:
    available: bool
    error: str = ""
    driver_version: str = ""
    gpus: list[GpuInfo] = field(default_factory=list)
    pids_local: bool = True  # False when NVML's (host) PIDs are not this /proc's

    @property
    def gpus_known(self) -> bool:
        return self.available or any(g.vendor == Vendor.AMD for g in self.gpus)

    @property
    def vendors(self) -> list[str]:
        """Manager.Vendors: NVIDIA while NVML answers, even with no GPU listed (a GPU may come)."""
        return sorted({str(gpu.vendor) for gpu in self.gpus} | ({str(Vendor.NVIDIA)} if self.available else set()))

    def by_index(self, index: int) -> GpuInfo | None:
        return next((gpu for gpu in self.gpus if gpu.index == index), None)

    def mig_instance(self, uuid: str) -> tuple[GpuInfo, MigInstance] | None:
        return next(((gpu, mig) for gpu in self.gpus for mig in gpu.mig if mig.uuid.lower() == uuid.lower()), None)

    def index_for_minor(self, minor: int, vendor: Vendor = Vendor.NVIDIA) -> int | None:
        return next((gpu.index for gpu in self.gpus if gpu.vendor == vendor
                     and minor in (gpu.minor, gpu.card_minor if vendor == Vendor.AMD else None)), None)


@dataclass
class Holder(WireRecord):
    """A process holding a GPU device or listed by NVML: a ListHolders entry."""

    pid: int
    comm: str = ""
    exe: str = ""
    cmdline: str = ""
    uid: int = 0
    user: str = ""
    unit: str = ""
    cgroup: str = ""
    container: str = ""
    devices: list[str] = field(default_factory=list)
    how: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)  # for display: nvml_gpus, else node_gpus
    nvml_gpus: list[int] = field(default_factory=list)  # the GPUs NVML lists it on
    node_gpus: list[int] = field(default_factory=list)  # the GPUs whose nodes it holds
    gpus_from: GpusFrom = GpusFrom.NONE
    mig: list[str] = field(default_factory=list)  # MIG UUIDs of the instances it runs in
    gpu_memory: int = 0
    state: str = ""
    kind: HolderKind = HolderKind.MANAGEMENT
    protected: bool = False
    protected_why: str = ""
    ppid: int = 0
    # Not sent, not stored: protected_why's code (protection.py), for the report's spared entry.
    protected_code: SpareReason | None = field(default=None, metadata={"wire": False})
    start_time: int = field(default=0, metadata={"wire": False})  # ticks after boot, stat field 22
    roles: list[str] = field(default_factory=list, metadata={"wire": False})


@dataclass
class ScanResult:
    holders: list[Holder]
    nvml: NvmlSnapshot
    unreadable: list[int] = field(default_factory=list)  # pids whose open files are unreadable
    warnings: list[str] = field(default_factory=list)


@dataclass
class SweepRequest(WireRecord):
    """What a sweep is asked to do: to_dict the in-flight record, options() a call's SweepOptions."""

    OPTIONS: ClassVar[tuple[str, ...]] = ("gpus", "unit", "container", "grace_ms", "dry_run",
                                          "include_management", "reason", "slurm_job", "slurm_uid")

    gpus: list[str] = field(default_factory=list)  # NVML index or UUID, as the caller typed it
    unit: str = ""
    container: str = ""
    grace_ms: int | None = None
    dry_run: bool | None = None
    include_management: bool = False
    reason: str = ""
    requested_by: str = ""
    requester_kind: RequesterKind = RequesterKind.MANUAL  # decided by whoever makes the request
    adopted: list[tuple[int, int]] = field(default_factory=list)  # (pid, start) of `unit`'s leftovers
    # A Slurm epilog's job: its cgroup's processes and its user's escaped holders of `gpus` only.
    slurm_job: str = ""
    slurm_uid: int = -1  # -1: none
    # False for a non-root dry run: a flood of them must never push a real sweep out of the history.
    audited: bool = True
    # Daemon-set: the report's id, chosen first for the in-flight record, and the sweep it finishes.
    report_id: str = ""
    resumes: str = ""

    def is_dry_run(self, default: bool) -> bool:
        return default if self.dry_run is None else self.dry_run

    def options(self) -> dict[str, Any]:
        """What a call sends: the OPTIONS not at their default."""
        default = SweepRequest()
        return {key: getattr(self, key) for key in self.OPTIONS if getattr(self, key) != getattr(default, key)}

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> SweepRequest:
        """A fresh record (to_dict writes every key) of marshal.parse_options's checked options."""
        given = {key: values[key] for key in cls.OPTIONS if key in values}
        return cls(**{**given, "gpus": [str(gpu) for gpu in given.get("gpus", [])]})


@dataclass(frozen=True)
class Scope:
    """A resolved request: GPU indices, not what the caller typed."""

    gpus: tuple[int, ...] = ()
    unit: str = ""
    container: str = ""
    include_management: bool = False
    adopted: tuple[tuple[int, int], ...] = ()  # see SweepRequest.adopted
    slurm_job: str = ""  # see SweepRequest.slurm_job
    slurm_uid: int = -1
    # MIG instances (UUIDs) named on their own: only their tenants, never the rest of the GPU.
    mig: tuple[str, ...] = ()

    @property
    def whole_host(self) -> bool:
        return not (self.gpus or self.mig or self.unit or self.container or self.slurm_job)


def describe_scope(scope: Scope | ReportScope, whole: str = "the whole host", with_management: bool = True) -> str:
    """"GPU 0,1, unit x.service", for the journal and gpuguardctl; not escaped, as their printers do."""
    named = [("GPU ", ",".join(str(g) for g in scope.gpus)), ("MIG ", ",".join(scope.mig)),
             ("unit ", scope.unit), ("container ", scope.container)]
    parts = [label + value for label, value in named if value]
    text = ", ".join(parts) if parts else whole
    return text + (" including management clients" if with_management and scope.include_management else "")

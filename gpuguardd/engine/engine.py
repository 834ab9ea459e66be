"""The Engine: configuration + NVML + discovery + sweeps, free of D-Bus: the daemon and
`gpuguardctl --local` both drive it, one path from "who holds the GPUs" to "memory is back"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gpuguardd.config import Config
from gpuguardd.engine import amd, nvmlprocs, procfs, slurm
from gpuguardd.engine.attribution import container_scope_label, normalize_unit_name, validate_container_label
from gpuguardd.engine.devices import DeviceMap, annotate_device_paths, build_device_map
from gpuguardd.engine.gpustate import node_gpus
from gpuguardd.engine.holders import clock_ticks, find_holders, started_since
from gpuguardd.engine.locks import UNKNOWN_GPU, GpuLocks
from gpuguardd.engine.nvml import Nvml
from gpuguardd.engine.process import pidfds_supported
from gpuguardd.engine.protection import ProtectedFiles, mark_protection
from gpuguardd.engine.reset import GpuReset
from gpuguardd.engine.scope import holds_no_device_here, in_scope, is_target
from gpuguardd.engine.sweep import Pinned, Scan, Sweep, SweepObserver, close_all
from gpuguardd.errors import InvalidArgument
from gpuguardd.records.enums import HolderKind, Outcome, Vendor, WarningCode
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult, Scope, SweepRequest, describe_scope
from gpuguardd.records.report import Report
from gpuguardd.records.selectors import INDEX, MIG_UUID, PCI, KnownGpu, selector

log = logging.getLogger("gpuguard.engine")

MAX_GRACE_MS = 3_600_000


def filter_holders(holders: Iterable[Holder], scope: Scope, include_protected: bool = True) -> list[Holder]:
    """The holders a listing of `scope` shows: of its unit or container, that may be on its GPUs."""
    named = Scope(unit=scope.unit, container=scope.container)
    on = Scope(gpus=scope.gpus, mig=scope.mig)
    return [h for h in holders
            if (include_protected or not h.protected) and in_scope(h, named) and may_be_on(h, on)]


def may_be_on(holder: Holder, on: Scope) -> bool:
    """Whether `holder` may compute on `on`'s GPUs, for a listing and so `gpuguardctl check`. A
    holder the sweep cannot place counts on every GPU whose node it holds (all, if none is known)."""
    if not on.gpus and not on.mig:
        return True
    if holder.nvml_gpus or holder.mig or holder.kind != HolderKind.COMPUTE:
        # Placed by NVML or a MIG caps node; a management client (every GPU's node) where the sweep puts it.
        return in_scope(holder, on)
    if not holder.node_gpus:
        return True
    # By its nodes on whole GPUs; in a MIG instance (whose GPU is not known here) by the sweep's rule.
    return bool(set(holder.node_gpus) & set(on.gpus)) or in_scope(holder, on)


def known_gpus(nvml: NvmlSnapshot) -> list[KnownGpu]:
    return [KnownGpu(g.index, g.uuid, tuple(m.uuid for m in g.mig), g.pci_bus_id) for g in nvml.gpus]


@dataclass
class Prepared:
    """A request resolved on one reading of the GPUs, shared by its check and its sweep."""

    since: int  # clock ticks before that read: a later round looks at holders started after it
    nvml: NvmlSnapshot
    scope: Scope
    warnings: list[str]
    # The sweep's first scan when it was taken early (Engine.pin): a unit's leftovers are found
    # in the /proc walk the sweep then acts on. The sweep takes its pinned handles over.
    first: Scan | None = None

    def release(self) -> None:
        """Close the first scan's pidfds if no sweep took them (it was refused, or failed before)."""
        if self.first is not None:
            close_all(self.first[0])
            self.first = None


class Engine:
    def __init__(self, config: Config, nvml: Nvml | None = None, use_pidfd: bool | None = None) -> None:
        self.config = config  # replaced whole on a reload: a reader sees the old or the new one
        # Read per snapshot, so a reload's NvmlTimeoutSec applies to the next NVML query.
        self.nvml = nvml or Nvml(timeout=lambda: self.config.nvml_timeout_sec,
                                 sysfs=lambda: self.config.sysfs_path)
        self.use_pidfd = pidfds_supported() if use_pidfd is None else use_pidfd
        if not self.use_pidfd:
            log.warning("pidfds unavailable (kernel older than 5.3?): falling back to start-time "
                        "checks before each signal")

    def snapshot(self, with_processes: bool = True) -> NvmlSnapshot:
        """NVML's GPUs, then amdgpu's (engine/amd.py), numbered after them: NVIDIA's indices stay NVML's."""
        config = self.config
        snap = self.nvml.snapshot(with_processes=with_processes)
        amd_gpus = amd.read_gpus(config.sysfs_path, self._first_amd_index(snap), with_processes=with_processes)
        for gpu in amd_gpus:
            gpu.released_below = config.amd_released_below_mib * 1024 * 1024
            # KFD lists a process on every GPU it knows: only VRAM there (or an unreadable figure) counts.
            gpu.processes = {pid: vram for pid, vram in gpu.processes.items() if vram != 0}
        snap.gpus.extend(amd_gpus)
        if snap.gpus_known and not nvmlprocs.pids_are_local():
            snap.pids_local = False
            snap.error = snap.error or nvmlprocs.NOT_LOCAL
        if any(gpu.mig for gpu in snap.gpus):
            # Instances name their caps node; only MIG hosts pay for the device map here.
            device_map = self.device_map()
            annotate_device_paths(snap, device_map.mig_caps, device_map.nodes)
        return snap

    def device_map(self) -> DeviceMap:
        return _device_map(self.config)

    def _first_amd_index(self, snap: NvmlSnapshot) -> int:
        """After NVML's GPUs; without NVML, after the minors NVIDIA's nodes name: no index names two GPUs."""
        taken = [g.index for g in snap.gpus]
        if not snap.available:
            taken.extend(node_gpus(self.device_map()))
        return max(taken, default=-1) + 1

    def _scan_pinned(self, nvml: NvmlSnapshot | None = None, pids: list[int] | None = None) -> Scan:
        config = self.config
        snap = nvml if nvml is not None else self.snapshot()
        device_map = _device_map(config, snap)
        annotate_device_paths(snap, device_map.mig_caps, device_map.nodes)
        pinned, unreadable = find_holders(device_map, snap, use_pidfd=self.use_pidfd, pids=pids)
        own_chain = procfs.ancestors(os.getpid())
        protected = ProtectedFiles.resolve(config)  # once per scan: installs and upgrades
        for holder, _ in pinned:
            mark_protection(holder, config, own_chain, protected)
        warnings = list(device_map.warnings) + nvml_pid_warnings(snap, [h for h, _ in pinned])
        hidden = [pid for pid in unreadable if pid != 1 or os.geteuid() != 0]
        if hidden:
            shown = ", ".join(str(p) for p in hidden[:5]) + (" ..." if len(hidden) > 5 else "")
            warnings.append(f"could not read the open files of {len(hidden)} process(es) "
                            f"({shown}): permission denied"
                            + ("; run as root to see every holder" if os.geteuid() != 0 else ""))
        return pinned, snap, unreadable, warnings

    def scan(self, nvml: NvmlSnapshot | None = None) -> ScanResult:
        scan = self._scan_pinned(nvml)
        close_all(scan[0])
        return _result(scan)

    def list_holders(self, scope: Scope, include_protected: bool = True) -> tuple[list[Holder], ScanResult]:
        result = self.scan()
        return filter_holders(result.holders, scope, include_protected), result

    def resolve_gpus(self, wanted: Iterable[object], nvml: NvmlSnapshot | None = None
                     ) -> tuple[tuple[int, ...], list[str]]:
        items = list(wanted)
        if not items:
            return (), []
        snap = nvml if nvml is not None else self.snapshot(with_processes=False)
        warnings: list[str] = []
        indices: set[int] = set()
        # Without NVML the only NVIDIA GPUs known are those a configured device node names.
        nodes = {} if snap.available else node_gpus(self.device_map())
        known = ", ".join(str(g) for g in sorted({g.index for g in snap.gpus} | set(nodes))) or "none"
        for item in items:
            chosen = selector(item).check()
            if chosen.kind == INDEX:
                index = chosen.index
                if snap.by_index(index) is None and index not in nodes:
                    if snap.gpus_known:
                        raise InvalidArgument(f"GPU index {index} out of range (GPUs: {known})")
                    raise InvalidArgument(
                        f"no GPU {index}: {snap.error or 'NVML unavailable'}, and no configured "
                        f"device node names it (GPUs of the nodes: "
                        f"{', '.join(str(i) for i in sorted(nodes)) or 'none'})")
                if snap.by_index(index) is None:
                    warnings.append(f"NVML unavailable: GPU {index} taken to be {nodes[index]}")
                indices.add(index)
            else:
                matches = [found.index for found in chosen.find(known_gpus(snap)) if not found.mig]
                if not matches:
                    what = "PCI bus id" if chosen.kind == PCI else "GPU UUID"
                    raise InvalidArgument(f"unknown {what} {chosen.text!r}" + (
                        "" if snap.available else f" ({snap.error or 'NVML unavailable'})"))
                indices.update(matches)
        return tuple(sorted(indices)), warnings

    @staticmethod
    def resolve_mig(wanted: Iterable[object], nvml: NvmlSnapshot) -> tuple[tuple[str, ...], list[object]]:
        """The MIG UUIDs named (as NVML spells them; never widened to their GPU), and the rest."""
        found: list[str] = []
        rest: list[object] = []
        for item in wanted:
            chosen = selector(item)
            if chosen.kind != MIG_UUID:
                rest.append(item)
                continue
            match = chosen.find(known_gpus(nvml)) if chosen.well_formed else []
            if not match:
                why = "" if nvml.available else f" ({nvml.error or 'NVML unavailable'})"
                raise InvalidArgument(f"unknown MIG UUID {chosen.text!r}{why}: gpuguardctl gpus lists "
                                      "the instances")
            found.append(match[0].mig)
        return tuple(sorted(set(found))), rest

    def resolve_request(self, request: SweepRequest, nvml: NvmlSnapshot | None = None) -> tuple[Scope, list[str]]:
        nvml = nvml or self.snapshot(with_processes=False)
        mig, others = self.resolve_mig(request.gpus, nvml)
        gpus, warnings = self.resolve_gpus(others, nvml)
        unit = _checked(normalize_unit_name, request.unit)
        container = _checked(validate_container_label, request.container)
        if request.grace_ms is not None and not 0 <= request.grace_ms <= MAX_GRACE_MS:
            raise InvalidArgument(f"grace_ms {request.grace_ms} out of range (0-{MAX_GRACE_MS})")
        slurm.check_request(request)
        if unit and not container:
            # docker-<id>.scope and kin: the host unit of a container (attribution.py).
            container = container_scope_label(unit)
        scope = Scope(gpus=gpus, unit=unit, container=container, mig=mig,
                      include_management=request.include_management,
                      adopted=tuple((int(p), int(s)) for p, s in request.adopted),
                      slurm_job=request.slurm_job, slurm_uid=request.slurm_uid)
        return scope, warnings

    def _lock_names(self, scope: Scope, pinned: Pinned, nvml: NvmlSnapshot) -> set[str]:
        names: set[str] = {str(g) for g in scope.gpus}
        # An instance's sweep locks its GPU: instances share the GPU's driver state.
        names.update(str(found[0].index) for uuid in scope.mig
                     if (found := nvml.mig_instance(uuid)) is not None)
        for holder, _ in pinned:
            if is_target(holder, scope):
                names.update([str(g) for g in holder.gpus] or [UNKNOWN_GPU])
        if scope.whole_host:
            names.update(str(g.index) for g in nvml.gpus)
            names.add(UNKNOWN_GPU)
        return names

    def prepare(self, request: SweepRequest) -> Prepared:
        """Resolved on a fresh reading, never the inventory's last poll: a GPU is found where it is now."""
        since = clock_ticks()
        nvml = self.snapshot()  # one reading for the request's GPUs and the scan
        scope, warnings = self.resolve_request(request, nvml)
        return Prepared(since, nvml, scope, warnings)

    def pin(self, prepared: Prepared) -> ScanResult:
        """The sweep's first scan, taken now on `prepared`'s reading and kept for the sweep."""
        if prepared.first is None:
            prepared.first = self._scan_pinned(prepared.nvml)
        return _result(prepared.first)

    def sweep(self, request: SweepRequest, observer: SweepObserver | None = None,
              prepared: Prepared | None = None) -> Report:
        """From `prepared` (its check) when given; the adopted processes and the settings are read now."""
        prepared = prepared or self.prepare(request)
        scope = replace(prepared.scope, adopted=tuple((int(p), int(s)) for p, s in request.adopted))
        config = self.config
        dry_run = request.is_dry_run(config.dry_run)
        lock_problem = ""
        locks = GpuLocks(os.path.join(config.runtime_directory, "locks"))
        try:
            first, prepared.first = prepared.first or self._scan_pinned(prepared.nvml), None
            if not dry_run:
                # Lock the GPUs the scan found; after a wait for another sweep, look again and widen.
                held: set[str] = set()
                wanted = self._lock_names(scope, first[0], first[1])
                while not wanted <= held:
                    locks.release()
                    held = held | wanted
                    lock_problem = locks.acquire(held) or ""
                    if lock_problem or not locks.waited:
                        break
                    close_all(first[0])
                    first = self._scan_pinned()
                    wanted = self._lock_names(scope, first[0], first[1])

            # Later, a process becomes a holder by starting (a dying worker's child, a respawn: start
            # times show it) or by creating a CUDA context (NVML lists it): what a later round reads.
            sweep = Sweep(scope, config, first, lambda: self._scan_pinned(pids=started_since(prepared.since)),
                          self.snapshot, request, observer)
            sweep.report.warnings.extend(prepared.warnings)
            if lock_problem:
                sweep.report.warn(lock_problem, WarningCode.LOCKS_UNAVAILABLE)
            if not self.use_pidfd:
                sweep.report.warnings.append("pidfds unavailable: PIDs were checked by start time before each signal")
            log.info("sweep %s started by %s: %s%s", sweep.report.id[:8],
                     request.requested_by or "unknown", describe_scope(scope),
                     f" (reason: {request.reason})" if request.reason else "")
            report = sweep.run()
        finally:
            locks.release()
        level = logging.INFO if report.outcome in (Outcome.FREED, Outcome.NOTHING, Outcome.DRY_RUN) \
            else logging.WARNING
        log.log(level, "sweep %s finished: %s (%d terminated, %d survived, %d spared) in %d ms",
                report.id[:8], report.outcome, len(report.terminated), len(report.survived),
                len(report.spared), report.duration_ms)
        return report

    def reset_gpu(self, index: int, requested_by: str, reason: str = "") -> Report:
        return GpuReset(index, self.nvml, self.scan, self.config, requested_by, reason).run()


def _result(scan: Scan) -> ScanResult:
    pinned, snap, unreadable, warnings = scan
    return ScanResult(holders=[h for h, _ in pinned], nvml=snap, unreadable=unreadable, warnings=warnings)


def log_device_refusals(config: Config) -> None:
    """Log the refused [Devices] Paths entries once per configuration: a scan's warnings reach only reports."""
    for warning in _device_map(config).warnings:
        log.warning("%s", warning)


def _device_map(config: Config, snap: NvmlSnapshot | None = None) -> DeviceMap:
    """The configured nodes; with a reading, also its AMD GPUs' DRM nodes (found by amd.py)."""
    amd = frozenset(minor for g in snap.gpus if g.vendor == Vendor.AMD
                    for minor in (g.minor, g.card_minor) if minor is not None) if snap else frozenset()
    return build_device_map(config.device_paths, allow_majors=config.allow_majors,
                            origin=config.origin, mig_minors=config.mig_minors_path, amd_minors=amd)


def _checked(validate: Callable[[str], str], value: str) -> str:
    if not value:
        return ""
    try:
        return validate(value)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def nvml_pid_warnings(snap: NvmlSnapshot, holders: list[Holder]) -> list[str]:
    if not snap.gpus_known:
        return []
    warnings = [w for gpu in snap.gpus for w in gpu.warnings]
    if not snap.pids_local:
        return [*warnings, snap.error]
    for gpu in snap.gpus:
        for pid in sorted(gpu.processes):
            if not procfs.pid_exists(pid):
                lister = "KFD" if gpu.vendor == Vendor.AMD else "NVML"
                warnings.append(f"GPU {gpu.index}: {lister} lists pid {pid}, which does not exist "
                                "here (exited, memory not released yet?)")
    for holder in holders:
        if holds_no_device_here(holder):
            lister = "NVML" if "nvml" in holder.how else "KFD"
            warnings.append(f"{lister} lists pid {holder.pid} ({holder.comm}) on GPU "
                            f"{','.join(map(str, holder.nvml_gpus))}, but it holds no GPU "
                            f"device here: never a sweep target on {lister}'s word alone")
    return warnings

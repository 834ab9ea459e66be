"""Resetting one GPU that nothing holds, through the driver's supported path, and proving it.

NVML cannot reset a GPU; `nvidia-smi -r` can, if no process uses it, persistence mode is off
and NVLink peers are reset together (its manual): so gpuguardd's own NVML session is closed and
persistence mode turned off around [Recovery] ResetCommand. Per AMD's amd-smi guide a reset
(AmdResetCommand) ends every process with /dev/kfd open and resets the whole XGMI hive.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence

from gpuguardd.config import Config, command_argv
from gpuguardd.engine import procfs
from gpuguardd.engine.driverinfo import bus_key
from gpuguardd.engine.judge import Judgement, facts_of, judge
from gpuguardd.engine.locks import GpuLocks
from gpuguardd.engine.nvml import Nvml, NvmlCallFailed
from gpuguardd.engine.nvmlworker import NvmlHung
from gpuguardd.records.enums import HolderKind, Outcome, Vendor, WarningCode
from gpuguardd.records.models import GpuInfo, Holder, NvmlSnapshot, ScanResult
from gpuguardd.records.report import REPORT_RESET, GpuResult, Leak, Report, ReportScope

log = logging.getLogger("gpuguard.reset")

PAUSABLE = frozenset({"nvidia-persistenced"})  # lets go when persistence mode is turned off
HOSTENGINE = frozenset({"nv-hostengine"})  # DCGM's: keeps its handles until stopped (no per-GPU release)
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
_OUTPUT_MAX = 300  # bytes of the command's output kept in a step (escaped where shown)
NEEDS = "CAP_SYS_ADMIN (docs/recovery.md: the reset drop-in)"  # the NVIDIA driver checks capable(CAP_SYS_ADMIN)
KFD_NODE = "/dev/kfd"
POLL_SEC = 0.1  # between readings while verifying


def _name(holder: Holder) -> str:
    return os.path.basename(holder.exe) or holder.comm


def _touches(holder: Holder, gpu: GpuInfo) -> bool:
    """Whether `holder` has GPU `gpu` open, or computes somewhere nobody can name."""
    return (gpu.index in {*holder.gpus, *holder.node_gpus, *holder.nvml_gpus}
            or bool(set(holder.mig) & {m.uuid for m in gpu.mig})
            or (holder.kind == HolderKind.COMPUTE and not holder.gpus))


def refusal(gpu: GpuInfo, snap: NvmlSnapshot, holders: Sequence[Holder], own: frozenset[int]) -> str:
    """Why `gpu` must not be reset now ("" when it may): a holder, or a listed process that may be alive."""
    lister = "KFD" if gpu.vendor == Vendor.AMD else "NVML"
    if snap.pids_local:
        alive = sorted(pid for pid in gpu.processes if procfs.pid_exists(pid))
        if alive:
            return (f"{lister} lists live process(es) on it ({', '.join(map(str, alive[:5]))}): "
                    "end them first (gpuguardctl sweep)")
    elif gpu.processes:
        return (f"{lister} lists processes on it by PIDs of another PID namespace, which may be "
                "alive there")
    for holder in holders:
        if holder.pid in own or not _touches(holder, gpu) or _name(holder) in PAUSABLE:
            continue
        who = f"pid {holder.pid} ({holder.comm}, {holder.kind})"
        if _name(holder) in HOSTENGINE:
            return f"DCGM's nv-hostengine holds it ({who}): stop DCGM first"
        return f"{who} holds it" + (f" in unit {holder.unit}" if holder.unit else "")
    return ""


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _kfd_hive(sysfs: str, gpu_id: int) -> int:
    """KFD's hive_id of the GPU with this gpu_id (0: in no XGMI hive, or not found)."""
    nodes = os.path.join(sysfs, "class", "kfd", "kfd", "topology", "nodes")
    try:
        names = os.listdir(nodes)
    except OSError:
        return 0
    for name in names:
        if _read(os.path.join(nodes, name, "gpu_id")) != str(gpu_id):
            continue
        for line in _read(os.path.join(nodes, name, "properties")).splitlines():
            key, _, value = line.partition(" ")
            if key == "hive_id" and value.strip().isdigit():
                return int(value)
    return 0


def amd_refusal(gpu: GpuInfo, scan: ScanResult, own: frozenset[int], sysfs: str = "/sys") -> str:
    """What else an AMD GPU's reset would take down ("" when nothing)."""
    for holder in scan.holders:
        if holder.pid not in own and (KFD_NODE in holder.devices or "kfd" in holder.roles):
            return (f"pid {holder.pid} ({holder.comm}) holds {KFD_NODE}"
                    + (f" in unit {holder.unit}" if holder.unit else "")
                    + ": the amdgpu driver ends every process with /dev/kfd open when any GPU is "
                    "reset, whichever GPU it uses (end the ROCm processes first)")
    siblings = sorted(other.index for other in scan.nvml.gpus if other.index != gpu.index
                      and other.vendor == Vendor.AMD and gpu.pci_bus_id
                      and other.pci_bus_id.lower() == gpu.pci_bus_id.lower())
    if siblings:
        return (f"it is one partition of the GPU at {gpu.pci_bus_id}, with GPU(s) "
                f"{', '.join(map(str, siblings))}: a reset resets every partition")
    device = os.path.join(sysfs, "bus/pci/devices", bus_key(gpu.pci_bus_id))
    hive = _read(os.path.join(device, "xgmi_hive_info", "xgmi_hive_id"))
    if (hive and hive != "0") or (gpu.gpu_id and _kfd_hive(sysfs, gpu.gpu_id)):
        return (f"it is in an XGMI hive{f' ({hive})' if hive and hive != '0' else ''}: the "
                "driver resets every GPU of the hive together (amd-smi reset on all of them, "
                "or a reboot)")
    if _read(os.path.join(device, "boot_vga")) == "1":
        return ("it is the boot display GPU (boot_vga): the console and any display on it go "
                "down with a reset; reset it by hand if that is acceptable")
    return ""


class GpuReset:
    def __init__(self, index: int, nvml: Nvml, scan: Callable[[], ScanResult],
                 config: Config, requested_by: str, reason: str = "") -> None:
        self.index = index
        self.nvml = nvml
        self.scan = scan
        self.config = config
        self.report = Report(id=uuid.uuid4().hex, started_usec=time.time_ns() // 1000,
                             requested_by=requested_by, reason=reason,
                             scope=ReportScope(gpus=[index]), kind=REPORT_RESET,
                             outcome=Outcome.RESET_REFUSED)
        self._started = time.monotonic()

    def step(self, text: str, level: int = logging.INFO) -> None:
        self.report.steps.append(text)
        log.log(level, "reset %s GPU %d: %s", self.report.id[:8], self.index, text)

    def run(self) -> Report:
        log.info("reset %s of GPU %d requested by %s%s", self.report.id[:8], self.index,
                 self.report.requested_by, f" (reason: {self.report.reason})" if self.report.reason else "")
        locks = GpuLocks(os.path.join(self.config.runtime_directory, "locks"))
        try:
            problem = locks.acquire([self.index], wait=False)
            if locks.busy:
                self._refuse("a sweep covers it now")
            else:
                if problem:
                    self.report.warn(problem, WarningCode.LOCKS_UNAVAILABLE)
                self._reset()
        except (NvmlHung, NvmlCallFailed, OSError) as exc:
            self._error(str(exc), "failed: ")
        finally:
            locks.release()
        self.report.duration_ms = int((time.monotonic() - self._started) * 1000)
        level = logging.INFO if self.report.outcome == Outcome.RESET else logging.WARNING
        log.log(level, "reset %s of GPU %d: %s%s", self.report.id[:8], self.index,
                 self.report.outcome, f" ({self.report.error})" if self.report.error else "")
        return self.report

    def _error(self, why: str, said: str = "", outcome: Outcome = Outcome.RESET_FAILED) -> bool:
        self.report.outcome = outcome
        self.report.error = why
        self.step(said + why, logging.ERROR if outcome == Outcome.RESET_FAILED else logging.WARNING)
        return False

    def _refuse(self, why: str) -> None:
        self._error(why, "refused: ", Outcome.RESET_REFUSED)

    def _reset(self) -> None:
        scan = self.scan()
        gpu = scan.nvml.by_index(self.index)
        # An AMD GPU is read from sysfs, NVML or not; an NVIDIA one only through NVML.
        if gpu is None or (gpu.vendor != Vendor.AMD and not scan.nvml.available):
            self._refuse(f"no GPU {self.index} ({scan.nvml.error or 'NVML does not list it'})")
            return
        own = frozenset({os.getpid(), *procfs.ancestors(os.getpid())})
        amd = gpu.vendor == Vendor.AMD
        why = (refusal(gpu, scan.nvml, scan.holders, own)
               or (amd_refusal(gpu, scan, own, self.config.sysfs_path) if amd else "")
               or ("" if gpu.pci_bus_id else "its PCI bus id is unknown")
               or ("" if amd else self._nvlink_refusal()))
        if why:
            self._refuse(why)
            return
        before = self._before(gpu, scan.nvml.pids_local)
        if amd:
            # No persistence mode and no session of gpuguardd's own to close: it reads sysfs.
            if self._command(gpu.pci_bus_id, self.config.amd_reset_command):
                self._verify(before, lambda: self.scan().nvml)
            return
        if gpu.mig_mode:
            self.step(f"MIG mode: its {len(gpu.mig)} instance(s) are gone after the reset; "
                      "recreate them as the site does (nvidia-mig-parted)", logging.WARNING)
        restore = self._persistence_off()
        try:
            self.nvml.pause("NVML closed for a GPU reset")
            self.step("closed gpuguardd's NVML session")
            ok = self._command(gpu.pci_bus_id, self.config.reset_command)
        finally:
            self.nvml.resume()
            if restore:
                self._persistence_on()
        if ok:
            self._verify(before, self.nvml.snapshot)

    def _judge(self, gpu: GpuInfo, pids_local: bool) -> Judgement:
        return judge(facts_of(gpu, None, (), self.config.released_below_mib * 1024 * 1024, pids_local))

    def _before(self, gpu: GpuInfo, pids_local: bool) -> GpuResult:
        before = GpuResult(index=gpu.index, uuid=gpu.uuid, memory_used_before=gpu.memory_used,
                           memory_total=gpu.memory_total)
        self.report.gpus = [before]
        kind = self._judge(gpu, pids_local).leak
        if kind is not None:
            self.report.leaks = [Leak(gpu=gpu.index, uuid=gpu.uuid, bytes=gpu.memory_used, kind=kind.value)]
        shown = f" ({kind.value})" if kind is not None else ""
        self.step(f"nothing holds it; {gpu.memory_used // (1024 * 1024)} MiB in use{shown}")
        return before

    def _nvlink_refusal(self) -> str:
        def active(handle: object) -> list[int]:
            import pynvml

            links = []
            for link in range(NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        links.append(link)
                except pynvml.NVMLError_InvalidArgument:
                    break  # past the GPU's last link
            return links
        try:
            links = self.nvml.device_call(self.index, active, "nvmlDeviceGetNvLinkState")
        except NvmlCallFailed as exc:
            if exc.unsupported:
                return ""  # no NVLink on this GPU
            raise
        if links:
            return (f"NVLink link(s) {','.join(map(str, links))} are active: the driver resets "
                    "NVLink peers and NVSwitch fabrics only together (nvidia-smi -r on all of "
                    "them, or a reboot)")
        return ""

    def _set_persistence(self, on: bool) -> None:
        import pynvml

        mode = pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED
        self.nvml.device_call(self.index, lambda h: pynvml.nvmlDeviceSetPersistenceMode(h, mode),
                              "nvmlDeviceSetPersistenceMode")

    def _persistence_off(self) -> bool:
        """Whether it turned persistence mode off (to be restored)."""
        import pynvml

        try:
            mode = self.nvml.device_call(self.index, pynvml.nvmlDeviceGetPersistenceMode,
                                         "nvmlDeviceGetPersistenceMode")
        except NvmlCallFailed as exc:
            self.step(f"persistence mode unknown ({exc})")
            return False
        if mode != pynvml.NVML_FEATURE_ENABLED:
            self.step("persistence mode is off")
            return False
        try:
            self._set_persistence(False)
        except NvmlCallFailed as exc:
            # The driver grants it to CAP_SYS_ADMIN only, which the shipped unit leaves out.
            hint = f": the driver allows it only with {NEEDS}" if "Permission" in str(exc) else ""
            raise NvmlCallFailed(f"cannot turn persistence mode off ({exc}){hint}") from None
        self.step("turned persistence mode off (nvidia-persistenced lets go)")
        return True

    def _persistence_on(self) -> None:
        try:
            self._set_persistence(True)
            self.step("restored persistence mode")
        except (NvmlCallFailed, NvmlHung) as exc:
            self.report.warn(f"persistence mode could not be restored: {exc}",
                             WarningCode.PERSISTENCE_NOT_RESTORED)
            self.step(f"could not restore persistence mode: {exc}", logging.ERROR)

    def _command(self, bus_id: str, command: str) -> bool:
        argv = [*command_argv(command), bus_id]
        shown = " ".join(argv)
        self.step(f"running {shown}")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=self.config.reset_timeout_sec, check=False)
        except subprocess.TimeoutExpired:
            return self._error(f"{shown} did not finish within {self.config.reset_timeout_sec:g} s")
        except OSError as exc:
            return self._error(f"cannot run {shown}: {exc.strerror or exc}")
        said = done.stdout[-_OUTPUT_MAX:].decode("utf-8", "replace").strip()
        if done.returncode != 0:
            return self._error(f"{shown} failed (exit status {done.returncode})" + (f": {said}" if said else ""))
        self.step("the reset command succeeded" + (f": {said}" if said else ""))
        return True

    def _verify(self, before: GpuResult, read: Callable[[], NvmlSnapshot]) -> None:
        """Poll `read` (NVML, or an AMD GPU's scan) until the memory is released or VerifyTimeoutSec passes."""
        deadline = time.monotonic() + self.config.verify_timeout_sec
        while True:
            snap = read()
            gpu = snap.by_index(self.index)
            answers = gpu is not None and not (gpu.lost or gpu.unknown)
            if gpu is not None and answers:
                before.memory_used_after = gpu.memory_used
                before.released = self._judge(gpu, snap.pids_local).released
            if before.released or time.monotonic() >= deadline:
                break
            time.sleep(POLL_SEC)
        if before.released:
            self.report.outcome = Outcome.RESET
            self.report.verified = True
            self.step(f"verified: the GPU answers, {before.memory_used_after // (1024 * 1024)} MiB in use")
            return
        self._error("the GPU does not answer after the reset" if not answers else
                    f"{before.memory_used_after // (1024 * 1024)} MiB still in use after the reset")

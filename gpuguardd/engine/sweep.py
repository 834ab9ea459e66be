"""Ending the holders in a scope: SIGTERM, grace, SIGKILL, then proof through NVML.

A process sent SIGKILL and not gone after KillTimeoutSec is exiting, not a survivor (SGLang
unpins a large host cache in D state for 16-26 s): verification waits for it and the memory
together, up to VerifyTimeoutSec. Only holders the scan pinned, never protected ones, are signalled.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol, Union

from gpuguardd.config import Config
from gpuguardd.engine import process, procfs
from gpuguardd.engine.judge import Judgement, facts_of, judge
from gpuguardd.engine.process import ProcessHandle, wait_for_exit
from gpuguardd.engine.scope import gpu_scope, holds_no_device_here, in_scope, is_target, mig_scope_why
from gpuguardd.records.enums import HolderKind, Outcome, SpareReason, SurvivorReason, WarningCode, Why
from gpuguardd.records.models import GpuInfo, Holder, MigInstance, NvmlSnapshot, Scope, SweepRequest
from gpuguardd.records.report import GpuResult, Leak, Report, ReportScope, Spared, Survivor, Target, Terminated

log = logging.getLogger("gpuguard.sweep")

MAX_ROUNDS = 3
# Where NVML's pids are not this /proc's (gpuguardd in a container), a listed pid may be the sweep's
# or another tenant's: such lists count as settled (unverified, never freed) this long after a change.
FOREIGN_SETTLE_SEC = 2.0
# NVML has no "memory released" event: poll fast first (release is usually quick), then back off.
POLL_START_SEC = 0.005
POLL_MAX_SEC = 0.1


class SweepObserver(Protocol):
    def sweep_started(self, report_id: str, scope: ReportScope) -> None: ...

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str, signal_name: str) -> None: ...


Pinned = list[tuple[Holder, ProcessHandle]]
MemoryKey = Union[int, str]  # what a sweep verifies: a whole GPU (NVML index) or a MIG instance (UUID)
MemoryView = tuple[GpuInfo, Union[MigInstance, None]]  # a GPU, and the key's instance of it (None: whole)
# (holder, handle) pairs with protection decided, their NVML snapshot, unreadable PIDs, warnings.
Scan = tuple[Pinned, NvmlSnapshot, list[int], list[str]]


def close_all(pinned: Pinned) -> None:
    for _, handle in pinned:
        handle.close()


def memory_view(snap: NvmlSnapshot, key: MemoryKey) -> MemoryView | None:
    if isinstance(key, str):
        return snap.mig_instance(key)
    gpu = snap.by_index(key)
    return None if gpu is None else (gpu, None)


class Sweep:
    def __init__(self, scope: Scope, config: Config, scan: Scan, rescan: Callable[[], Scan],
                 snapshot: Callable[[], NvmlSnapshot], request: SweepRequest,
                 observer: SweepObserver | None = None) -> None:
        """`rescan`: after each round of signals, what may have become a holder since."""
        self.scope = scope
        self.config = config
        self.grace_sec = config.grace_sec if request.grace_ms is None else request.grace_ms / 1000.0
        self.dry_run = request.is_dry_run(config.dry_run)
        self.scan = scan
        self.rescan = rescan
        self.snapshot = snapshot
        self.observer = observer
        self.report = Report(id=request.report_id or uuid.uuid4().hex, started_usec=time.time_ns() // 1000,
                             requested_by=request.requested_by, reason=request.reason, resumes=request.resumes,
                             scope=ReportScope.of(scope, grace_ms=int(self.grace_sec * 1000)),
                             dry_run=self.dry_run, requester_kind=request.requester_kind)
        self._t0 = time.monotonic()
        # (pid, start time) of every process this sweep dealt with, so a rescan knows them.
        self._handled: set[tuple[int, int]] = set()
        self._terminated_pids: set[int] = set()
        # Sent SIGKILL, not gone after KillTimeoutSec: pid -> (holder, own handle, first signal's time).
        self._exiting: dict[int, tuple[Holder, ProcessHandle, float]] = {}
        # PIDs SIGTERM cannot end: if they exit before the SIGKILL, SIGTERM is not credited.
        self._sigterm_ignored: set[int] = set()
        # Whether NVML's pids are this /proc's (NvmlSnapshot.pids_local), as last read.
        self._pids_local = True

    def run(self) -> Report:
        report = self.report
        if self.observer is not None:
            self.observer.sweep_started(report.id, report.scope)
        pinned, nvml, _, warnings = self.scan
        self._pids_local = nvml.pids_local
        report.warnings.extend(warnings)
        targets = self._plan(pinned)
        gpus_in_scope = self._gpus_in_scope(targets, nvml)
        keys: list[MemoryKey] = [*(g.index for g in nvml.gpus), *(i.uuid for g in nvml.gpus for i in g.mig)]
        before = {key: view for key in keys if (view := memory_view(nvml, key)) is not None}
        if not nvml.gpus_known:
            report.warn(f"{nvml.error or 'NVML unavailable'}: GPU memory cannot be verified",
                        WarningCode.NVML_UNAVAILABLE)
        if self.dry_run:
            report.outcome = Outcome.DRY_RUN
            report.gpus = [self._gpu_entry(before.get(k), k, None) for k in gpus_in_scope]
            close_all(pinned)
            return self._finish()
        rounds = 0
        while targets and rounds < MAX_ROUNDS:
            rounds += 1
            self._terminate(targets)
            close_all(pinned)
            pinned, _, _, _ = self.rescan()
            targets = [(h, p) for h, p in pinned
                       if is_target(h, self.scope) and (h.pid, h.start_time) not in self._handled]
            report.targets.extend(Target.of(holder) for holder, _ in targets)
            # Keys mix ints and strings: no sort, the new ones after.
            gpus_in_scope = list(dict.fromkeys([*gpus_in_scope, *self._gpus_in_scope(targets, nvml)]))
        why = f"appeared again after {MAX_ROUNDS} rounds: something keeps starting new holders"
        report.survived.extend(Survivor.of(holder, SurvivorReason.REAPPEARED, why) for holder, _ in targets)
        close_all(pinned)
        after = self._verify(gpus_in_scope, nvml.gpus_known)
        self._report_exiting()
        report.gpus = [self._gpu_entry(before.get(k), k, after.get(k)) for k in gpus_in_scope]
        self._decide_outcome(gpus_in_scope, before, after, nvml.gpus_known)
        return self._finish()

    def _finish(self) -> Report:
        self.report.code_warnings()
        self.report.duration_ms = int((time.monotonic() - self._t0) * 1000)
        return self.report

    def _plan(self, pinned: Pinned) -> Pinned:
        targets: Pinned = []
        for holder, handle in pinned:
            if not in_scope(holder, self.scope):
                _, why = gpu_scope(holder, self.scope.gpus)
                code = SpareReason.OTHER_GPU
                if not why:
                    why, code = mig_scope_why(holder, self.scope), SpareReason.OTHER_MIG_INSTANCE
                # Worth a line for what the scope would otherwise have taken (never a protected one).
                if why and not holder.protected and in_scope(holder, replace(self.scope, gpus=(), mig=())):
                    self.report.spared.append(Spared.of(holder, code, why))
                continue
            if holder.protected:
                spared = (holder.protected_code or SpareReason.OTHER, holder.protected_why)
            elif holds_no_device_here(holder):
                spared = (SpareReason.NO_DEVICE_HERE, "NVML lists it, but it holds no NVIDIA device here "
                          "(another PID namespace's pid, or a reused one?)")
            elif holder.kind != HolderKind.COMPUTE and not self.scope.include_management:
                spared = (SpareReason.MANAGEMENT, "management client (no CUDA context); include_management ends it")
            else:
                targets.append((holder, handle))
                self.report.targets.append(Target.of(holder))
                continue
            self.report.spared.append(Spared.of(holder, *spared))
        return targets

    def _gpus_in_scope(self, targets: Pinned, nvml: NvmlSnapshot) -> list[MemoryKey]:
        """Whole GPUs by index; MIG instances by UUID (the GPU's aggregate holds other tenants')."""
        if self.scope.gpus or self.scope.mig:
            return [*sorted(self.scope.gpus), *sorted(self.scope.mig)]
        if self.scope.whole_host:
            return [g.index for g in nvml.gpus]
        return [*sorted({g for holder, _ in targets if not holder.mig for g in holder.gpus}),
                *sorted({m for holder, _ in targets for m in holder.mig})]

    def _signal(self, holder: Holder, handle: ProcessHandle, sig: signal.Signals) -> str:
        """"sent", "gone" (exited before the signal) or "denied" (not ours to signal)."""
        if sig == signal.SIGTERM and process.ignores_sigterm(holder.pid):
            self._sigterm_ignored.add(holder.pid)
        try:
            sent = handle.send(sig)
        except PermissionError:
            log.warning("sweep %s: not permitted to send %s to pid %d (%s)", self.report.id[:8],
                        sig.name, holder.pid, holder.comm)
            return "denied"
        if not sent:
            return "gone"
        log.info("sweep %s: sent %s to pid %d (%s, unit %s%s), requested by %s",
                 self.report.id[:8], sig.name, holder.pid, holder.comm, holder.unit or "-",
                 f", container {holder.container}" if holder.container else "",
                 self.report.requested_by or "unknown")
        return "sent"

    def _terminate(self, targets: Pinned) -> None:
        report = self.report
        live: dict[int, tuple[Holder, ProcessHandle]] = {}
        for holder, handle in targets:
            self._handled.add((holder.pid, holder.start_time))
            if holder.state == "Z":  # nothing to signal: only its parent can release it
                why = f"zombie: parent {holder.ppid} has not reaped it"
                report.survived.append(Survivor.of(holder, SurvivorReason.ZOMBIE, why, state="Z"))
                continue
            live[holder.pid] = (holder, handle)
        sent_at: dict[int, float] = {}

        def send_all(sig: signal.Signals, gone_as: str) -> None:
            for pid, (holder, handle) in list(live.items()):
                sent_at.setdefault(pid, time.monotonic())
                result = self._signal(holder, handle, sig)
                if result == "gone":
                    self._record_exit(holder, handle, gone_as, sent_at[pid], time.monotonic())
                    del live[pid]
                elif result == "denied":
                    report.survived.append(Survivor.of(holder, SurvivorReason.PERMISSION_DENIED,
                                                       f"permission denied sending {sig.name} (run as root)"))
                    del live[pid]

        def wait(sig: signal.Signals, timeout: float) -> None:
            def exited(pid: int, seen_at: float) -> None:  # announced as it happens
                holder, handle = live.pop(pid)
                self._record_exit(holder, handle, sig.name, sent_at[pid], seen_at)
            wait_for_exit([h for _, h in live.values()], timeout, on_exit=exited)

        send_all(signal.SIGTERM, "")
        wait(signal.SIGTERM, self.grace_sec)
        if live:
            send_all(signal.SIGKILL, signal.SIGTERM.name)
            wait(signal.SIGKILL, self.config.kill_timeout_sec)
        for pid, (holder, handle) in live.items():
            # SIGKILL is pending: exiting, however slowly (module docstring; sglang issue 31746).
            self._exiting[pid] = (holder, handle.dup(), sent_at[pid])

    def _wait_exiting(self, timeout: float) -> None:
        if not self._exiting:
            time.sleep(timeout)
            return

        def exited(pid: int, seen_at: float) -> None:
            holder, handle, sent_at = self._exiting.pop(pid)
            self._record_exit(holder, handle, signal.SIGKILL.name, sent_at, seen_at)
            handle.close()
        wait_for_exit([handle for _, handle, _ in self._exiting.values()], timeout, on_exit=exited)

    def _report_exiting(self) -> None:
        for pid, (holder, handle, _) in sorted(self._exiting.items()):
            state, code, why = process.survivor_reason(pid)
            waited = self.config.kill_timeout_sec + self.config.verify_timeout_sec
            self.report.survived.append(Survivor.of(holder, code, f"{why} ({waited:g} s after SIGKILL)", state=state))
            handle.close()
        self._exiting.clear()

    def _record_exit(self, holder: Holder, handle: ProcessHandle, signal_name: str,
                     sent_at: float, seen: float) -> None:
        # The kernel's exit status while it has it; else SIGTERM is credited only if it could have ended it.
        stat = procfs.read_stat(holder.pid)
        if stat is not None and stat.start_time != handle.start_time:
            stat = None  # reaped, and its PID is another process's now
        status = process.exit_status(stat)
        signal_name = process.ended_by(signal_name, status, holder.pid in self._sigterm_ignored)
        self.report.terminated.append(Terminated(
            pid=holder.pid, comm=holder.comm, unit=holder.unit, uid=holder.uid if holder.uid >= 0 else None,
            signal=signal_name, exited_after_ms=max(0, int((seen - sent_at) * 1000)),
            exit_status="" if status is None else str(status), zombie_parent=None if stat is None else stat.ppid))
        self._terminated_pids.add(holder.pid)
        if self.observer is not None:
            self.observer.process_terminated(self.report.id, holder.pid, holder.comm, holder.unit, signal_name)

    def _judge(self, view: MemoryView, stuck: Iterable[int] = ()) -> Judgement:
        gpu, instance = view
        return judge(facts_of(gpu, instance, (), self.config.released_below_mib * 1024 * 1024,
                              self._pids_local, ending={*self._terminated_pids, *self._exiting},
                              stuck=set(stuck)))

    def _foreign_pids(self, view: MemoryView) -> frozenset[int]:
        """The pids NVML lists there when they are not this /proc's (FOREIGN_SETTLE_SEC)."""
        return frozenset() if self._pids_local else frozenset(_memory_of(view).processes)

    def _unreadable(self, view: MemoryView) -> str:
        """Why a view's memory proves nothing either way ("" when it does)."""
        gpu = view[0]
        verdict = self._judge(view)
        if verdict.has(Why.LOST) or verdict.has(Why.UNREADABLE):
            # A hung or lost GPU's figures mean nothing: neither freed nor leaked.
            why = gpu.error or _memory_of(view).error or ("lost" if gpu.lost else "unknown")
            return f"memory could not be read ({why})"
        if verdict.has(Why.SUSPENDED):
            # Its figures are the last ones read: asking now would wake it (driverinfo.py).
            return "memory not read: the GPU is runtime-suspended, and asking would wake it"
        if verdict.has(Why.FOREIGN):
            return (f"memory not verified: NVML still lists {len(self._foreign_pids(view))} "
                    "process(es) by host PIDs, which this PID namespace cannot tell apart (the "
                    "sweep's, not yet released, or another tenant's)")
        return ""

    def _verify(self, gpus: list[MemoryKey], nvml_available: bool) -> dict[MemoryKey, MemoryView]:
        """Poll until the memory is back (foreign lists: settled) and nothing exits, or VerifyTimeoutSec."""
        deadline = time.monotonic() + self.config.verify_timeout_sec
        if not gpus or not nvml_available:
            if self._exiting:  # nothing to read: wait for the processes alone, not the clock
                self._wait_exiting(max(0.0, deadline - time.monotonic()))
            return {}
        delay = POLL_START_SEC
        foreign: dict[MemoryKey, frozenset[int]] = {}
        quiet_since = time.monotonic()
        while True:
            snap = self.snapshot()
            self._pids_local = snap.pids_local
            current = {key: view for key in gpus if (view := memory_view(snap, key)) is not None}
            lists = {k: pids for k, v in current.items() if (pids := self._foreign_pids(v))}
            if self._exiting or lists != foreign:
                foreign, quiet_since = lists, time.monotonic()
            # Having ended nothing, the sweep has nothing of its own in those lists to wait for.
            settled = not self._terminated_pids or time.monotonic() - quiet_since >= FOREIGN_SETTLE_SEC
            if not self._exiting and snap.gpus_known \
                    and all(k in current and (self._judge(current[k]).released or (k in lists and settled))
                            for k in gpus):
                return current
            if time.monotonic() >= deadline:
                return current if snap.gpus_known else {}
            self._wait_exiting(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, POLL_MAX_SEC)

    def _gpu_entry(self, before: MemoryView | None, key: MemoryKey, after: MemoryView | None) -> GpuResult:
        was = _memory_of(before) if before else None
        entry = GpuResult(index=before[0].index if before else key if isinstance(key, int) else 0,
                          uuid=before[0].uuid if before else "", mig_uuid=key if isinstance(key, str) else "",
                          memory_used_before=was.memory_used if was else 0, memory_total=was.memory_total if was else 0)
        if after is not None:
            entry.memory_used_after = _memory_of(after).memory_used
            entry.released = self._judge(after).released
        else:
            entry.memory_used_after = was.memory_used if was and self.dry_run else 0
        return entry

    def _decide_outcome(self, gpus: list[MemoryKey], before: dict[MemoryKey, MemoryView],
                        after: dict[MemoryKey, MemoryView], nvml_available: bool) -> None:
        report = self.report
        readable = {k: v for k, v in after.items() if not self._unreadable(v)}
        verified = nvml_available and bool(gpus) and all(k in readable for k in gpus)
        not_released: list[MemoryKey] = []
        for key in gpus:
            view = after.get(key)
            name = f"MIG {key}" if isinstance(key, str) else f"GPU {key}"
            if view is None:
                was = _memory_of(before[key]) if key in before else None
                if nvml_available:
                    report.warn(f"{name}: memory could not be read" + (f" ({was.error})" if was and was.error else ""),
                                WarningCode.MEMORY_UNVERIFIED)
                continue
            if key not in readable:
                report.warn(f"{name}: {self._unreadable(view)}", WarningCode.MEMORY_UNVERIFIED)
                continue
            if not self._judge(view).released:
                not_released.append(key)
                kind = self._judge(view, (s.pid for s in report.survived if s.state == "D")).leak
                if kind is not None:
                    report.leaks.append(Leak(gpu=view[0].index, uuid=view[0].uuid, bytes=_memory_of(view).memory_used,
                                             mig_uuid=view[1].uuid if view[1] is not None else "", kind=kind.value))
        report.verified = verified and not not_released
        if report.survived:
            report.outcome = Outcome.SURVIVORS
        elif not_released:
            report.outcome = Outcome.NOT_RELEASED
        elif not report.terminated:
            report.outcome = Outcome.NOTHING
        elif not verified:
            report.outcome = Outcome.UNVERIFIED
        else:
            report.outcome = Outcome.FREED


def _memory_of(view: MemoryView) -> GpuInfo | MigInstance:
    return view[1] or view[0]

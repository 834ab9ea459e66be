"""Ending the holders in a scope: SIGTERM, grace, SIGKILL, then proof through NVML.

A process sent SIGKILL that has not gone after KillTimeoutSec is exiting, not a survivor:
real workloads take tens of seconds to die (a large pinned host cache is unpinned in D state
after SIGKILL, 16-26 s for SGLang). Verification waits for it and for the memory together,
for up to VerifyTimeoutSec, and only what is still there then is reported as survived.

The sweep works on a scan whose processes are pinned by pidfds, so everything it signals is
exactly what it scanned. It never signals a protected holder, and it reports what it could not
end with the reason, and the memory it could not see come back.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from . import procfs
from .attribution import container_matches
from .models import (
    KIND_COMPUTE,
    OUTCOME_DRY_RUN,
    OUTCOME_FREED,
    OUTCOME_NOT_RELEASED,
    OUTCOME_NOTHING,
    OUTCOME_SURVIVORS,
    OUTCOME_UNVERIFIED,
    GpuInfo,
    Holder,
    NvmlSnapshot,
    Report,
    Scope,
)
from .process import ProcessHandle, wait_for_exit

log = logging.getLogger("gpuguard.sweep")

MAX_ROUNDS = 3
MiB = 1024 * 1024


class SweepObserver(Protocol):
    def sweep_started(self, report_id: str, scope: dict[str, object]) -> None: ...

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None: ...


class NullObserver:
    def sweep_started(self, report_id: str, scope: dict[str, object]) -> None:
        pass

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None:
        pass


@dataclass(frozen=True)
class SweepSettings:
    grace_sec: float
    kill_timeout_sec: float
    verify_timeout_sec: float
    released_below_bytes: int
    dry_run: bool
    poll_start_sec: float = 0.005
    poll_max_sec: float = 0.1


Pinned = list[tuple[Holder, ProcessHandle]]
# Returns the holders (protection already decided) with their handles, and the NVML snapshot.
Scanner = Callable[[], tuple[Pinned, NvmlSnapshot, list[str]]]


def gpu_scope(holder: Holder, gpus: tuple[int, ...]) -> tuple[bool, str]:
    """Whether `holder` is on one of `gpus`; for one left out that holds some of their nodes,
    why it was left out.

    NVML's per-GPU lists say which GPUs a process computes on. A process NVML does not list
    (NVML unavailable, a process without a context, a PID namespace NVML does not speak for)
    has only its nodes to show, and every CUDA process holds every GPU's node whichever GPU it
    uses: it is on the scope's GPUs only if every GPU node it holds is in the scope, since
    otherwise it may be a tenant of another GPU."""
    wanted = set(gpus)
    if holder.nvml_gpus:
        return bool(wanted & set(holder.nvml_gpus)), ""
    nodes = set(holder.node_gpus)
    if nodes and nodes <= wanted:
        return True, ""
    if nodes & wanted:
        others = ", ".join(str(g) for g in sorted(nodes - wanted))
        return False, f"also holds GPU {others}; NVML lists it on no GPU"
    return False, ""


def on_nvml_word_alone(holder: Holder) -> bool:
    """NVML lists it, but it holds no device here (no fd, no mapping): NVML's pid may be another
    namespace's, or a pid reused since. Never a target; a zombie is the exception, as it holds
    nothing any more and is never signalled (the sweep reports it with its parent)."""
    return not {"fd", "mmap"} & set(holder.how) and holder.state != "Z"


def in_scope(holder: Holder, scope: Scope) -> bool:
    if scope.adopted and not holder.container and (holder.pid, holder.start_time) in scope.adopted:
        # A leftover of scope.unit outside its cgroup, pinned by start time: the very process
        # the unit watch chose (unitwatch.py), never a recycled PID.
        return not scope.gpus or gpu_scope(holder, scope.gpus)[0]
    if scope.container:
        if not container_matches(holder.container, scope.container):
            return False
    elif scope.unit and holder.container:
        # A unit name without a container means the host's unit, never a container's namesake.
        return False
    if scope.unit and holder.unit != scope.unit:
        return False
    if scope.gpus:
        return gpu_scope(holder, scope.gpus)[0]
    return True


def is_target(holder: Holder, scope: Scope) -> bool:
    return (in_scope(holder, scope) and not holder.protected and not on_nvml_word_alone(holder)
            and (holder.kind == KIND_COMPUTE or scope.include_management))


def _brief(holder: Holder) -> dict[str, object]:
    return {"pid": holder.pid, "comm": holder.comm, "unit": holder.unit,
            "container": holder.container, "kind": holder.kind, "gpus": list(holder.gpus),
            "gpu_memory": holder.gpu_memory, "exe": holder.exe}


def _survivor_reason(pid: int) -> tuple[str, str]:
    stat = procfs.read_stat(pid)
    if stat is None:
        return "", "exited"
    if stat.state == "Z":
        return stat.state, f"zombie: parent {stat.ppid} has not reaped it"
    if stat.state == "D":
        wchan = (procfs.read_wchan(pid) or "").strip()
        where = f" in {wchan}" if wchan and wchan != "0" else ""
        return stat.state, f"uninterruptible (D state){where}: SIGKILL is pending until it wakes"
    return stat.state, f"still running after SIGKILL (state {stat.state})"


def _ignores_sigterm(pid: int) -> bool:
    """Whether SIGTERM cannot end `pid` now: ignored, or a PID namespace's init without a
    handler (signals from an ancestor namespace other than SIGKILL are then dropped)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            fields = dict(line.split(b":", 1) for line in handle.read().splitlines() if b":" in line)
        ignored = int(fields.get(b"SigIgn", b"0").strip(), 16)
        caught = int(fields.get(b"SigCgt", b"0").strip(), 16)
        nspids = fields.get(b"NSpid", b"").split()
    except (OSError, ValueError):
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return bool(ignored & bit) or (len(nspids) > 1 and nspids[-1] == b"1" and not caught & bit)


def _exit_status(pid: int, start_time: int) -> str:
    """How an exited, not yet reaped process ended ("" once reaped: the kernel forgot)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
        fields = data[data.rfind(b")") + 2:].split()
        # Fields 3 (state), 22 (start time) and 52 (exit code, as waitpid() reports it).
        if fields[0] != b"Z" or int(fields[19]) != start_time:
            return ""
        code = int(fields[49])
    except (OSError, IndexError, ValueError):
        return ""
    if not os.WIFSIGNALED(code):
        return f"exited with status {os.WEXITSTATUS(code)}"
    try:
        return f"killed by {signal.Signals(os.WTERMSIG(code)).name}"
    except ValueError:
        return f"killed by signal {os.WTERMSIG(code)}"


def _ended_by(last_sent: str, status: str, sigterm_ignored: bool) -> str:
    """The signal of ours that ended a process, as far as is known; "" for none.

    `last_sent`: the last signal sent before its exit was seen ("" if none yet), `status`:
    _exit_status(), `sigterm_ignored`: SIGTERM could not end it when it was sent.
    """
    sent = {"": set(), "SIGTERM": {"SIGTERM"}, "SIGKILL": {"SIGTERM", "SIGKILL"}}.get(last_sent, set())
    if status.startswith("killed by "):
        killer = status.removeprefix("killed by ")
        return killer if killer in sent else ""
    if status:
        # A normal exit: after a caught SIGTERM that is its answer to ours; otherwise (SIGKILL
        # cannot be caught, an ignored SIGTERM changes nothing) it exited on its own.
        return last_sent if last_sent == "SIGTERM" and not sigterm_ignored else ""
    return "" if last_sent == "SIGTERM" and sigterm_ignored else last_sent


class Sweep:
    def __init__(self, scope: Scope, settings: SweepSettings, scanner: Scanner,
                 snapshot: Callable[[], NvmlSnapshot], requested_by: str, reason: str = "",
                 observer: SweepObserver | None = None) -> None:
        self.scope = scope
        self.settings = settings
        self.scanner = scanner
        self.snapshot = snapshot
        self.observer = observer or NullObserver()
        scope_dict: dict[str, object] = dict(scope.to_dict())
        scope_dict["grace_ms"] = int(settings.grace_sec * 1000)
        self.report = Report(id=uuid.uuid4().hex, started_usec=time.time_ns() // 1000,
                             requested_by=requested_by, reason=reason, scope=scope_dict,
                             dry_run=settings.dry_run)
        self._t0 = time.monotonic()
        # (pid, start time) of every process this sweep dealt with, so a rescan knows them.
        self._handled: set[tuple[int, int]] = set()
        self._terminated_pids: set[int] = set()
        # Sent SIGKILL and not gone after KillTimeoutSec: exiting, not yet survivors (module
        # docstring). pid -> (holder, a handle of our own, when the first signal went out).
        self._exiting: dict[int, tuple[Holder, ProcessHandle, float]] = {}
        # PIDs that could not be ended by the SIGTERM they were sent: if they exit before the
        # SIGKILL, they did so on their own, and the report must not credit SIGTERM.
        self._sigterm_ignored: set[int] = set()

    # -- the whole run -------------------------------------------------------------------

    def run(self) -> Report:
        report = self.report
        self.observer.sweep_started(report.id, dict(report.scope))
        pinned, nvml, warnings = self.scanner()
        report.warnings.extend(warnings)
        targets = self._plan(pinned)
        gpus_in_scope = self._gpus_in_scope(targets, nvml)
        before = {g.index: g for g in nvml.gpus}
        if not nvml.available:
            report.warnings.append(f"{nvml.error or 'NVML unavailable'}: GPU memory cannot be verified")
        if self.settings.dry_run:
            report.outcome = OUTCOME_DRY_RUN
            report.gpus = [self._gpu_entry(before.get(i), i, None) for i in gpus_in_scope]
            self._close(pinned)
            return self._finish()
        rounds = 0
        while targets and rounds < MAX_ROUNDS:
            rounds += 1
            self._terminate(targets)
            self._close(pinned)
            pinned, _, _ = self.scanner()
            targets = [(h, p) for h, p in pinned
                       if is_target(h, self.scope) and (h.pid, h.start_time) not in self._handled]
            for holder, _ in targets:
                report.targets.append(_brief(holder))
            gpus_in_scope = sorted(set(gpus_in_scope) | set(self._gpus_in_scope(targets, nvml)))
        for holder, _ in targets:
            report.survived.append({"pid": holder.pid, "comm": holder.comm, "unit": holder.unit,
                                    "state": holder.state,
                                    "why": f"appeared again after {MAX_ROUNDS} rounds: "
                                           "something keeps starting new holders"})
        self._close(pinned)
        after = self._verify(gpus_in_scope, nvml.available)
        self._report_exiting()
        report.gpus = [self._gpu_entry(before.get(i), i, after.get(i)) for i in gpus_in_scope]
        self._decide_outcome(gpus_in_scope, before, after, nvml.available)
        return self._finish()

    def _finish(self) -> Report:
        self.report.duration_ms = int((time.monotonic() - self._t0) * 1000)
        return self.report

    @staticmethod
    def _close(pinned: Pinned) -> None:
        for _, handle in pinned:
            handle.close()

    # -- planning ------------------------------------------------------------------------

    def _plan(self, pinned: Pinned) -> Pinned:
        targets: Pinned = []
        for holder, handle in pinned:
            if not in_scope(holder, self.scope):
                _, why = gpu_scope(holder, self.scope.gpus)
                if why and in_scope(holder, replace(self.scope, gpus=())):
                    self.report.spared.append({"pid": holder.pid, "comm": holder.comm,
                                               "unit": holder.unit, "why": why})
                continue
            if holder.protected:
                self.report.spared.append({"pid": holder.pid, "comm": holder.comm,
                                           "unit": holder.unit, "why": holder.protected_why})
            elif on_nvml_word_alone(holder):
                self.report.spared.append({
                    "pid": holder.pid, "comm": holder.comm, "unit": holder.unit,
                    "why": "NVML lists it, but it holds no NVIDIA device here "
                           "(another PID namespace's pid, or a reused one?)"})
            elif holder.kind != KIND_COMPUTE and not self.scope.include_management:
                self.report.spared.append({
                    "pid": holder.pid, "comm": holder.comm, "unit": holder.unit,
                    "why": "management client (no CUDA context); include_management ends it"})
            else:
                targets.append((holder, handle))
                self.report.targets.append(_brief(holder))
        return targets

    def _gpus_in_scope(self, targets: Pinned, nvml: NvmlSnapshot) -> list[int]:
        if self.scope.gpus:
            return sorted(self.scope.gpus)
        if self.scope.whole_host:
            return [g.index for g in nvml.gpus]
        return sorted({g for holder, _ in targets for g in holder.gpus})

    # -- termination ---------------------------------------------------------------------

    def _signal(self, holder: Holder, handle: ProcessHandle, sig: signal.Signals) -> str:
        """"sent", "gone" (exited before the signal) or "denied" (not ours to signal)."""
        if sig == signal.SIGTERM and _ignores_sigterm(holder.pid):
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
            if holder.state == "Z":
                # Nothing to signal: a zombie has exited. Only its parent can release it.
                report.survived.append({"pid": holder.pid, "comm": holder.comm,
                                        "unit": holder.unit, "state": "Z",
                                        "why": f"zombie: parent {holder.ppid} has not reaped it"})
                continue
            live[holder.pid] = (holder, handle)
        sent_at: dict[int, float] = {}

        def send_all(sig: signal.Signals, gone_as: str) -> None:
            for pid, (holder, handle) in list(live.items()):
                sent_at.setdefault(pid, time.monotonic())
                result = self._signal(holder, handle, sig)
                if result == "gone":
                    self._record_exit(holder, handle, gone_as, sent_at[pid])
                    del live[pid]
                elif result == "denied":
                    report.survived.append({"pid": pid, "comm": holder.comm, "unit": holder.unit,
                                            "state": holder.state,
                                            "why": f"permission denied sending {sig.name} (run as root)"})
                    del live[pid]

        def wait(sig: signal.Signals, timeout: float) -> None:
            def exited(pid: int, seen_at: float) -> None:
                # Recorded (and announced on the bus) the moment it happens, not when the
                # slowest target is done.
                holder, handle = live.pop(pid)
                self._record_exit(holder, handle, sig.name, sent_at[pid], seen_at)
            wait_for_exit([h for _, h in live.values()], timeout, on_exit=exited)

        send_all(signal.SIGTERM, "")
        wait(signal.SIGTERM, self.settings.grace_sec)
        if live:
            send_all(signal.SIGKILL, signal.SIGTERM.name)
            wait(signal.SIGKILL, self.settings.kill_timeout_sec)
        for pid, (holder, handle) in live.items():
            # SIGKILL is pending: it is exiting, however slowly (a process tearing down a large
            # pinned host cache sits in D state 16-26 s, sglang issue 31746). Verification
            # keeps waiting for it; only what is left when VerifyTimeoutSec ends survived.
            self._exiting[pid] = (holder, handle.dup(), sent_at[pid])

    def _wait_exiting(self, timeout: float) -> None:
        """Sleep up to `timeout`, recording exits of exiting processes the moment they happen;
        returns early once none is left."""
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
            state, why = _survivor_reason(pid)
            waited = self.settings.kill_timeout_sec + self.settings.verify_timeout_sec
            self.report.survived.append({"pid": pid, "comm": holder.comm, "unit": holder.unit,
                                         "state": state, "why": f"{why} ({waited:g} s after SIGKILL)"})
            handle.close()
        self._exiting.clear()

    def _record_exit(self, holder: Holder, handle: ProcessHandle, signal_name: str,
                     sent_at: float, seen_at: float | None = None) -> None:
        seen = time.monotonic() if seen_at is None else seen_at
        # What is known, not what was hoped: the kernel's exit status while it still has it;
        # otherwise SIGTERM is credited only if it could have ended the process.
        status = _exit_status(holder.pid, handle.start_time) if handle.alive() else ""
        signal_name = _ended_by(signal_name, status, holder.pid in self._sigterm_ignored)
        entry: dict[str, object] = {
            "pid": holder.pid, "comm": holder.comm, "unit": holder.unit,
            "signal": signal_name,
            "exited_after_ms": max(0, int((seen - sent_at) * 1000)),
        }
        if status:
            entry["exit_status"] = status
        if handle.alive():
            # Exited but not reaped: harmless unless NVML still charges memory to it (checked
            # at verification), but worth naming the parent that should reap it.
            stat = procfs.read_stat(holder.pid)
            if stat is not None and stat.start_time == handle.start_time:
                entry["zombie_parent"] = stat.ppid
        self.report.terminated.append(entry)
        self._terminated_pids.add(holder.pid)
        self.observer.process_terminated(self.report.id, holder.pid, holder.comm, holder.unit,
                                         signal_name)

    # -- verification --------------------------------------------------------------------

    def _released(self, gpu: GpuInfo) -> bool:
        if gpu.lost or gpu.unknown or (gpu.error and not gpu.memory_total):
            return False
        if any(pid in self._terminated_pids or pid in self._exiting for pid in gpu.processes):
            return False
        others = sum(mem or 0 for pid, mem in gpu.processes.items() if os.path.exists(f"/proc/{pid}"))
        return gpu.memory_used <= self.settings.released_below_bytes + others

    def _verify(self, gpus: list[int], nvml_available: bool) -> dict[int, GpuInfo]:
        """Poll NVML until the memory is back and no target is still exiting, or until
        VerifyTimeoutSec; the last readings."""
        deadline = time.monotonic() + self.settings.verify_timeout_sec
        if not gpus or not nvml_available:
            self._wait_exiting(max(0.0, deadline - time.monotonic()))
            return {}
        delay = self.settings.poll_start_sec
        while True:
            snap = self.snapshot()
            current = {g.index: g for g in snap.gpus if g.index in gpus}
            if not self._exiting and snap.available \
                    and all(i in current and self._released(current[i]) for i in gpus):
                return current
            if time.monotonic() >= deadline:
                return current if snap.available else {}
            # NVML has no "memory released" event; poll fast first, since release is usually
            # quick once the process is gone, then back off.
            self._wait_exiting(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.settings.poll_max_sec)

    def _gpu_entry(self, before: GpuInfo | None, index: int,
                   after: GpuInfo | None) -> dict[str, object]:
        entry: dict[str, object] = {"index": index, "uuid": before.uuid if before else "",
                                    "memory_used_before": before.memory_used if before else 0,
                                    "memory_total": before.memory_total if before else 0}
        if after is not None:
            entry["memory_used_after"] = after.memory_used
            entry["released"] = self._released(after)
        else:
            entry["memory_used_after"] = before.memory_used if before and self.settings.dry_run else 0
            entry["released"] = False
        return entry

    def _decide_outcome(self, gpus: list[int], before: dict[int, GpuInfo],
                        after: dict[int, GpuInfo], nvml_available: bool) -> None:
        report = self.report
        readable = {i: g for i, g in after.items() if not (g.unknown or g.lost)}
        verified = nvml_available and bool(gpus) and all(i in readable for i in gpus)
        not_released: list[int] = []
        for index in gpus:
            gpu = after.get(index)
            if gpu is not None and index not in readable:
                # A hung or lost GPU's figures mean nothing: neither freed nor leaked.
                report.warnings.append(f"GPU {index}: memory could not be read ("
                                       f"{gpu.error or ('lost' if gpu.lost else 'unknown')})")
                continue
            if gpu is None:
                if nvml_available:
                    info = before.get(index)
                    report.warnings.append(
                        f"GPU {index}: memory could not be read"
                        + (f" ({info.error})" if info and info.error else ""))
                continue
            if not self._released(gpu):
                not_released.append(index)
                if not gpu.processes:
                    report.leaks.append({"gpu": index, "uuid": gpu.uuid,
                                         "bytes": gpu.memory_used})
        report.verified = verified and not not_released
        if report.survived:
            report.outcome = OUTCOME_SURVIVORS
        elif not_released:
            report.outcome = OUTCOME_NOT_RELEASED
        elif not report.terminated:
            report.outcome = OUTCOME_NOTHING
        elif not verified:
            report.outcome = OUTCOME_UNVERIFIED
        else:
            report.outcome = OUTCOME_FREED

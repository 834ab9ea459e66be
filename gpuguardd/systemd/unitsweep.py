"""Unit sweeps, one code path for gpuguardd and `gpuguardctl sweep --local`: a unit's escaped
leftovers are swept with it, and one stop gets one sweep. Free of D-Bus: systemd is reached
through `SystemdView` (unitwatch.Systemd on a bus connection, or nothing), scans and sweeps
through the callables the caller gives (the daemon's inventory and runner, or the engine in
the CLI's process).

* `UnitGpuRecords` remembers, for every host unit whose processes hold GPUs, which GPUs those
  were and which processes (PID + start time) were the unit's. The daemon feeds it every scan
  while the units run; a sweep adds what its own scan sees and the unit's
  `CUDA_VISIBLE_DEVICES` (a hint). After the stop, a unit sweep therefore still knows the
  unit's GPUs, even when its processes left the cgroup.
* `UnitSweeps.sweep_unit` sweeps a unit plus its escaped leftovers and makes sure one stop
  gets one sweep.

The escaped-leftover rule. A sweep of unit U also ends a holder H outside U's cgroup when all
of these hold:

1. H runs on the host: a container's processes are never a host unit's leftovers;
2. H is a compute holder (a CUDA context) and not protected (the engine checks both again);
3. H was U's (U may be a container's host scope, docker-<id>.scope, whose processes were the
   container's): either the same process (PID and start time) was seen in U's cgroup by an
   earlier scan, or H holds one of U's GPUs (held by U's processes while U ran or now, or
   named by U's CUDA_VISIBLE_DEVICES);
4. no running unit owns H now: its cgroup belongs to no unit (a slice, the root, a cgroup made
   by hand), or to a unit that systemd reports inactive or failed (or no longer knows).

So a process that moved itself into a session, a `systemd-run --scope`, another service or a
container is left alone: someone running adopted it. And without systemd nothing is adopted,
because there every process looks like it belongs to no unit.

One stop, one sweep: the drop-in runs while the unit is deactivating and the watcher fires once
it is inactive. Both name the unit's InvocationID, and automatic sweeps ("hook:", "watch:") of
the same unit and invocation share one sweep and its report. Dry runs never do: they neither
join nor stand for a stop's sweep, whatever their reason says. A unit that systemd is already
starting again (Restart=) is not swept by the watcher: its new instance owns the GPUs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuguardd.engine.attribution import container_scope_label, normalize_unit_name
from gpuguardd.engine.enums import HolderKind, Outcome
from gpuguardd.engine.models import Holder, NvmlSnapshot, ScanResult, SweepRequest
from gpuguardd.engine.report import Report
from gpuguardd.engine.sweep import gpu_scope
from gpuguardd.systemd.rules import HOOK_PREFIX, RUNNING_STATES, STOPPED_STATES, WATCH_PREFIX, UnitState

__all__ = ["HOOK_PREFIX", "RUNNING_STATES", "STOPPED_STATES", "WATCH_PREFIX", "NoSystemd", "SystemdView",
           "UnitGpuRecord", "UnitGpuRecords", "UnitState", "UnitSweeps", "adoption_candidates",
           "cuda_visible_gpus"]

log = logging.getLogger("gpuguard.unitwatch")

# Without an InvocationID (no systemd), automatic sweeps of one unit this close are one stop.
DEDUPE_WINDOW_SEC = 10.0
# Finished automatic sweeps are remembered this long for a late second trigger of the same stop.
REMEMBER_SEC = 300.0
MAX_UNITS = 1024
MAX_PROCESSES_PER_UNIT = 4096

def cuda_visible_gpus(environment: Sequence[str], nvml: NvmlSnapshot) -> set[int]:
    """NVML indices named by CUDA_VISIBLE_DEVICES in a unit's Environment (a hint only).

    UUIDs (GPU-..., also abbreviated as CUDA allows) are exact. Plain numbers are CUDA
    ordinals, which equal NVML indices when CUDA_DEVICE_ORDER=PCI_BUS_ID and on the usual
    machines with identical GPUs; they only widen where escaped leftovers are looked for.
    """
    value = None
    for item in environment:
        key, _, text = item.partition("=")
        if key == "CUDA_VISIBLE_DEVICES":
            value = text
    if not value:
        return set()
    gpus: set[int] = set()
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        if token.isdigit():
            if nvml.by_index(int(token)) is not None or not nvml.available:
                gpus.add(int(token))
            continue
        if token.startswith("-"):
            break  # CUDA stops at the first invalid ordinal ("-1" hides everything after)
        wanted = token.lower()
        found = [g.index for g in nvml.gpus if g.uuid and g.uuid.lower().startswith(wanted)]
        if len(found) == 1:
            gpus.add(found[0])
    return gpus


# -- what each unit held -------------------------------------------------------------------

@dataclass
class UnitGpuRecord:
    unit: str
    gpus: set[int] = field(default_factory=set)  # held by the unit's processes
    hinted: set[int] = field(default_factory=set)  # from CUDA_VISIBLE_DEVICES
    processes: dict[tuple[int, int], str] = field(default_factory=dict)  # (pid, start) -> comm
    updated: float = field(default_factory=time.monotonic)

    @property
    def all_gpus(self) -> set[int]:
        return self.gpus | self.hinted

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "gpus": sorted(self.gpus), "hinted": sorted(self.hinted),
                "pids": sorted(pid for pid, _ in self.processes)}


class UnitGpuRecords:
    """Per host unit: the GPUs and processes seen in it. Bounded; oldest units go first."""

    def __init__(self, max_units: int = MAX_UNITS) -> None:
        self.max_units = max_units
        self._records: collections.OrderedDict[str, UnitGpuRecord] = collections.OrderedDict()

    def _record(self, unit: str) -> UnitGpuRecord:
        record = self._records.get(unit)
        if record is None:
            record = self._records[unit] = UnitGpuRecord(unit)
            while len(self._records) > self.max_units:
                self._records.popitem(last=False)
        self._records.move_to_end(unit)
        record.updated = time.monotonic()
        return record

    def observe(self, holders: Iterable[Holder]) -> None:
        """Note every host unit's GPU holders from a scan (cheap: holders only)."""
        for holder in holders:
            # A container's processes belong to no host unit, except the container's own
            # host scope (docker-<id>.scope: attribution.container_scope_label).
            host_unit = not holder.container or container_scope_label(holder.unit) == holder.container
            if not holder.unit or not host_unit or not holder.gpus:
                continue
            record = self._record(holder.unit)
            record.gpus.update(holder.gpus)
            if len(record.processes) < MAX_PROCESSES_PER_UNIT:
                record.processes[(holder.pid, holder.start_time)] = holder.comm

    def hint(self, unit: str, gpus: Iterable[int]) -> None:
        wanted = set(gpus)
        if wanted:
            self._record(unit).hinted = wanted

    def get(self, unit: str) -> UnitGpuRecord | None:
        return self._records.get(unit)

    def forget(self, unit: str) -> None:
        self._records.pop(unit, None)

    def units(self) -> list[str]:
        return list(self._records)


def adoption_candidates(unit: str, record: UnitGpuRecord | None, holders: Iterable[Holder],
                        include_management: bool = False) -> list[tuple[Holder, str]]:
    """Rules 1-3 of the module docstring: holders outside `unit` that were its own, with why.

    Rule 4 (no running unit owns them) needs systemd and is checked by the caller.
    """
    if record is None:
        return []
    gpus = record.all_gpus
    found: list[tuple[Holder, str]] = []
    for holder in holders:
        if holder.unit == unit or holder.container or holder.protected:
            continue
        if holder.kind != HolderKind.COMPUTE and not include_management:
            continue
        if (holder.pid, holder.start_time) in record.processes:
            found.append((holder, f"was a process of {unit}"))
        elif gpu_scope(holder, tuple(sorted(gpus)))[0]:
            # The sweep's GPU rule: a CUDA process holds every GPU's node, so one NVML lists
            # elsewhere, or one holding nodes of GPUs the unit never had, is not its leftover.
            shared = ",".join(str(g) for g in sorted(gpus & set(holder.gpus)))
            found.append((holder, f"holds GPU {shared}, which {unit} held"))
    return found


class SystemdView(Protocol):
    """What a unit sweep asks systemd (unitwatch.Systemd over the bus)."""

    available: bool

    async def state(self, unit: str) -> UnitState | None: ...

    async def environment(self, unit: str) -> list[str]: ...


class NoSystemd:
    """No systemd to ask (no bus): nothing is adopted, automatic sweeps dedupe by time."""

    available = False

    async def state(self, unit: str) -> UnitState | None:
        return None

    async def environment(self, unit: str) -> list[str]:
        return []


class UnitSweeps:
    """Unit sweeps with escaped leftovers and one sweep per stop.

    `scan` gives a fresh holder scan; `run` runs a sweep (the daemon's runner: signals on the
    bus, history, journal; or the engine in-process); `dry_run_default` is [Sweep] DryRun,
    for requests that leave dry_run open.
    """

    def __init__(self, systemd: SystemdView, scan: Callable[[], Awaitable[ScanResult]],
                 run: Callable[[SweepRequest], Awaitable[Report]],
                 dry_run_default: Callable[[], bool] = lambda: False) -> None:
        self.systemd = systemd
        self.scan = scan
        self.run = run
        self.dry_run_default = dry_run_default
        self.records = UnitGpuRecords()
        self._inflight: dict[tuple[str, str], asyncio.Future[Report]] = {}
        self._recent: collections.OrderedDict[tuple[str, str], tuple[float, Report]] = \
            collections.OrderedDict()

    async def sweep_unit(self, request: SweepRequest) -> Report | None:
        """Sweep `request.unit` plus its escaped leftovers; automatic triggers share a sweep.

        Returns None only when the watcher's sweep is skipped because the unit runs again.
        """
        unit = normalize_unit_name(request.unit)  # already validated by the caller
        # Only a real sweep stands for a stop: a dry run (which anyone may ask for, with any
        # reason) neither joins nor becomes the stop's sweep, or `nobody` could hand the
        # stop hook a report that signalled nothing. A real sweep with a "hook:" reason is
        # root's or a polkit-authorised caller's (the service checked).
        dry_run = self.dry_run_default() if request.dry_run is None else request.dry_run
        automatic = request.requested_by.startswith((HOOK_PREFIX, WATCH_PREFIX)) and not dry_run
        state = await self.systemd.state(unit) if self.systemd.available else None
        if request.requested_by.startswith(WATCH_PREFIX) and state is not None and state.running:
            log.info("%s is %s again (Restart=?): not sweeping its new instance", unit,
                     state.active_state)
            return None
        if not automatic:
            return await self._sweep(unit, request, state)
        key = (unit, state.invocation_id if state is not None else "")
        self._expire()
        remembered = self._recent.get(key)
        if remembered is not None and (key[1] or time.monotonic() - remembered[0] < DEDUPE_WINDOW_SEC):
            log.info("%s: this stop was already swept (%s); same report", unit, remembered[1].id[:8])
            return remembered[1]
        running = self._inflight.get(key)
        if running is not None:
            log.info("%s: joining the sweep already running for this stop", unit)
            return await asyncio.shield(running)
        future: asyncio.Future[Report] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            report = await self._sweep(unit, request, state)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lone sweep's failure is its caller's to see
            raise
        finally:
            self._inflight.pop(key, None)
        future.set_result(report)
        self._recent[key] = (time.monotonic(), report)
        return report

    def _expire(self) -> None:
        now = time.monotonic()
        while self._recent and now - next(iter(self._recent.values()))[0] > REMEMBER_SEC:
            self._recent.popitem(last=False)

    async def _sweep(self, unit: str, request: SweepRequest, state: UnitState | None) -> Report:
        if not request.container and self.systemd.available:
            request.adopted = await self._adopt(unit, request.include_management)
        report = await self.run(request)
        if not report.dry_run and report.outcome in (Outcome.FREED, Outcome.NOTHING) \
                and (state is None or state.stopped or state.active_state == "deactivating"):
            # Everything the unit left is gone: start afresh with its next instance.
            self.records.forget(unit)
        return report

    async def _adopt(self, unit: str, include_management: bool) -> list[tuple[int, int]]:
        # What the unit still holds now counts too: all a one-shot `gpuguardctl sweep --local`
        # has seen of it, and the daemon's record of a unit that started before it did.
        result = await self.scan()
        self.records.observe(result.holders)
        record = self.records.get(unit)
        if record is None or not record.hinted:
            gpus = cuda_visible_gpus(await self.systemd.environment(unit), result.nvml)
            if gpus:
                self.records.hint(unit, gpus)
                record = self.records.get(unit)
        if record is None:
            return []
        adopted: list[tuple[int, int]] = []
        states: dict[str, UnitState | None] = {}
        for holder, why in adoption_candidates(unit, record, result.holders, include_management):
            owner = holder.unit
            if owner:
                if owner not in states:
                    states[owner] = await self.systemd.state(owner)
                owner_state = states[owner]
                if owner_state is None or owner_state.running:
                    continue  # rule 4: a running unit (or one we cannot ask about) owns it
            log.info("%s: pid %d (%s) is in %s, outside the unit, and %s: swept with it", unit,
                     holder.pid, holder.comm, owner or f"cgroup {holder.cgroup or '?'} of no unit",
                     why)
            adopted.append((holder.pid, holder.start_time))
        return adopted

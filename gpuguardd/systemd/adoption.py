"""The escaped-leftover (adoption) rule, for gpuguardd and `gpuguardctl sweep --local` alike; no
D-Bus or I/O (systemd is a `SystemdView`). `UnitGpuRecords` is fed every scan while the units
run, so a unit sweep still knows the unit's GPUs after its processes left.

A sweep of unit U also ends a holder H outside U's cgroup when all of these hold:

1. H runs on the host: a container's processes are never a host unit's leftovers;
2. H is a compute holder (a CUDA context) and not protected (the engine checks both again);
3. H was U's (U may be a container's host scope, docker-<id>.scope): an earlier scan saw the
   same process (PID and start time) in U's cgroup, or H holds one of U's GPUs (held by U's
   processes, or named by U's CUDA_VISIBLE_DEVICES);
4. no running unit owns H now: its cgroup belongs to no unit (a slice, the root, one made by
   hand), or to one systemd reports inactive or failed (or no longer knows).

So a process that moved itself into a session, a `systemd-run --scope`, another service or a
container is left alone: someone running adopted it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuguardd.engine.attribution import container_scope_label
from gpuguardd.engine.scope import gpu_scope
from gpuguardd.numbers import UINT32_MAX, is_digits
from gpuguardd.records.enums import HolderKind
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult
from gpuguardd.systemd.rules import UnitState

log = logging.getLogger("gpuguard.unitwatch")

MAX_UNITS = 1024
MAX_PROCESSES_PER_UNIT = 4096


def cuda_visible_gpus(environment: Sequence[str], nvml: NvmlSnapshot) -> set[int]:
    """NVML indices named by CUDA_VISIBLE_DEVICES in a unit's Environment (a hint only). UUIDs,
    abbreviated as CUDA allows, are exact; ordinals equal NVML indices under CUDA_DEVICE_ORDER=PCI_BUS_ID
    or with identical GPUs, and only widen where escaped leftovers are looked for."""
    value = dict(item.partition("=")[::2] for item in environment).get("CUDA_VISIBLE_DEVICES")
    if not value:
        return set()
    gpus: set[int] = set()
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        if is_digits(token):
            # A unit's environment is anyone's text: ASCII digits only, and an ordinal too
            # long for a GPU index names no GPU (CUDA would stop there too).
            if len(token) > 10 or int(token) > UINT32_MAX:
                break
            if nvml.by_index(int(token)) is not None or not nvml.available:
                gpus.add(int(token))
            continue
        if token.startswith("-"):
            break  # CUDA stops at the first invalid ordinal ("-1" hides everything after)
        found = [g.index for g in nvml.gpus if g.uuid and g.uuid.lower().startswith(token.lower())]
        if len(found) == 1:
            gpus.add(found[0])
    return gpus


@dataclass
class UnitGpuRecord:
    unit: str
    gpus: set[int] = field(default_factory=set)  # held by the unit's processes
    hinted: set[int] = field(default_factory=set)  # from CUDA_VISIBLE_DEVICES
    processes: dict[tuple[int, int], str] = field(default_factory=dict)  # (pid, start) -> comm

    @property
    def all_gpus(self) -> set[int]:
        return self.gpus | self.hinted


class UnitGpuRecords:
    """Per host unit: the GPUs and processes seen in it. Bounded; oldest units go first."""

    def __init__(self) -> None:
        self._records: collections.OrderedDict[str, UnitGpuRecord] = collections.OrderedDict()

    def _record(self, unit: str) -> UnitGpuRecord:
        record = self._records.get(unit)
        if record is None:
            record = self._records[unit] = UnitGpuRecord(unit)
            while len(self._records) > MAX_UNITS:
                self._records.popitem(last=False)
        self._records.move_to_end(unit)
        return record

    def observe(self, holders: Iterable[Holder]) -> None:
        for holder in holders:
            # A container's processes belong to no host unit but the container's scope (docker-<id>.scope).
            host_unit = not holder.container or container_scope_label(holder.unit) == holder.container
            if not holder.unit or not host_unit or not holder.gpus:
                continue
            record = self._record(holder.unit)
            record.gpus.update(holder.gpus)
            if len(record.processes) < MAX_PROCESSES_PER_UNIT:
                record.processes[(holder.pid, holder.start_time)] = holder.comm

    def hint(self, unit: str, gpus: Iterable[int]) -> UnitGpuRecord:
        record = self._record(unit)
        record.hinted = set(gpus)
        return record

    def get(self, unit: str) -> UnitGpuRecord | None:
        return self._records.get(unit)

    def forget(self, unit: str) -> None:
        self._records.pop(unit, None)

    def units(self) -> list[str]:
        return list(self._records)

    def dump(self) -> list[dict[str, Any]]:
        """What a restarted daemon needs to adopt a unit's escaped workers (units.py)."""
        return [{"unit": r.unit, "gpus": sorted(r.gpus), "hinted": sorted(r.hinted),
                 "processes": sorted([pid, start, comm] for (pid, start), comm in r.processes.items())}
                for r in self._records.values()]

    def restore(self, items: object) -> int:
        """Take back what dump() gave, checked strictly (it comes from a file); the number
        of units restored. Anything not of dump()'s shape is skipped."""
        def count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63

        restored = 0
        for item in items[-MAX_UNITS:] if isinstance(items, list) else []:
            get = item.get if isinstance(item, dict) else {}.get
            unit, gpus, hinted, processes = map(get, ("unit", "gpus", "hinted", "processes"))
            if not (unit and isinstance(unit, str) and isinstance(gpus, list)
                    and isinstance(hinted, list) and isinstance(processes, list)
                    and all(map(count, gpus + hinted))):
                continue
            record = self._record(unit)
            record.gpus.update(gpus)
            record.hinted.update(hinted)
            pairs = [p for p in processes if isinstance(p, list) and len(p) == 3 and count(p[0])
                     and count(p[1]) and isinstance(p[2], str)]
            record.processes.update(((pid, start), comm) for pid, start, comm in pairs[:MAX_PROCESSES_PER_UNIT])
            restored += 1
        return restored


def adoption_candidates(unit: str, record: UnitGpuRecord | None, holders: Iterable[Holder],
                        include_management: bool = False) -> list[tuple[Holder, str]]:
    """Rules 1-3 of the module docstring: holders outside `unit` that were its own, with why.
    Rule 4 needs systemd: the caller checks it."""
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
    available: bool

    async def state(self, unit: str) -> UnitState | None: ...

    async def environment(self, unit: str) -> list[str]: ...

    async def dropins(self, unit: str) -> list[str]: ...


async def leftovers(systemd: SystemdView, records: UnitGpuRecords, unit: str, result: ScanResult,
                    include_management: bool = False) -> list[tuple[int, int]]:
    """(pid, start time) of `unit`'s escaped leftovers in `result`. What the unit holds there
    counts too: all `gpuguardctl sweep --local` sees of it, and all of a unit that started before
    the daemon. Without systemd, nothing: there every process looks like it belongs to no unit."""
    if not systemd.available:
        return []
    records.observe(result.holders)
    record = records.get(unit)
    if record is None or not record.hinted:
        gpus = cuda_visible_gpus(await systemd.environment(unit), result.nvml)
        if gpus:
            record = records.hint(unit, gpus)
    adopted: list[tuple[int, int]] = []
    states: dict[str, UnitState | None] = {}
    for holder, why in adoption_candidates(unit, record, result.holders, include_management):
        owner = holder.unit
        if owner:
            if owner not in states:
                states[owner] = await systemd.state(owner)
            owner_state = states[owner]
            if owner_state is None or owner_state.running:
                continue  # rule 4: a running unit (or one we cannot ask about) owns it
        log.info("%s: pid %d (%s) is in %s, outside the unit, and %s: swept with it", unit,
                 holder.pid, holder.comm, owner or f"cgroup {holder.cgroup or '?'} of no unit", why)
        adopted.append((holder.pid, holder.start_time))
    return adopted

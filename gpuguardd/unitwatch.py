"""Watch mode: sweep a unit when it stops, knowing which GPUs were its own.

Three parts, each usable alone:

* `UnitGpuRecords` remembers, for every host unit whose processes hold GPUs, which GPUs those
  were and which processes (PID + start time) were the unit's. The daemon feeds it every scan
  while the units run; the unit's `CUDA_VISIBLE_DEVICES` is a further hint. After the stop, a
  `SweepUnit` therefore still knows the unit's GPUs, even when its processes left the cgroup.
* `UnitWatcher` follows systemd on the bus (`Subscribe`, then `JobRemoved` and the units'
  `PropertiesChanged`) and calls back when a unit matching `[Watch] Units` has stopped
  (inactive or failed), also for units without an ExecStopPost drop-in.
* `UnitWatch` joins them for the daemon: every unit sweep (from the drop-in's `gpuguardctl
  sweep --unit %n`, from the watcher, or from an admin) goes through `sweep_unit`, which adds
  the unit's escaped leftovers and makes sure one stop gets one sweep.

The escaped-leftover rule. A sweep of unit U also ends a holder H outside U's cgroup when all
of these hold:

1. H runs on the host: a container's processes are never a host unit's leftovers;
2. H is a compute holder (a CUDA context) and not protected (the engine checks both again);
3. H was U's: either the same process (PID and start time) was seen in U's cgroup by an
   earlier scan, or H holds one of U's GPUs (held by U's processes while U ran, or named by
   U's CUDA_VISIBLE_DEVICES);
4. no running unit owns H now: its cgroup belongs to no unit (a slice, the root, a cgroup made
   by hand), or to a unit that systemd reports inactive or failed (or no longer knows).

So a process that moved itself into a session, a `systemd-run --scope`, another service or a
container is left alone: someone running adopted it. And without systemd on the bus nothing
is adopted, because there every process looks like it belongs to no unit.

One stop, one sweep: the drop-in runs while the unit is deactivating and the watcher fires once
it is inactive. Both name the unit's InvocationID, and automatic sweeps ("hook:", "watch:") of
the same unit and invocation share one sweep and its report. Dry runs never do: they neither
join nor stand for a stop's sweep, whatever their reason says. A unit that systemd is already
starting again (Restart=) is not swept by the watcher: its new instance owns the GPUs.
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus

from .attribution import normalize_unit_name
from .bus import name_owner_change
from .models import KIND_COMPUTE, Holder, NvmlSnapshot, Report, ScanResult, SweepRequest

log = logging.getLogger("gpuguard.unitwatch")

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
UNIT_PATH_PREFIX = SYSTEMD_PATH + "/unit/"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"

STOPPED_STATES = frozenset({"inactive", "failed"})
# A unit in these states runs (or is about to): its GPUs are its own.
RUNNING_STATES = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})
HOOK_PREFIX = "hook:"
WATCH_PREFIX = "watch:"
# Without an InvocationID (no systemd), automatic sweeps of one unit this close are one stop.
DEDUPE_WINDOW_SEC = 10.0
# Finished automatic sweeps are remembered this long for a late second trigger of the same stop.
REMEMBER_SEC = 300.0
CALL_TIMEOUT_SEC = 5.0
MAX_UNITS = 1024
MAX_PROCESSES_PER_UNIT = 4096

_ESCAPE = re.compile(r"_([0-9a-fA-F]{2})")


def unit_name_from_path(path: str) -> str:
    """systemd's unit object path back to the unit name ("sglang_2ddemo_2eservice")."""
    if not path.startswith(UNIT_PATH_PREFIX):
        return ""
    label = path[len(UNIT_PATH_PREFIX):]
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), label)


def matches(unit: str, patterns: Iterable[str]) -> bool:
    """fnmatch over unit names; a pattern without a suffix means a .service ("sglang-*")."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(unit, pattern):
            return True
        if "." not in pattern.rsplit("*", 1)[-1] and unit.endswith(".service") \
                and fnmatch.fnmatchcase(unit, pattern + ".service"):
            return True
    return False


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
            if not holder.unit or holder.container or not holder.gpus:
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
        if holder.kind != KIND_COMPUTE and not include_management:
            continue
        if (holder.pid, holder.start_time) in record.processes:
            found.append((holder, f"was a process of {unit}"))
        elif gpus & set(holder.gpus):
            shared = ",".join(str(g) for g in sorted(gpus & set(holder.gpus)))
            found.append((holder, f"holds GPU {shared}, which {unit} held"))
    return found


# -- systemd on the bus --------------------------------------------------------------------

@dataclass(frozen=True)
class UnitState:
    unit: str
    active_state: str  # "" when systemd does not know the unit (not loaded)
    sub_state: str = ""
    invocation_id: str = ""
    result: str = ""

    @property
    def stopped(self) -> bool:
        return self.active_state in STOPPED_STATES or not self.active_state

    @property
    def running(self) -> bool:
        return self.active_state in RUNNING_STATES


class Systemd:
    """The few systemd manager calls the watch needs, over an existing dbus-fast connection."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.available = False
        # The last state read of each unit. systemd unloads an inactive unit nobody references
        # right after it stops, and with it its InvocationID and Result: the watcher, asking a
        # moment later, gets those from here (the hook's sweep read them while it stopped).
        self._known: collections.OrderedDict[str, UnitState] = collections.OrderedDict()

    async def _call(self, path: str, interface: str, member: str, signature: str = "",
                    body: Sequence[Any] = ()) -> Message | None:
        message = Message(destination=SYSTEMD, path=path, interface=interface, member=member,
                          signature=signature, body=list(body),
                          # systemd is never bus-activated; a bus without it answers at once.
                          flags=MessageFlag.NO_AUTOSTART)
        try:
            reply = await asyncio.wait_for(self.bus.call(message), CALL_TIMEOUT_SEC)
        except (asyncio.TimeoutError, OSError, EOFError) as exc:
            log.debug("systemd %s: %s", member, exc)
            return None
        return reply

    async def subscribe(self) -> bool:
        reply = await self._call(SYSTEMD_PATH, MANAGER_IFACE, "Subscribe")
        self.available = reply is not None and reply.message_type == MessageType.METHOD_RETURN
        if reply is not None and not self.available:
            log.info("unit watch off: systemd is not on this bus (%s)", reply.error_name)
        return self.available

    async def unit_path(self, unit: str) -> str | None:
        reply = await self._call(SYSTEMD_PATH, MANAGER_IFACE, "GetUnit", "s", [unit])
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            return None  # NoSuchUnit: not loaded, so not running either
        return str(reply.body[0])

    async def get(self, path: str, interface: str, name: str) -> Any | None:
        # One property at a time: GetAll of a service is a few hundred properties.
        reply = await self._call(path, PROPERTIES_IFACE, "Get", "ss", [interface, name])
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            return None
        return reply.body[0].value

    async def state(self, unit: str) -> UnitState | None:
        """The unit's state; ActiveState "" if systemd does not know it; None if no systemd."""
        if not self.available:
            return None
        path = await self.unit_path(unit)
        if path is None:
            known = self._known.get(unit)
            return UnitState(unit, "", "", known.invocation_id if known else "",
                             known.result if known else "")
        active, sub, invocation, result = await asyncio.gather(
            self.get(path, UNIT_IFACE, "ActiveState"), self.get(path, UNIT_IFACE, "SubState"),
            self.get(path, UNIT_IFACE, "InvocationID"),
            self.get(path, SERVICE_IFACE, "Result") if unit.endswith(".service")
            else asyncio.sleep(0))
        if active is None:
            return None
        state = UnitState(unit, str(active), str(sub or ""),
                          bytes(invocation).hex() if isinstance(invocation, (bytes, list)) else "",
                          str(result or ""))
        if state.invocation_id:
            self._known[unit] = state
            self._known.move_to_end(unit)
            while len(self._known) > 4 * MAX_UNITS:
                self._known.popitem(last=False)
        return state

    async def environment(self, unit: str) -> list[str]:
        path = await self.unit_path(unit)
        if path is None or not unit.endswith(".service"):
            return []
        value = await self.get(path, SERVICE_IFACE, "Environment")
        return [str(item) for item in value or []]


async def _add_match(bus: MessageBus, rule: str) -> None:
    reply = await bus.call(Message(destination=DBUS, path="/org/freedesktop/DBus", interface=DBUS,
                                   member="AddMatch", signature="s", body=[rule]))
    if reply is not None and reply.message_type == MessageType.ERROR:
        raise OSError(f"AddMatch {rule}: {reply.error_name}")


class UnitWatcher:
    """Calls `on_stopped(state)` once per stop of a unit matching `patterns`, and
    `on_active(unit)` when any service becomes active (for GPU hints).

    Only signals from systemd's own connection count; each event is confirmed by asking
    systemd for the unit's state, so a forged or stale signal can at most cause a lookup.
    """

    def __init__(self, bus: MessageBus, systemd: Systemd, patterns: Sequence[str],
                 on_stopped: Callable[[UnitState], Awaitable[None]],
                 on_active: Callable[[UnitState], Awaitable[None]] | None = None) -> None:
        self.bus = bus
        self.systemd = systemd
        self.patterns = tuple(patterns)
        self.on_stopped = on_stopped
        self.on_active = on_active
        self._owner = ""
        self._last: dict[str, str] = {}  # unit -> last ActiveState seen
        self._handled: collections.deque[tuple[str, str]] = collections.deque(maxlen=1024)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False

    def set_patterns(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)

    async def start(self) -> bool:
        if not self._started:
            self._started = True
            self.bus.add_message_handler(self._on_message)
            for rule in (f"type='signal',sender='{SYSTEMD}',interface='{MANAGER_IFACE}',"
                         "member='JobRemoved'",
                         f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES_IFACE}',"
                         f"member='PropertiesChanged',path_namespace='{SYSTEMD_PATH}/unit'",
                         f"type='signal',sender='{DBUS}',interface='{DBUS}',"
                         f"member='NameOwnerChanged',arg0='{SYSTEMD}'"):
                await _add_match(self.bus, rule)
        return await self._subscribe()

    async def _subscribe(self) -> bool:
        reply = await self.bus.call(Message(destination=DBUS, path="/org/freedesktop/DBus",
                                            interface=DBUS, member="GetNameOwner", signature="s",
                                            body=[SYSTEMD]))
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            self._owner = ""
            self.systemd.available = False
            log.info("unit watch off: no systemd on this bus")
            return False
        self._owner = str(reply.body[0])
        ok = await self.systemd.subscribe()
        if ok:
            log.info("watching systemd units%s", f" matching {' '.join(self.patterns)}"
                     if self.patterns else " (no [Watch] Units: recording GPUs only)")
        return ok

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_message(self, msg: Message) -> bool | None:
        if msg.message_type != MessageType.SIGNAL:
            return None
        # Every signal is checked for its sender: the bus daemon's own, or systemd's current
        # unique name. Anyone may send any signal straight to our connection (bus.py).
        new_owner = name_owner_change(msg, SYSTEMD)
        if new_owner is not None:
            # systemd re-executed (daemon-reexec) or came back: subscriptions are per
            # connection, so subscribe again on its new one.
            if new_owner:
                self._spawn(self._resubscribe())
            else:
                self._owner = ""
                self.systemd.available = False
            return None
        if not self._owner or msg.sender != self._owner:
            return None
        if msg.member == "JobRemoved" and msg.interface == MANAGER_IFACE and len(msg.body) == 4:
            unit = str(msg.body[2])
            if matches(unit, self.patterns):
                self._consider(unit, job_done=True)
        elif msg.member == "PropertiesChanged" and len(msg.body) == 3 and msg.body[0] == UNIT_IFACE:
            unit = unit_name_from_path(msg.path or "")
            if not unit:
                return None
            if matches(unit, self.patterns):
                self._consider(unit, job_done=False)
            elif self.on_active is not None and unit.endswith(".service"):
                # Other services matter only as they start (CUDA_VISIBLE_DEVICES hint): no
                # lookups for the many state changes of every other unit on the host.
                changed = msg.body[1].get("ActiveState")
                if changed is not None and changed.value == "active":
                    self._consider(unit, job_done=False)
        return None

    async def _resubscribe(self) -> None:
        try:
            await self._subscribe()
        except Exception as exc:  # the bus went away: the daemon notices and exits
            log.warning("re-subscribing to systemd failed: %s", exc)

    def _consider(self, unit: str, job_done: bool) -> None:
        """Coalesce bursts of signals for one unit into one look at its state."""
        if job_done:
            self._again.add(unit)
        if unit in self._pending:
            return
        self._pending[unit] = task = asyncio.ensure_future(self._look(unit))
        task.add_done_callback(lambda _t: self._pending.pop(unit, None))

    async def _look(self, unit: str) -> None:
        await asyncio.sleep(0)  # let the rest of this burst of signals arrive first
        job_done = unit in self._again
        self._again.discard(unit)
        try:
            state = await self.systemd.state(unit)
        except Exception as exc:
            log.warning("reading the state of %s: %s", unit, exc)
            return
        if state is None:
            return
        previous = self._last.get(unit, "")
        self._last[unit] = state.active_state
        if len(self._last) > 4 * MAX_UNITS:
            self._last.pop(next(iter(self._last)))
        if state.active_state == "active" and previous != "active" and self.on_active:
            await self._guarded(self.on_active, state)
        if not matches(unit, self.patterns) or not state.stopped:
            return
        # A transition seen, or a finished job: a daemon-reload re-announcing an inactive unit
        # is neither, and must not sweep every watched unit.
        if not job_done and (previous in STOPPED_STATES or previous == ""):
            return
        key = (unit, state.invocation_id)
        if key in self._handled:
            return
        self._handled.append(key)
        await self._guarded(self.on_stopped, state)

    @staticmethod
    async def _guarded(callback: Callable[[UnitState], Awaitable[None]], state: UnitState) -> None:
        try:
            await callback(state)
        except Exception:
            log.exception("handling %s (%s)", state.unit, state.active_state)


# -- the daemon's side -----------------------------------------------------------------------

class UnitWatch:
    """Records, watcher and one-sweep-per-stop, for the daemon's Service.

    `scan` gives a fresh holder scan (the daemon's shared inventory scan); `run` runs a sweep
    the way every other daemon sweep runs (signals on the bus, history, journal).
    """

    def __init__(self, bus: MessageBus, patterns: Callable[[], Sequence[str]],
                 snapshot: Callable[[], NvmlSnapshot],
                 scan: Callable[[], Awaitable[ScanResult]],
                 run: Callable[[SweepRequest], Awaitable[Report]],
                 dry_run_default: Callable[[], bool] = lambda: False) -> None:
        self.patterns = patterns
        self.dry_run_default = dry_run_default  # [Sweep] DryRun, for requests that leave it open
        self.snapshot = snapshot
        self.scan = scan
        self.run = run
        self.records = UnitGpuRecords()
        self.systemd = Systemd(bus)
        self.watcher = UnitWatcher(bus, self.systemd, patterns(), self._stopped, self._active)
        self._inflight: dict[tuple[str, str], asyncio.Future[Report]] = {}
        self._recent: collections.OrderedDict[tuple[str, str], tuple[float, Report]] = \
            collections.OrderedDict()

    async def start(self) -> None:
        try:
            await self.watcher.start()
        except Exception as exc:  # never keep the daemon from serving its API
            log.warning("unit watch off: %s", exc)

    def config_changed(self) -> None:
        self.watcher.set_patterns(self.patterns())

    def observe(self, holders: Iterable[Holder]) -> None:
        self.records.observe(holders)

    async def _active(self, state: UnitState) -> None:
        environment = await self.systemd.environment(state.unit)
        gpus = cuda_visible_gpus(environment, self.snapshot())
        if gpus:
            self.records.hint(state.unit, gpus)
        if matches(state.unit, self.patterns()):
            # A watched unit just started: note what it holds already. Later holdings arrive
            # with the daemon's refreshes (NVML's process lists change as CUDA contexts open).
            self.records.observe((await self.scan()).holders)

    async def _stopped(self, state: UnitState) -> None:
        request = SweepRequest(unit=state.unit, requested_by=f"{WATCH_PREFIX}{state.unit}",
                               reason=f"{WATCH_PREFIX}{state.unit} result={state.result or '-'}"
                                      f" state={state.active_state or 'unloaded'}")
        log.info("%s stopped (%s%s): sweeping it", state.unit, state.active_state or "unloaded",
                 f", result {state.result}" if state.result else "")
        await self.sweep_unit(request)

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
        if not report.dry_run and report.outcome in ("freed", "nothing-to-do") \
                and (state is None or state.stopped or state.active_state == "deactivating"):
            # Everything the unit left is gone: start afresh with its next instance.
            self.records.forget(unit)
        return report

    async def _adopt(self, unit: str, include_management: bool) -> list[tuple[int, int]]:
        record = self.records.get(unit)
        if record is None:
            return []
        result = await self.scan()
        self.records.observe(result.holders)
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

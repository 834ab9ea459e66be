"""Watch mode: sweep a unit when it stops, knowing which GPUs were its own (the D-Bus side).

* `Systemd` asks systemd's manager on the bus for units' states and environments.
* `UnitWatcher` follows systemd on the bus (`Subscribe`, then `JobRemoved` and the units'
  `PropertiesChanged`) and calls back when a unit matching `[Watch] Units` has stopped
  (inactive or failed), also for units without an ExecStopPost drop-in.
* `UnitWatch` joins them with unitsweep.UnitSweeps for the daemon: every unit sweep (from the
  drop-in's `gpuguardctl sweep --unit %n`, from the watcher, or from an admin) goes through
  `sweep_unit`, which adds the unit's escaped leftovers and makes sure one stop gets one
  sweep. `gpuguardctl sweep --local --unit` takes the same path (`local_systemd`).

The escaped-leftover rule and one sweep per stop: unitsweep.py.
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from dbus_fast import BusType, Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import name_owner, name_owner_change
from gpuguardd.engine.models import Holder, NvmlSnapshot, Report, ScanResult, SweepRequest
from gpuguardd.systemd.unitsweep import (
    MAX_UNITS,
    STOPPED_STATES,
    WATCH_PREFIX,
    NoSystemd,
    UnitGpuRecords,
    UnitState,
    UnitSweeps,
    adoption_candidates,
    cuda_visible_gpus,
)

__all__ = ["Systemd", "UnitGpuRecords", "UnitState", "UnitWatch", "UnitWatcher",
           "adoption_candidates", "cuda_visible_gpus", "matches", "unit_name_from_path"]

log = logging.getLogger("gpuguard.unitwatch")

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
UNIT_PATH_PREFIX = SYSTEMD_PATH + "/unit/"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
DBUS = "org.freedesktop.DBus"

CALL_TIMEOUT_SEC = 5.0

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


# -- systemd on the bus --------------------------------------------------------------------

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


async def local_systemd(address: str | None) -> tuple[Systemd | NoSystemd, MessageBus | None]:
    """systemd's manager on the system bus (or `address`), for a unit sweep outside the
    daemon (`gpuguardctl sweep --local`), and the connection to close afterwards; NoSystemd
    where there is no bus or no systemd on it (then nothing is adopted, as in the daemon)."""
    try:
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        await asyncio.wait_for(bus.connect(), CALL_TIMEOUT_SEC)
    except Exception as exc:  # OSError, AuthError, a wedged bus...
        log.info("no bus to ask systemd about the unit (%s): its escaped leftovers are not "
                 "looked for", exc)
        return NoSystemd(), None
    owner = await asyncio.wait_for(name_owner(bus, SYSTEMD), CALL_TIMEOUT_SEC)
    systemd = Systemd(bus)
    systemd.available = bool(owner)
    if not systemd.available:
        log.info("no systemd on the bus: the unit's escaped leftovers are not looked for")
    return systemd, bus


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
        self._owner = await name_owner(self.bus, SYSTEMD)
        if not self._owner:
            self.systemd.available = False
            log.info("unit watch off: no systemd on this bus")
            return False
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

class UnitWatch(UnitSweeps):
    """Records, watcher and one-sweep-per-stop, for the daemon's Service.

    `scan` gives a fresh holder scan (the daemon's shared inventory scan); `run` runs a sweep
    the way every other daemon sweep runs (signals on the bus, history, journal).
    """

    def __init__(self, bus: MessageBus, patterns: Callable[[], Sequence[str]],
                 snapshot: Callable[[], NvmlSnapshot],
                 scan: Callable[[], Awaitable[ScanResult]],
                 run: Callable[[SweepRequest], Awaitable[Report]],
                 dry_run_default: Callable[[], bool] = lambda: False) -> None:
        systemd = Systemd(bus)
        super().__init__(systemd, scan, run, dry_run_default)
        self.patterns = patterns
        self.snapshot = snapshot
        self.watcher = UnitWatcher(bus, systemd, patterns(), self._stopped, self._active)

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

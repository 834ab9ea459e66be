"""systemd's manager on the bus: `Systemd`, the few calls unit sweeps make, and `UnitWatcher`,
which follows its signals and reports each stop of a unit matching `[Watch] Units` (drop-in or
not) and each service that starts. What counts as a stop is rules.py's."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from dbus_fast import BusType, Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import BUS_DAEMON, bus_daemon_call, name_owner, name_owner_change
from gpuguardd.bus.names import PROPERTIES_INTERFACE
from gpuguardd.systemd.adoption import MAX_UNITS
from gpuguardd.systemd.rules import UnitState, is_stop_to_sweep, matches, unit_name_from_path

log = logging.getLogger("gpuguard.unitwatch")

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"

CALL_TIMEOUT_SEC = 5.0


class Systemd:
    """Without a bus (`bus` None) there is no systemd to ask: nothing is adopted, automatic sweeps dedupe by time."""

    def __init__(self, bus: MessageBus | None) -> None:
        self.bus = bus
        self.available = False
        # systemd unloads an unreferenced unit right after it stops, with its InvocationID and Result:
        # the watcher, asking a moment later, gets them from the last read (the hook sweep's, as it stopped).
        self._known: collections.OrderedDict[str, UnitState] = collections.OrderedDict()

    async def call(self, path: str, interface: str, member: str, signature: str = "",
                   body: Sequence[Any] = ()) -> Message | None:
        if self.bus is None:
            return None
        # systemd is never bus-activated: with NO_AUTOSTART a bus without it answers at once.
        message = Message(destination=SYSTEMD, path=path, interface=interface, member=member, signature=signature,
                          body=list(body), flags=MessageFlag.NO_AUTOSTART)
        try:
            return await asyncio.wait_for(self.bus.call(message), CALL_TIMEOUT_SEC)
        except (asyncio.TimeoutError, OSError, EOFError) as exc:
            log.debug("systemd %s: %s", member, exc)
            return None

    async def unit_path(self, unit: str) -> str | None:
        reply = await self.call(SYSTEMD_PATH, MANAGER_IFACE, "GetUnit", "s", [unit])
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            return None  # NoSuchUnit: not loaded, so not running either
        return str(reply.body[0])

    async def get(self, path: str | None, interface: str, name: str) -> Any | None:
        # One property at a time: GetAll of a service is a few hundred properties.
        reply = None if path is None else await self.call(path, PROPERTIES_INTERFACE, "Get", "ss", [interface, name])
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
            return replace(known, active_state="") if known else UnitState(unit, "")
        active, invocation, result = await asyncio.gather(
            self.get(path, UNIT_IFACE, "ActiveState"), self.get(path, UNIT_IFACE, "InvocationID"),
            self.get(path, SERVICE_IFACE, "Result") if unit.endswith(".service") else asyncio.sleep(0))
        if active is None:
            return None
        state = UnitState(unit, str(active),
                          bytes(invocation).hex() if isinstance(invocation, (bytes, list)) else "",
                          str(result or ""))
        if state.invocation_id:
            self._known[unit] = state
            self._known.move_to_end(unit)
            while len(self._known) > 4 * MAX_UNITS:
                self._known.popitem(last=False)
        return state

    async def environment(self, unit: str) -> list[str]:
        if not unit.endswith(".service"):
            return []
        value = await self.get(await self.unit_path(unit), SERVICE_IFACE, "Environment")
        return [str(item) for item in value or []]

    async def dropins(self, unit: str) -> list[str]:
        value = await self.get(await self.unit_path(unit), UNIT_IFACE, "DropInPaths")
        return [str(item) for item in value or []] if isinstance(value, list) else []


async def local_systemd(address: str | None) -> tuple[Systemd, MessageBus | None]:
    """systemd for `gpuguardctl sweep --local`, and the connection to close afterwards; without a
    bus or systemd on it, one not available: nothing is adopted, as in the daemon."""
    try:
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        await asyncio.wait_for(bus.connect(), CALL_TIMEOUT_SEC)
    except Exception as exc:  # OSError, AuthError, a wedged bus...
        log.info("no bus to ask systemd about the unit (%s): its escaped leftovers are not looked for", exc)
        return Systemd(None), None
    systemd = Systemd(bus)
    systemd.available = bool(await asyncio.wait_for(name_owner(bus, SYSTEMD), CALL_TIMEOUT_SEC))
    if not systemd.available:
        log.info("no systemd on the bus: the unit's escaped leftovers are not looked for")
    return systemd, bus


class UnitEvent(NamedTuple):
    state: UnitState
    stopped: bool  # a watched unit's stop (once per stop); else a service that became active


class UnitWatcher:
    """Only signals from systemd's own connection count; each event is confirmed by asking
    systemd for the unit's state, so a forged or stale signal can at most cause a lookup."""

    def __init__(self, bus: MessageBus, systemd: Systemd, patterns: Sequence[str]) -> None:
        self.bus = bus
        self.systemd = systemd
        self.patterns = tuple(patterns)
        self.events: asyncio.Queue[UnitEvent] = asyncio.Queue()
        self._owner = ""
        self._last: dict[str, str] = {}  # unit -> last ActiveState seen
        self._handled: collections.deque[tuple[str, str]] = collections.deque(maxlen=1024)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._stale: set[str] = set()  # signalled while its state was being read: read again
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> bool:
        self.bus.add_message_handler(self._on_message)
        for rule in (f"type='signal',sender='{SYSTEMD}',interface='{MANAGER_IFACE}',member='JobRemoved'",
                     f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES_INTERFACE}',"
                     f"member='PropertiesChanged',path_namespace='{SYSTEMD_PATH}/unit'",
                     f"type='signal',sender='{BUS_DAEMON}',interface='{BUS_DAEMON}',"
                     f"member='NameOwnerChanged',arg0='{SYSTEMD}'"):
            reply = await bus_daemon_call(self.bus, "AddMatch", "s", [rule])
            if reply is not None and reply.message_type == MessageType.ERROR:
                raise OSError(f"AddMatch {rule}: {reply.error_name}")
        return await self._subscribe()

    async def _subscribe(self) -> bool:
        self._owner = await name_owner(self.bus, SYSTEMD)
        if not self._owner:
            self.systemd.available = False
            log.info("unit watch off: no systemd on this bus")
            return False
        reply = await self.systemd.call(SYSTEMD_PATH, MANAGER_IFACE, "Subscribe")
        self.systemd.available = reply is not None and reply.message_type == MessageType.METHOD_RETURN
        if self.systemd.available:
            log.info("watching systemd units%s", f" matching {' '.join(self.patterns)}"
                     if self.patterns else " (no [Watch] Units: recording GPUs only)")
        elif reply is not None:
            log.info("unit watch off: systemd is not on this bus (%s)", reply.error_name)
        return self.systemd.available

    def _on_message(self, msg: Message) -> bool | None:
        if msg.message_type != MessageType.SIGNAL:
            return None
        # Anyone may send any signal straight to our connection: only the bus daemon's and systemd's count.
        new_owner = name_owner_change(msg, SYSTEMD)
        if new_owner is not None:
            # systemd re-executed or came back: subscriptions are per connection, so anew.
            if new_owner:
                task = asyncio.ensure_future(self._resubscribe())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
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
            elif unit.endswith(".service"):
                # Other services matter only as they start (CUDA_VISIBLE_DEVICES): no lookup per change.
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
        """One look at the unit's state per burst of signals; one more after a look that a signal
        arrived during (the stop's JobRemoved while it read "deactivating"; the unit then
        unloaded and no signal comes again)."""
        if job_done:
            self._again.add(unit)
        if unit in self._pending:
            self._stale.add(unit)
            return
        self._pending[unit] = task = asyncio.ensure_future(self._look(unit))
        task.add_done_callback(lambda done: self._looked(unit, done))

    def _looked(self, unit: str, task: asyncio.Task[None]) -> None:
        self._pending.pop(unit, None)
        if unit in self._stale and not task.cancelled():  # cancelled: gpuguardd is stopping
            self._stale.discard(unit)
            self._consider(unit, job_done=False)

    async def _look(self, unit: str) -> None:
        await asyncio.sleep(0)  # let the rest of this burst of signals arrive first
        job_done = unit in self._again
        self._again.discard(unit)
        self._stale.discard(unit)  # what arrived so far, this look reads the state after
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
        if state.active_state == "active" and previous != "active":  # it started: read its CUDA_VISIBLE_DEVICES
            self.events.put_nowait(UnitEvent(state, stopped=False))
        if not matches(unit, self.patterns) or not is_stop_to_sweep(previous, state, job_done):
            return
        key = (unit, state.invocation_id)
        if key in self._handled:
            return
        self._handled.append(key)
        self.events.put_nowait(UnitEvent(state, stopped=True))

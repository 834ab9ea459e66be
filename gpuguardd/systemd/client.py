"""systemd's manager on the bus (org.freedesktop.systemd1): the few calls the unit watch and
unit sweeps make (adoption.SystemdView, plus the watcher's Subscribe)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any

from dbus_fast import BusType, Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import name_owner
from gpuguardd.bus.names import PROPERTIES_INTERFACE
from gpuguardd.systemd.adoption import MAX_UNITS
from gpuguardd.systemd.rules import UnitState

log = logging.getLogger("gpuguard.unitwatch")

SYSTEMD = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"

CALL_TIMEOUT_SEC = 5.0


class Systemd:
    """Without a bus (`bus` None) there is no systemd to ask: nothing is adopted, automatic
    sweeps dedupe by time."""

    def __init__(self, bus: MessageBus | None) -> None:
        self.bus = bus
        self.available = False
        # The last state read of each unit. systemd unloads an inactive unit nobody references
        # right after it stops, and with it its InvocationID and Result: the watcher, asking a
        # moment later, gets those from here (the hook's sweep read them while it stopped).
        self._known: collections.OrderedDict[str, UnitState] = collections.OrderedDict()

    async def _call(self, path: str, interface: str, member: str, signature: str = "",
                    body: Sequence[Any] = ()) -> Message | None:
        if self.bus is None:
            return None
        message = Message(destination=SYSTEMD, path=path, interface=interface, member=member,
                          signature=signature, body=list(body),
                          # systemd is never bus-activated; a bus without it answers at once.
                          flags=MessageFlag.NO_AUTOSTART)
        try:
            return await asyncio.wait_for(self.bus.call(message), CALL_TIMEOUT_SEC)
        except (asyncio.TimeoutError, OSError, EOFError) as exc:
            log.debug("systemd %s: %s", member, exc)
            return None

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

    async def get(self, path: str | None, interface: str, name: str) -> Any | None:
        # One property at a time: GetAll of a service is a few hundred properties.
        reply = None if path is None else await self._call(
            path, PROPERTIES_INTERFACE, "Get", "ss", [interface, name])
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
            return UnitState(unit, "", known.invocation_id if known else "",
                             known.result if known else "")
        active, invocation, result = await asyncio.gather(
            self.get(path, UNIT_IFACE, "ActiveState"), self.get(path, UNIT_IFACE, "InvocationID"),
            self.get(path, SERVICE_IFACE, "Result") if unit.endswith(".service")
            else asyncio.sleep(0))
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
        """The unit's drop-in files (DropInPaths): whether gpuguard's hook applies to it."""
        value = await self.get(await self.unit_path(unit), UNIT_IFACE, "DropInPaths")
        return [str(item) for item in value or []] if isinstance(value, list) else []


async def local_systemd(address: str | None) -> tuple[Systemd, MessageBus | None]:
    """systemd's manager on the system bus (or `address`), for a unit sweep outside the
    daemon (`gpuguardctl sweep --local`), and the connection to close afterwards; one with no
    bus where there is no bus or no systemd on it (then nothing is adopted, as in the daemon)."""
    try:
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        await asyncio.wait_for(bus.connect(), CALL_TIMEOUT_SEC)
    except Exception as exc:  # OSError, AuthError, a wedged bus...
        log.info("no bus to ask systemd about the unit (%s): its escaped leftovers are not "
                 "looked for", exc)
        return Systemd(None), None
    owner = await asyncio.wait_for(name_owner(bus, SYSTEMD), CALL_TIMEOUT_SEC)
    systemd = Systemd(bus)
    systemd.available = bool(owner)
    if not systemd.available:
        log.info("no systemd on the bus: the unit's escaped leftovers are not looked for")
    return systemd, bus

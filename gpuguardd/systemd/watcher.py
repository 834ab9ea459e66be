"""The unit watcher: follows systemd on the bus (`Subscribe`, then `JobRemoved` and the units'
`PropertiesChanged`) and reports, on `events`, when a unit matching `[Watch] Units` has
stopped (inactive or failed), also for units without an ExecStopPost drop-in, and when a
service starts. What counts as a stop is rules.py's; systemd is asked through client.Systemd.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Sequence
from typing import NamedTuple

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import BUS_DAEMON, bus_daemon_call, name_owner, name_owner_change
from gpuguardd.bus.names import PROPERTIES_INTERFACE
from gpuguardd.systemd.adoption import MAX_UNITS
from gpuguardd.systemd.client import MANAGER_IFACE, SYSTEMD, SYSTEMD_PATH, UNIT_IFACE, Systemd
from gpuguardd.systemd.rules import UnitState, became_active, is_stop_to_sweep, matches, unit_name_from_path

log = logging.getLogger("gpuguard.unitwatch")


class UnitEvent(NamedTuple):
    state: UnitState
    stopped: bool  # a watched unit's stop (once per stop); else a service that became active


class UnitWatcher:
    """Puts on `events` each stop of a unit matching `patterns`, once, and each service that
    becomes active (for GPU hints).

    Only signals from systemd's own connection count; each event is confirmed by asking
    systemd for the unit's state, so a forged or stale signal can at most cause a lookup.
    """

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
        self._started = False

    async def start(self) -> bool:
        if not self._started:
            self._started = True
            self.bus.add_message_handler(self._on_message)
            for rule in (f"type='signal',sender='{SYSTEMD}',interface='{MANAGER_IFACE}',"
                         "member='JobRemoved'",
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
        # unique name. Anyone may send any signal straight to our connection (bus/connection.py).
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
            elif unit.endswith(".service"):
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
        """Coalesce bursts of signals for one unit into one look at its state. A signal that
        arrives while the look is reading the state may mean a state the look did not see (the
        stop's JobRemoved while it read "deactivating"; the unit then unloaded, and no signal
        comes again): the unit is looked at once more when that look is done."""
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
        if became_active(previous, state):
            self.events.put_nowait(UnitEvent(state, stopped=False))
        if not matches(unit, self.patterns) or not is_stop_to_sweep(previous, state, job_done):
            return
        key = (unit, state.invocation_id)
        if key in self._handled:
            return
        self._handled.append(key)
        self.events.put_nowait(UnitEvent(state, stopped=True))

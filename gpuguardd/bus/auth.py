"""Who is calling, and may they: bus credentials for the uid, polkit for everyone but root; and
how often one caller may make the daemon scan or log.

The uid comes from the bus daemon (GetConnectionCredentials), which took it from the socket:
a caller cannot lie about it. The caller's PID is never used to decide anything, because a
PID can be recycled between the call and the check. Polkit is asked about the bus name
("system-bus-name" subject), which polkit resolves the same race-free way.

Any local user may call gpuguardd: unbounded, 2,000 ListHolders(fresh=true) calls by `nobody`
kept a core at 95 % and wrote 6,895 "denied" lines to the journal. RateLimit lets a key through
once per interval, counting what it held back, and forgets the least recently seen keys first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple

from dbus_fast import DBusError, Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import bus_daemon_call
from gpuguardd.errors import NotAuthorized
from gpuguardd.safetext import user_name

log = logging.getLogger("gpuguard.auth")

POLKIT_ALLOW_USER_INTERACTION = 1
# Errors meaning "no polkit on this bus": then only root is authorized.
_NO_POLKIT = {"org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner",
              "org.freedesktop.DBus.Error.Spawn.ServiceNotFound", "org.freedesktop.DBus.Error.Spawn.ExecFailed",
              "org.freedesktop.DBus.Error.Spawn.ChildExited"}
_CACHE_SIZE = 1024
# How long polkit's answer for one connection and action is reused: any user can call in a loop,
# and polkitd runs its rules for each check. A bus name stays one process, so the answer only
# ages (a session going inactive, rules edited).
POLKIT_DECISION_SEC = 5.0
# A uid's fresh=true ListHolders scans (sooner: served from the last scan, or joins the next).
FRESH_SCAN_INTERVAL_SEC = 1.0
# A uid's refusals of one action: logged at most once per this, with the number held back.
DENIAL_LOG_INTERVAL_SEC = 600.0
MAX_KEYS = 4096


class Admission(NamedTuple):
    allowed: bool
    held_back: int = 0


class RateLimit:
    def __init__(self, interval: float, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        # key -> (when it was last let through, how many were held back since)
        self._seen: collections.OrderedDict[Hashable, tuple[float, int]] = collections.OrderedDict()

    def admit(self, key: Hashable) -> Admission:
        now = self.clock()
        last = self._seen.pop(key, None)  # put back below, as the most recently seen
        if last is not None and now - last[0] < self.interval:
            self._seen[key] = (last[0], last[1] + 1)
            return Admission(False)
        self._seen[key] = (now, 0)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return Admission(True, last[1] if last is not None else 0)


def held_back(count: int) -> str:
    """A rate-limited log line's suffix: how many like it were not written."""
    return f" (and {count} more time(s) since, not logged)" if count else ""


@dataclass(frozen=True)
class Caller:
    sender: str
    uid: int
    user: str
    interactive: bool

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def describe(self) -> str:
        return f"uid {self.uid} ({self.user}) {self.sender}"


class Authorizer:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        # Unique names are never reused on a bus, so a uid learnt for one stays true.
        self._uids: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Any user can ask again and again, and the journal is the admin's.
        self._denials = RateLimit(DENIAL_LOG_INTERVAL_SEC)
        # (sender, action, interactive) -> (when polkit answered, granted); calls during a check share it.
        self._decisions: collections.OrderedDict[tuple[str, str, bool], tuple[float, bool]] = collections.OrderedDict()
        self._asking: dict[tuple[str, str, bool], asyncio.Future[bool]] = {}

    def _log_denial(self, level: int, caller: Caller, action: str, what: str, *args: object) -> None:
        admission = self._denials.admit((caller.uid, action, what))
        if admission.allowed:
            log.log(level, what + "%s", *args, held_back(admission.held_back))

    async def caller(self, msg: Message) -> Caller:
        sender = msg.sender
        if not sender:
            raise NotAuthorized("the call has no sender: cannot tell who is asking")
        uid = await self._uid(sender)
        return Caller(sender, uid, user_name(uid), bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION))

    async def _uid(self, sender: str) -> int:
        cached = self._uids.get(sender)
        if cached is not None:
            self._uids.move_to_end(sender)
            return cached
        reply = await bus_daemon_call(self.bus, "GetConnectionCredentials", "s", [sender])
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            why = reply.body[0] if reply is not None and reply.body else "no reply"
            raise NotAuthorized(f"cannot identify the caller {sender}: {why}")
        variant = reply.body[0].get("UnixUserID")
        if not isinstance(variant, Variant) or not isinstance(variant.value, int):
            raise NotAuthorized(f"the bus did not tell the uid of {sender}")
        uid = int(variant.value)
        self._uids[sender] = uid
        while len(self._uids) > _CACHE_SIZE:
            self._uids.popitem(last=False)
        return uid

    async def allowed(self, caller: Caller, action: str) -> bool:
        if caller.is_root:
            return True
        key = (caller.sender, action, caller.interactive)
        decided = self._decisions.get(key)
        if decided is not None and time.monotonic() - decided[0] < POLKIT_DECISION_SEC:
            self._decisions.move_to_end(key)
            return decided[1]
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.ensure_future(self._decide(caller, action, key))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        # shield: one caller giving up (disconnecting) does not cancel the others' answer.
        return await asyncio.shield(asking)

    async def _decide(self, caller: Caller, action: str, key: tuple[str, str, bool]) -> bool:
        # Every answer is kept, refusals for a failed check too: denying for a few seconds
        # more is the safe side, and a failing polkit is not asked at the callers' rate.
        granted = await self._ask_polkit(caller, action)
        self._decisions[key] = (time.monotonic(), granted)
        self._decisions.move_to_end(key)
        while len(self._decisions) > _CACHE_SIZE:
            self._decisions.popitem(last=False)
        return granted

    async def _ask_polkit(self, caller: Caller, action: str) -> bool:
        flags = POLKIT_ALLOW_USER_INTERACTION if caller.interactive else 0
        subject = ["system-bus-name", {"name": Variant("s", caller.sender)}]
        try:
            reply = await self.bus.call(Message(
                destination="org.freedesktop.PolicyKit1", path="/org/freedesktop/PolicyKit1/Authority",
                interface="org.freedesktop.PolicyKit1.Authority", member="CheckAuthorization",
                signature="(sa{sv})sa{ss}us", body=[subject, action, {}, flags, ""]))
        except (DBusError, OSError, EOFError) as exc:
            self._log_denial(logging.WARNING, caller, action, "polkit check of %s for %s failed: %s",
                             action, caller.describe(), exc)
            return False
        if reply is None:
            return False
        if reply.message_type == MessageType.ERROR:
            if reply.error_name in _NO_POLKIT:
                self._log_denial(logging.INFO, caller, action, "polkit is not running: %s denied to %s (only root may)",
                                 action, caller.describe())
            else:
                text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
                self._log_denial(logging.WARNING, caller, action, "polkit refused to check %s for %s: %s %s",
                                 action, caller.describe(), reply.error_name, text)
            return False
        try:
            granted, challenge = bool(reply.body[0][0]), bool(reply.body[0][1])
        except (IndexError, TypeError):
            log.warning("polkit answered %s with an unexpected body", action)
            return False
        if not granted and challenge:
            self._log_denial(logging.INFO, caller, action, "%s needs authentication for %s", caller.describe(), action)
        return granted

    async def require(self, caller: Caller, action: str) -> None:
        if not await self.allowed(caller, action):
            raise NotAuthorized(f"{caller.describe()} is not allowed to {action.rsplit('.', 1)[-1]} "
                                f"(polkit action {action})", uid=caller.uid)

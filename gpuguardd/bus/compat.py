"""Every dbus-fast workaround of gpuguardd; the only module that touches dbus-fast's private
internals. Supported: SUPPORTED_MIN (Debian 12's 1.84.2) up to SUPPORTED_BELOW; on 1.84.2 and
5.2.0, tests/bus/test_dbus_compat.py shows each bug where its gate says and the workaround fixing it.

1. Strings' lengths are written in characters, not bytes (< 2.11.1, dbus-fast#261): a process
   named "café" would corrupt a message and get the daemon dropped off the bus. Strings go ASCII.
2. The writer's queue pops the newest (< 1.91.3, dbus-fast#225): under backpressure, signals
   arrive reversed. The queue pops the oldest.
3. EAGAIN from send() drops the connection (every version so far, python-dbus-next#153): a send
   that would block sends nothing, and the writer waits for the socket as after a partial send.
4. Peer.GetMachineId is forwarded to the bus daemon, which a system bus refuses (before 2.36.0,
   dbus-fast#400, the error and later calls also go unanswered). Peer is answered from /etc/machine-id.
5. InterfacesAdded/Removed come from the object's own path (every version so far); the D-Bus
   specification (and GDBusObjectManagerClient, cockpit) want the object manager's.
6. A method gets only its arguments, not the sender and flags authorization needs. Message
   handlers run before a method's task is made: one setting a context variable gives it its call.
7. A message sent after the connection closed (5.x: a traceback; 1.84 drops it) is dropped.
   The daemon answers running calls before it disconnects (interfaces.cancel_running_calls).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import re
import socket
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast.__version__ import __version__ as DBUS_FAST_VERSION_TEXT
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface

log = logging.getLogger("gpuguard.compat")

SUPPORTED_MIN = (1, 84)
SUPPORTED_BELOW = (6,)

OBJECT_MANAGER_INTERFACE = "org.freedesktop.DBus.ObjectManager"
PEER_INTERFACE = "org.freedesktop.DBus.Peer"
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def parse_version(text: str) -> tuple[int, ...]:
    """"1.84.2" -> (1, 84, 2); a suffix after the numbers ("5.2.0rc1", "1.84.2+ds") is ignored."""
    match = re.match(r"[0-9]+(?:\.[0-9]+)*", text)  # ASCII digits only, not int()'s U+00B2
    return tuple(int(part) for part in match[0].split(".")) if match else ()


VERSION = parse_version(DBUS_FAST_VERSION_TEXT)

# The gates of 1 and 2: True where the installed dbus-fast needs the workaround (3 to 7: all do).
STRING_LENGTHS_IN_CHARACTERS = VERSION < (2, 11, 1)
WRITER_TAKES_NEWEST = VERSION < (1, 91, 3)


def supported_range() -> str:
    return f">={'.'.join(map(str, SUPPORTED_MIN))},<{'.'.join(map(str, SUPPORTED_BELOW))}"


def version_warning(version: tuple[int, ...] = VERSION) -> str:
    """What the daemon logs at start on a dbus-fast outside the supported range ("" inside)."""
    if SUPPORTED_MIN <= version < SUPPORTED_BELOW:
        return ""
    return (f"dbus-fast {'.'.join(map(str, version)) or DBUS_FAST_VERSION_TEXT} is outside the versions gpuguardd "
            f"is tested with ({supported_range()}): its workarounds (gpuguardd/bus/compat.py) may be wrong for it")


def ascii_only(value: Any) -> Any:
    """The value with every string in it made ASCII (backslash escapes), at any depth (1)."""
    if isinstance(value, str):
        return value if value.isascii() else value.encode("ascii", "backslashreplace").decode("ascii")
    if isinstance(value, Variant):
        return Variant(value.signature, ascii_only(value.value))
    if isinstance(value, list):
        return [ascii_only(item) for item in value]
    if isinstance(value, tuple):
        return tuple(ascii_only(item) for item in value)
    if isinstance(value, dict):
        return {ascii_only(k): ascii_only(v) for k, v in value.items()}
    return value


class SendWithoutEagain:
    """A socket whose send() returns 0 where it would raise BlockingIOError."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: Any, flags: int = 0) -> int:
        try:
            return self._sock.send(data, flags)
        except (BlockingIOError, InterruptedError):
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class FifoQueue(collections.deque):  # type: ignore[type-arg]
    """A deque whose pop() takes the oldest item (what a writer's queue must do)."""

    def pop(self, index: int = -1) -> Any:  # index only to match MutableSequence; never passed
        return self.popleft()


def repair_writer(bus: MessageBus, eagain: bool = True, order: bool = WRITER_TAKES_NEWEST) -> None:
    """Fix the writer (2, 3). It exists once connected (dbus-fast 5) or from the constructor
    (1.84): call this after connect(). `eagain`/`order`: for the tests that show each bug."""
    writer = getattr(bus, "_writer", None)
    if writer is None:
        return
    if eagain and isinstance(getattr(writer, "sock", None), socket.socket):
        writer.sock = SendWithoutEagain(writer.sock)
    if order and type(getattr(writer, "messages", None)) is collections.deque:
        writer.messages = FifoQueue(writer.messages)


def machine_id() -> str:
    for path in MACHINE_ID_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
    return ""


def peer_reply(msg: Message) -> Message | bool | None:
    """For a message handler: our answer to a Peer call (4; True: no reply wanted), None for others."""
    if msg.interface != PEER_INTERFACE or msg.signature != "" or msg.member not in ("Ping", "GetMachineId"):
        return None
    if msg.flags & MessageFlag.NO_REPLY_EXPECTED:
        return True
    if msg.member == "Ping":
        return Message.new_method_return(msg)
    found = machine_id()
    return (Message.new_method_return(msg, "s", [found]) if found else
            Message.new_error(msg, "org.freedesktop.DBus.Error.FileNotFound", "this machine has no machine-id"))


CURRENT_CALL: contextvars.ContextVar[Message | None] = contextvars.ContextVar("gpuguard_current_call", default=None)
current_call = CURRENT_CALL.get


def note_call(msg: Message) -> None:
    """From the bus's first message handler: what current_call() returns in the call (6)."""
    if msg.message_type == MessageType.METHOD_CALL:
        CURRENT_CALL.set(msg)


class CompatBus(MessageBus):
    """dbus-fast's MessageBus with 1, 5 and 7 built in (2, 3, 4 and 6: connection.GuardBus).
    `object_manager_path`: where InterfacesAdded/Removed come from (5); "" keeps dbus-fast's."""

    object_manager_path = ""

    def send(self, msg: Message) -> Any:
        if self._disconnected:  # (7)
            log.debug("not sent, the bus is gone: %s %s", msg.message_type.name, msg.member or "")
            dropped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            dropped.set_result(None)
            return dropped
        if STRING_LENGTHS_IN_CHARACTERS and msg.body:  # (1)
            msg.body = ascii_only(msg.body)
        return super().send(msg)

    # dbus-fast calls these from export()/unexport().
    def _emit_interface_added(self, path: str, interface: ServiceInterface) -> None:
        if not self.object_manager_path:
            super()._emit_interface_added(path, interface)
            return

        def got(iface: ServiceInterface, result: Any, _user: Any, error: Exception | None) -> None:
            self._from_manager(path, "InterfacesAdded", "oa{sa{sv}}", {iface.name: dict(result or {})})

        # Our property getters are plain attributes, so this calls back synchronously.
        ServiceInterface._get_all_property_values(interface, got)

    def _emit_interface_removed(self, path: str, removed_interfaces: list[str]) -> None:
        if not self.object_manager_path:
            super()._emit_interface_removed(path, removed_interfaces)
        else:
            self._from_manager(path, "InterfacesRemoved", "oas", list(removed_interfaces))

    def _from_manager(self, path: str, member: str, signature: str, about: Any) -> None:
        if not self._disconnected and path.startswith(self.object_manager_path + "/"):
            self.send(Message.new_signal(path=self.object_manager_path, interface=OBJECT_MANAGER_INTERFACE,
                                         member=member, signature=signature, body=[path, about]))

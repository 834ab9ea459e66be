"""The daemon's bus connection: dbus-fast's MessageBus with what the service needs from it,
and around the library bugs that would cut the daemon off the bus.

* ObjectManager signals from the manager object. dbus-fast sends InterfacesAdded/Removed from
  the exported object's own path; the D-Bus specification (and GDBusObjectManagerClient,
  cockpit) expect them from the object manager's path, with the object in the arguments.
* The incoming method call, for the method that handles it: dbus-fast passes only the
  arguments, but authorization needs the sender and the interactive-authorization flag. A
  message handler stores the message in a context variable just before dbus-fast dispatches
  it; the handler's task is created in that context, so each call sees its own message.
* A wrong signature on one of our methods is answered with InvalidArgument naming what was
  expected, instead of dbus-fast's generic "unknown method".
* ASCII on the wire where the library needs it. dbus-fast 1.84 (Debian 12's
  python3-dbus-fast) writes a string's length in characters, not bytes, so one non-ASCII
  character anywhere (a process named "café", a reason, an error text quoting a caller's
  value) corrupts the message and the bus daemon drops the connection: any local user could
  cut the daemon off the bus. Where a probe finds that bug, every outgoing string is made
  ASCII (non-ASCII characters backslash-escaped) before it is marshalled.
* org.freedesktop.DBus.Peer answered here: dbus-fast 1.84 forwards GetMachineId to the bus
  and, where the machine has no machine-id, fails on the error reply without answering.
* Messages in order: dbus-fast 1.84's writer takes queued messages from the wrong end of its
  queue, so under backpressure signals (SweepStarted, SweepFinished) could arrive reversed.
* Surviving a full socket. dbus-fast's writer treats EAGAIN from send() as a fatal error and
  drops the connection (python-dbus-next#153, still so in dbus-fast 5.2): a burst of clients
  with large replies, faster than the bus daemon reads, would cut gpuguardd off the bus. The
  writer's socket is wrapped so that a send that would block sends nothing; the writer then
  waits for the socket to become writable, as it does after a partial send.
"""

from __future__ import annotations

import collections
import contextvars
import socket
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface

from gpuguardd.bus.names import MANAGER_PATH, OBJECT_MANAGER_INTERFACE, error_name

CURRENT_CALL: contextvars.ContextVar[Message | None] = contextvars.ContextVar(
    "gpuguard_current_call", default=None)


def current_call() -> Message | None:
    return CURRENT_CALL.get()


def _lengths_in_characters() -> bool:
    try:
        probe = Message(destination="a.b", path="/", interface="a.b", member="c", signature="s",
                        body=["\u00e9"])
        return bytes(probe._marshall(False)).endswith(b"\x01\x00\x00\x00\xc3\xa9\x00")
    except Exception:  # a private method: if it changed, so did the library
        return False


ASCII_ONLY = _lengths_in_characters()


def ascii_only(value: Any) -> Any:
    """The value with every string in it made ASCII (backslash escapes), at any depth."""
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


BUS_DAEMON = "org.freedesktop.DBus"
BUS_DAEMON_PATH = "/org/freedesktop/DBus"


def name_owner_change(msg: Message, name: str) -> str | None:
    """The new owner of `name` ("" when it left) if `msg` is the bus daemon's NameOwnerChanged
    about it, else None.

    Match rules only filter broadcasts: any peer may send a signal straight to our unique name,
    with any path, interface and member it likes, so a NameOwnerChanged("org.freedesktop.
    systemd1", ..., "") from a user would otherwise read as systemd leaving. The bus daemon
    sets the sender field itself and never lets a peer claim org.freedesktop.DBus.
    """
    if (msg.message_type != MessageType.SIGNAL or msg.member != "NameOwnerChanged"
            or msg.sender != BUS_DAEMON or msg.path != BUS_DAEMON_PATH
            or msg.interface != BUS_DAEMON or msg.signature != "sss" or msg.body[0] != name):
        return None
    return str(msg.body[2])


async def name_owner(bus: MessageBus, name: str) -> str:
    """The unique name that owns `name` now, "" when none does (or the bus would not say):
    what a signal claiming to come from `name` must carry as its sender."""
    reply = await bus.call(Message(
        destination=BUS_DAEMON, path=BUS_DAEMON_PATH, interface=BUS_DAEMON,
        member="GetNameOwner", signature="s", body=[name]))
    if reply is None or reply.message_type != MessageType.METHOD_RETURN or not reply.body:
        return ""
    return str(reply.body[0])


PEER_INTERFACE = "org.freedesktop.DBus.Peer"
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def _machine_id() -> str:
    for path in MACHINE_ID_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
    return ""


def _peer_reply(msg: Message) -> Message | None:
    if msg.member == "Ping":
        return Message.new_method_return(msg)
    if msg.member == "GetMachineId":
        machine_id = _machine_id()
        if machine_id:
            return Message.new_method_return(msg, "s", [machine_id])
        return Message.new_error(msg, "org.freedesktop.DBus.Error.FileNotFound",
                                 "this machine has no machine-id")
    return None


class SafeBus(MessageBus):
    """A MessageBus that sends only what the installed dbus-fast marshals correctly."""

    def send(self, msg: Message) -> Any:
        if ASCII_ONLY and msg.body:
            msg.body = ascii_only(msg.body)
        return super().send(msg)


class _SendWithoutEagain:
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


class _FifoQueue(collections.deque):  # type: ignore[type-arg]
    """A deque whose pop() takes the oldest item (what a writer's queue must do)."""

    def pop(self, index: int = -1) -> Any:  # index only to match MutableSequence; never passed
        return self.popleft()


class GuardBus(SafeBus):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # path -> interface name -> {method name: in signature}, for the signature check
        self._signatures: dict[str, dict[str, dict[str, str]]] = {}
        self.add_message_handler(self._note_call)

    async def connect(self) -> GuardBus:
        await super().connect()
        # The writer exists once connected (dbus-fast 5) or from the constructor (1.84).
        writer = getattr(self, "_writer", None)
        if writer is not None and isinstance(getattr(writer, "sock", None), socket.socket):
            writer.sock = _SendWithoutEagain(writer.sock)
        if writer is not None and type(getattr(writer, "messages", None)) is collections.deque:
            writer.messages = _FifoQueue(writer.messages)
        return self

    def export(self, path: str, interface: ServiceInterface) -> None:
        super().export(path, interface)
        methods = {m.name: m.in_signature for m in interface.introspect().methods}
        self._signatures.setdefault(path, {})[interface.name] = methods

    def unexport(self, path: str, interface: ServiceInterface | str | None = None) -> None:
        super().unexport(path, interface)
        if interface is None:
            self._signatures.pop(path, None)
        else:
            name = interface if isinstance(interface, str) else interface.name
            self._signatures.get(path, {}).pop(name, None)

    def _note_call(self, msg: Message) -> Message | bool | None:
        if msg.message_type != MessageType.METHOD_CALL:
            return None
        CURRENT_CALL.set(msg)
        if msg.interface == PEER_INTERFACE and msg.signature == "":
            reply = _peer_reply(msg)
            if reply is not None and msg.flags & MessageFlag.NO_REPLY_EXPECTED:
                return True
            return reply
        interfaces = self._signatures.get(msg.path or "")
        if not interfaces or msg.interface not in interfaces:
            return None
        expected = interfaces[msg.interface].get(msg.member or "")
        if expected is None or expected == msg.signature:
            return None
        if msg.flags & MessageFlag.NO_REPLY_EXPECTED:
            return True  # handled: dropped, as the caller asked for no reply
        return Message.new_error(
            msg, error_name("InvalidArgument"),
            f"{msg.member} takes arguments of type ({expected}), got ({msg.signature})")

    # dbus-fast calls these from export()/unexport().
    def _emit_interface_added(self, path: str, interface: ServiceInterface) -> None:
        if self._disconnected or not path.startswith(MANAGER_PATH + "/"):
            return
        values: dict[str, Any] = {}

        def got(iface: ServiceInterface, result: Any, _user: Any, error: Exception | None) -> None:
            values.update(result or {})
            self.send(Message.new_signal(
                path=MANAGER_PATH, interface=OBJECT_MANAGER_INTERFACE, member="InterfacesAdded",
                signature="oa{sa{sv}}", body=[path, {iface.name: values}]))

        # Our property getters are plain attributes, so this calls back synchronously.
        ServiceInterface._get_all_property_values(interface, got)

    def _emit_interface_removed(self, path: str, removed_interfaces: list[str]) -> None:
        if self._disconnected or not path.startswith(MANAGER_PATH + "/"):
            return
        self.send(Message.new_signal(
            path=MANAGER_PATH, interface=OBJECT_MANAGER_INTERFACE, member="InterfacesRemoved",
            signature="oas", body=[path, list(removed_interfaces)]))

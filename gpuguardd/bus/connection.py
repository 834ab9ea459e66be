"""The daemon's bus connection (GuardBus), and the bus daemon's own calls and signals read safely.

A wrong signature on one of our methods is answered with InvalidArgument naming the expected one,
not dbus-fast's generic "unknown method".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface

from gpuguardd.bus.compat import CompatBus, note_call, peer_reply, repair_writer
from gpuguardd.bus.names import ERROR_PREFIX, MANAGER_PATH

BUS_DAEMON = "org.freedesktop.DBus"
BUS_DAEMON_PATH = "/org/freedesktop/DBus"


def name_owner_change(msg: Message, name: str) -> str | None:
    """The new owner of `name` ("" when it left) if `msg` is the bus daemon's NameOwnerChanged
    about it, else None. Match rules only filter broadcasts: any peer may send us one saying systemd
    left, but only the bus daemon can have org.freedesktop.DBus as the sender."""
    if (msg.message_type != MessageType.SIGNAL or msg.member != "NameOwnerChanged"
            or msg.sender != BUS_DAEMON or msg.path != BUS_DAEMON_PATH
            or msg.interface != BUS_DAEMON or msg.signature != "sss" or msg.body[0] != name):
        return None
    return str(msg.body[2])


async def bus_daemon_call(bus: MessageBus, member: str, signature: str = "", body: Sequence[Any] = ()) -> Message:
    """The bus daemon's reply, maybe an error: each caller knows what a refusal means to it."""
    return await bus.call(Message(destination=BUS_DAEMON, path=BUS_DAEMON_PATH, interface=BUS_DAEMON,
                                  member=member, signature=signature, body=list(body)))


async def name_owner(bus: MessageBus, name: str) -> str:
    """What a signal from `name` must carry as its sender: its owner now ("" for none or unknown)."""
    reply = await bus_daemon_call(bus, "GetNameOwner", "s", [name])
    if reply is None or reply.message_type != MessageType.METHOD_RETURN or not reply.body:
        return ""
    return str(reply.body[0])


class GuardBus(CompatBus):
    object_manager_path = MANAGER_PATH

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # path -> interface name -> {method name: in signature}
        self._signatures: dict[str, dict[str, dict[str, str]]] = {}
        self.add_message_handler(self._note_call)

    async def connect(self) -> GuardBus:
        await super().connect()
        repair_writer(self)
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
        note_call(msg)
        peer = peer_reply(msg)
        if peer is not None:
            return peer
        expected = self._signatures.get(msg.path or "", {}).get(msg.interface or "", {}).get(msg.member or "")
        if expected is None or expected == msg.signature:
            return None
        if msg.flags & MessageFlag.NO_REPLY_EXPECTED:
            return True  # handled: dropped, as the caller asked for no reply
        return Message.new_error(msg, ERROR_PREFIX + "InvalidArgument",
                                 f"{msg.member} takes arguments of type ({expected}), got ({msg.signature})")

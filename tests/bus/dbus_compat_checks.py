"""The dbus-fast behaviours gpuguardd works around (gpuguardd/bus/compat.py), observed on a
real bus with whichever dbus-fast the interpreter running this has.

    python -m tests.bus.dbus_compat_checks ADDRESS CHECK raw|compat [DBUS_DAEMON_PID]

prints one JSON object of what it saw. `raw` is the library alone (the bug shows where the
installed version has it), `compat` the library as gpuguardd uses it. test_dbus_compat.py
runs every check on the venv's dbus-fast and on Debian 12's (/usr/bin/python3), and asserts.
Only the standard library, dbus-fast and gpuguardd.bus.compat are imported, so the
distribution's interpreter can run it.
"""


import asyncio
import json
import os
import signal
import sys
from typing import Any

from dbus_fast import Message, MessageType, PropertyAccess
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, dbus_property, method

from gpuguardd.bus import compat

IFACE = "org.gpuguard.CompatCheck"
MANAGER = "/org/gpuguard/CompatCheck"
CALL_TIMEOUT = 5.0


def bus_class(mode: str) -> type[MessageBus]:
    return compat.CompatBus if mode == "compat" else MessageBus


async def connect(address: str, mode: str = "raw") -> MessageBus:
    bus = bus_class(mode)(bus_address=address)
    await asyncio.wait_for(bus.connect(), CALL_TIMEOUT)
    return bus


async def listen(bus: MessageBus, rule: str, into: list[Message]) -> None:
    reply = await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                                   interface="org.freedesktop.DBus", member="AddMatch",
                                   signature="s", body=[rule]))
    assert reply is not None and reply.message_type == MessageType.METHOD_RETURN

    def handler(msg: Message) -> None:
        if msg.message_type == MessageType.SIGNAL and msg.interface in (
                IFACE, compat.OBJECT_MANAGER_INTERFACE):
            into.append(msg)
    bus.add_message_handler(handler)


async def settle(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.02)


def connected(bus: MessageBus) -> bool:
    return bool(bus.connected)


async def check_version(_address: str, _mode: str, _pid: int) -> dict[str, Any]:
    return {"version": list(compat.VERSION), "supported": not compat.version_warning(),
            "gates": {"strings": compat.STRING_LENGTHS_IN_CHARACTERS, "order": compat.WRITER_TAKES_NEWEST,
                      # Peer's replies also break before 2.36.0 (compat.py, 4).
                      "peer": compat.VERSION < (2, 36, 0)}}


async def check_strings(address: str, mode: str, _pid: int) -> dict[str, Any]:
    """1: a signal carrying "café" reaches a listener, and its sender stays on the bus."""
    probe = Message(destination="a.b", path="/", interface="a.b", member="c", signature="s",
                    body=["\u00e9"])
    in_characters = bytes(probe._marshall(False)).endswith(b"\x01\x00\x00\x00\xc3\xa9\x00")
    sender, listener = await connect(address, mode), await connect(address)
    got: list[Message] = []
    await listen(listener, f"type='signal',interface='{IFACE}'", got)
    sender.send(Message.new_signal(MANAGER, IFACE, "Text", "ss", ["gpu-caf\u00e9", "after"]))
    await settle(lambda: got or not connected(sender), 5)
    await asyncio.sleep(0.2)  # the bus daemon drops a sender of a corrupt message right away
    return {"lengths_in_characters": in_characters, "sender_connected": connected(sender),
            "received": [list(m.body) for m in got]}


async def check_writer(address: str, mode: str, pid: int) -> dict[str, Any]:
    """2 and 3: 48 large signals sent while the bus daemon reads nothing (SIGSTOP) all
    arrive, in order, and the sender stays on the bus. `mode` raw: no repair; `eagain`:
    the EAGAIN repair only (so the queue's order shows); compat: both where needed."""
    sender = await connect(address, "compat" if mode == "compat" else "raw")
    listener = await connect(address)
    got: list[Message] = []
    await listen(listener, f"type='signal',interface='{IFACE}',member='Big'", got)
    if mode == "compat":
        compat.repair_writer(sender)
    elif mode == "eagain":
        compat.repair_writer(sender, eagain=True, order=False)
    count, payload = 48, "x" * 65536
    os.kill(pid, signal.SIGSTOP)
    try:
        for seq in range(count):
            try:
                sender.send(Message.new_signal(MANAGER, IFACE, "Big", "us", [seq, payload]))
            except OSError:  # the library dropped the connection (raw: EAGAIN)
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    await settle(lambda: len(got) >= count or not connected(sender), 15)
    return {"sender_connected": connected(sender), "sequence": [int(m.body[0]) for m in got],
            "count": count}


async def check_peer(address: str, mode: str, _pid: int) -> dict[str, Any]:
    """4: GetMachineId asked of a connection twice is answered twice."""
    server, client = await connect(address), await connect(address)
    if mode == "compat":
        server.add_message_handler(compat.peer_reply)
    answers: list[str] = []
    for _ in range(2):
        try:
            reply = await asyncio.wait_for(client.call(Message(
                destination=server.unique_name, path="/", interface=compat.PEER_INTERFACE,
                member="GetMachineId")), 3)
        except asyncio.TimeoutError:
            answers.append("no answer")
            continue
        if reply is None or reply.message_type != MessageType.METHOD_RETURN:
            answers.append(f"error {reply.error_name if reply else None}")
        else:
            answers.append(f"id {reply.body[0]}")
    return {"answers": answers, "machine_id": compat.machine_id()}


class Thing(ServiceInterface):
    def __init__(self) -> None:
        super().__init__(IFACE)

    @dbus_property(access=PropertyAccess.READ)
    def Size(self) -> "u":  # type: ignore[name-defined]  # noqa: F821
        return 7

    @method()
    async def Who(self, delay_ms: "u") -> "u":  # type: ignore[name-defined]  # noqa: F821
        """The serial of the call this runs for, as current_call() sees it after a wait."""
        await asyncio.sleep(delay_ms / 1000)
        call = compat.current_call()
        return call.serial if call is not None else 0


async def check_object_manager(address: str, mode: str, _pid: int) -> dict[str, Any]:
    """5: InterfacesAdded/Removed of an object below the manager come from the manager."""
    server = await connect(address, mode)
    if mode == "compat":
        server.object_manager_path = MANAGER  # type: ignore[attr-defined]
    listener = await connect(address)
    got: list[Message] = []
    await listen(listener, f"type='signal',interface='{compat.OBJECT_MANAGER_INTERFACE}'", got)
    server.export(MANAGER + "/child", Thing())
    await settle(lambda: len(got) >= 1, 5)
    server.unexport(MANAGER + "/child")
    await settle(lambda: len(got) >= 2, 5)
    return {"signals": [[m.member, m.path, m.body[0]] for m in got],
            "properties": [{k: v.value for k, v in m.body[1][IFACE].items()}
                           for m in got if m.member == "InterfacesAdded"]}


async def check_current_call(address: str, mode: str, _pid: int) -> dict[str, Any]:
    """6: concurrent calls each see their own message in the method that handles them."""
    server, client = await connect(address), await connect(address)
    if mode == "compat":
        server.add_message_handler(compat.note_call)
    server.export("/", Thing())
    calls = [Message(destination=server.unique_name, path="/", interface=IFACE, member="Who",
                     signature="u", body=[(7 * i) % 40]) for i in range(20)]
    replies = await asyncio.gather(*(client.call(call) for call in calls))
    return {"pairs": [[call.serial, reply.body[0] if reply is not None and reply.body else None]
                      for call, reply in zip(calls, replies)]}


async def check_send_after_disconnect(address: str, mode: str, _pid: int) -> dict[str, Any]:
    """7: a message sent once the connection is closed (a reply of a call the stop cut short)
    is dropped, not written to the closed socket with the loop's errors logged."""
    bus = await connect(address, mode)
    loop = asyncio.get_running_loop()
    errors: list[str] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(str(context.get("message"))))
    bus.disconnect()
    await asyncio.wait_for(bus.wait_for_disconnect(), CALL_TIMEOUT)  # type: ignore[no-untyped-call]
    raised = ""
    try:
        bus.send(Message.new_signal("/", IFACE, "Late"))
    except Exception as exc:  # the library alone: add_writer on a closed fd
        raised = type(exc).__name__
    await asyncio.sleep(0.1)
    return {"raised": raised, "loop_errors": errors}


CHECKS = {"version": check_version, "strings": check_strings, "writer": check_writer,
          "peer": check_peer, "object_manager": check_object_manager,
          "current_call": check_current_call,
          "send_after_disconnect": check_send_after_disconnect}


def main() -> None:
    address, check, mode = sys.argv[1:4]
    pid = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    print(json.dumps(asyncio.run(CHECKS[check](address, mode, pid))))


if __name__ == "__main__":
    main()

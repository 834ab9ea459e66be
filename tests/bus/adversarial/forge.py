"""Send one signal straight to a connection, as whoever runs this (the tests: nobody).

`python -m tests.bus.adversarial.forge ADDRESS DESTINATION PATH INTERFACE MEMBER SIGNATURE JSON`
sends the signal with the JSON array as its body and exits once it is written. dbus-send was
tried first: its unicast signals never arrived (it exits before they are flushed).
"""

from __future__ import annotations

import asyncio
import json
import sys

from dbus_fast import Message
from dbus_fast.aio import MessageBus


async def main(address: str, destination: str, path: str, interface: str, member: str,
               signature: str, body: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    message = Message.new_signal(path, interface, member, signature, json.loads(body))
    message.destination = destination
    sent = bus.send(message)
    if sent is not None:  # a future in dbus-fast 5, nothing in 1.84
        await sent
    # A round trip to the bus daemon: the signal, queued before it, has been routed.
    await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                           interface="org.freedesktop.DBus", member="GetId"))
    bus.disconnect()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:8]))

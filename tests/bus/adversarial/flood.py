"""Call gpuguardd many times as whoever runs this (the tests: nobody), as fast as it answers.

`python -m tests.bus.adversarial.flood ADDRESS MEMBER COUNT CONNECTIONS` makes COUNT calls of
MEMBER ("ListHolders": fresh=true; "Sweep": a real sweep of GPU 0, which nobody may not do)
spread over CONNECTIONS connections that call concurrently, and prints
"replies N errors M".
"""

from __future__ import annotations

import asyncio
import sys

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

BUS_NAME = "org.gpuguard.GpuGuard1"
PATH = "/org/gpuguard/GpuGuard1"
MANAGER = BUS_NAME + ".Manager"
CALLS = {"ListHolders": {"fresh": Variant("b", True)},
         "Sweep": {"gpus": Variant("au", [0])}}


async def one_connection(address: str, member: str, count: int) -> tuple[int, int]:
    bus = await MessageBus(bus_address=address).connect()
    replies = errors = 0
    for _ in range(count):
        reply = await bus.call(Message(destination=BUS_NAME, path=PATH, interface=MANAGER,
                                       member=member, signature="a{sv}", body=[CALLS[member]]))
        if reply is not None and reply.message_type == MessageType.METHOD_RETURN:
            replies += 1
        else:
            errors += 1
    bus.disconnect()
    return replies, errors


async def main(address: str, member: str, count: int, connections: int) -> None:
    each = [count // connections + (i < count % connections) for i in range(connections)]
    results = await asyncio.gather(*(one_connection(address, member, n) for n in each))
    print("replies", sum(r for r, _ in results), "errors", sum(e for _, e in results))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))

"""A stand-in for systemd's manager on the tests' bus: just what gpuguardd's unit watch asks.

Run as `python -m tests.bus.adversarial.fake_systemd ADDRESS [ENVIRONMENT...]`: owns
org.freedesktop.systemd1, answers Subscribe, GetUnit and Properties.Get (every unit is
inactive, invocation 0x01.., its Environment the ENVIRONMENT words, e.g.
CUDA_VISIBLE_DEVICES=2), prints "ready <unique name>", then reads commands from stdin, one a
line:
  jobremoved UNIT   broadcast JobRemoved(1, job path, UNIT, "done"), as systemd does on a stop
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

SYSTEMD = "org.freedesktop.systemd1"
MANAGER = SYSTEMD + ".Manager"
ROOT = "/org/freedesktop/systemd1"
INVOCATION = bytes(range(1, 17))


def unit_path(unit: str) -> str:
    return ROOT + "/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in unit)


PROPERTIES = {"ActiveState": Variant("s", "inactive"), "SubState": Variant("s", "dead"),
              "InvocationID": Variant("ay", INVOCATION), "Result": Variant("s", "success"),
              "Environment": Variant("as", [])}


class FakeSystemd:
    """This module as a subprocess, for a test; close() ends it."""

    def __init__(self, address: str, *environment: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bus.adversarial.fake_systemd", address, *environment],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=str(Path(__file__).resolve().parents[3]))
        assert self.proc.stdout is not None
        words = self.proc.stdout.readline().split()
        assert words[:1] == ["ready"], f"fake systemd did not start: {words}"
        self.unique_name = words[1]

    def job_removed(self, unit: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"jobremoved {unit}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "sent"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


async def main(address: str, environment: list[str]) -> None:
    PROPERTIES["Environment"] = Variant("as", environment)
    bus = await MessageBus(bus_address=address).connect()

    def handler(msg: Message) -> bool:
        if msg.message_type != MessageType.METHOD_CALL:
            return False
        if msg.member == "Subscribe":
            bus.send(Message.new_method_return(msg))
        elif msg.member == "GetUnit":
            bus.send(Message.new_method_return(msg, "o", [unit_path(str(msg.body[0]))]))
        elif msg.member == "Get" and msg.body[1] in PROPERTIES:
            bus.send(Message.new_method_return(msg, "v", [PROPERTIES[msg.body[1]]]))
        else:
            bus.send(Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", "no"))
        return True

    bus.add_message_handler(handler)
    await bus.request_name(SYSTEMD)
    print("ready", bus.unique_name, flush=True)
    loop = asyncio.get_running_loop()
    job = 0
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        words = line.split()
        if words[:1] == ["jobremoved"]:
            job += 1
            sent = bus.send(Message.new_signal(ROOT, MANAGER, "JobRemoved", "uoss",
                                               [job, f"{ROOT}/job/{job}", words[1], "done"]))
            if sent is not None:  # a future in dbus-fast 5, nothing in 1.84
                await sent
            print("sent", flush=True)
    bus.disconnect()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))

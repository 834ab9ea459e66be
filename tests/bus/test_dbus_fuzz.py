"""Thousands of random calls at gpuguardd: every one is answered, and the daemon stays correct.

Raw messages from a dbus-fast client: random members (the real ones and made-up ones) on
random interfaces and paths, with random signatures and values, some of them close to valid
(real keys with wrong types, real members with wrong signatures). The daemon runs with
[Sweep] DryRun=yes and the fuzzer never asks for a real sweep, so nothing is signalled.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections import Counter
from typing import Any

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd.bus.contract import contract, interface
from gpuguardd.bus.marshal import SWEEP
from tests.dbus_harness import BUS_NAME, GPU, MANAGER, MANAGER_PATH, GuardDaemon

pytest_plugins = ["tests.dbus_harness"]
# Sweep options as they are usually sent: the first type the XML lists for each key.
SWEEP_OPTIONS = {key: kind.signatures[0] for key, kind in contract().dictionaries[SWEEP].items()}

CALLS = 3000
BATCH = 100
SEED = 20261129

BASIC = "ybnqiuxtdsog"
MEMBERS = ["ListHolders", "Sweep", "SweepUnit", "GetHistory", "Reload", "Get", "GetAll", "Set",
           "Introspect", "Ping", "GetMachineId", "GetManagedObjects"]
INTERFACES = [MANAGER, GPU, "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Introspectable",
              "org.freedesktop.DBus.Peer", "org.freedesktop.DBus.ObjectManager", "org.example.Nope", None]
PATHS = [MANAGER_PATH, MANAGER_PATH + "/gpu/0", MANAGER_PATH + "/gpu/1", MANAGER_PATH + "/gpu/99",
         "/", "/org", "/org/gpuguard", "/x/y/z"]
PROPERTIES = ["Version", "Busy", "LastSweep", "GpuCount", "MemoryUsed", "State", "Nope", ""]


def random_type(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth >= 3 or roll < 0.55:
        return rng.choice(BASIC)
    if roll < 0.7:
        return "v"
    if roll < 0.82:
        return "a" + random_type(rng, depth + 1)
    if roll < 0.92:
        return "a{" + rng.choice(BASIC) + random_type(rng, depth + 1) + "}"
    return "(" + "".join(random_type(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"


def split_types(signature: str) -> list[str]:
    """Complete types of a signature, in order."""
    types, depth, start = [], 0, 0
    for i, ch in enumerate(signature):
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        if depth == 0 and ch != "a":
            types.append(signature[start:i + 1])
            start = i + 1
    return types


def random_text(rng: random.Random) -> str:
    pool = string.ascii_letters + string.digits + " -_./:@\\\n\t\u00e9\u2603\U0001f600"
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 24)))


def random_value(rng: random.Random, signature: str) -> Any:
    head = signature[0]
    if head in "ynqiuxt":
        bits = {"y": 8, "n": 16, "q": 16, "i": 32, "u": 32, "x": 64, "t": 64}[head]
        signed = head in "nix"
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        return rng.choice([low, high, 0, 1, rng.randint(low, high)])
    if head == "b":
        return rng.random() < 0.5
    if head == "d":
        return rng.choice([0.0, -1.5, 1e308, rng.random()])
    if head == "s":
        return random_text(rng)
    if head == "o":
        return rng.choice(PATHS)
    if head == "g":
        return random_type(rng)
    if head == "v":
        inner = random_type(rng, 2)
        return Variant(inner, random_value(rng, inner))
    if signature.startswith("a{"):
        key_type, value_type = signature[2], signature[3:-1]
        return {random_value(rng, key_type): random_value(rng, value_type)
                for _ in range(rng.randint(0, 3))}
    if signature == "ay":
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 8)))
    if head == "a":
        return [random_value(rng, signature[1:]) for _ in range(rng.randint(0, 3))]
    if head == "(":
        return [random_value(rng, t) for t in split_types(signature[1:-1])]
    raise AssertionError(signature)


def near_valid_options(rng: random.Random) -> dict[str, Variant]:
    """Real option keys, with the right or a wrong type; never a real (non-dry) sweep."""
    options: dict[str, Variant] = {}
    for key in rng.sample([*sorted(SWEEP_OPTIONS), "include_protected", "bogus"], rng.randint(0, 4)):
        expected = SWEEP_OPTIONS.get(key, "b")
        signature = expected if rng.random() < 0.6 else random_type(rng, 2)
        value = random_value(rng, signature)
        if key == "gpus" and signature == "au":
            value = [v % 4 for v in value]
        options[key] = Variant(signature, value)
    options["dry_run"] = Variant("b", True)
    return options


# The Manager's methods the fuzzer aims at, with the signatures the contract XML gives them.
OUR_METHODS = {name: interface(MANAGER).methods[name].in_signature
               for name in ("ListHolders", "Sweep", "SweepUnit", "GetHistory", "Reload")}


def targeted(rng: random.Random) -> tuple[str, str, str, list[Any]]:
    """(interface, member, signature, body) aimed at the daemon's own validation."""
    roll = rng.random()
    if roll < 0.55:
        member = rng.choice(sorted(OUR_METHODS))
        options = near_valid_options(rng)
        if member == "ListHolders":
            options = {k: v for k, v in options.items() if k != "dry_run"}
        bodies: dict[str, list[Any]] = {
            "ListHolders": [options], "Sweep": [options], "GetHistory": [rng.randint(0, 2**32 - 1)],
            "SweepUnit": [rng.choice(["", "x", "a b", "ok.service", random_text(rng)]), options],
            "Reload": []}
        if rng.random() < 0.8:
            return MANAGER, member, OUR_METHODS[member], bodies[member]
        signature = "".join(random_type(rng) for _ in range(rng.randint(0, 2)))
        return MANAGER, member, signature, [random_value(rng, t) for t in split_types(signature)]
    iface = rng.choice([MANAGER, GPU, "org.example.Nope", ""])
    member = rng.choice(["Get", "GetAll", "Set"])
    properties = "org.freedesktop.DBus.Properties"
    if member == "Get":
        return properties, member, "ss", [iface, rng.choice(PROPERTIES)]
    if member == "GetAll":
        return properties, member, "s", [iface]
    inner = random_type(rng, 2)
    return properties, member, "ssv", [iface, rng.choice(PROPERTIES), Variant(inner, random_value(rng, inner))]


def random_message(rng: random.Random) -> Message:
    path = rng.choice(PATHS)
    interface: str | None
    if rng.random() < 0.6:
        interface, member, signature, body = targeted(rng)
        path = MANAGER_PATH if rng.random() < 0.8 else path
    else:
        interface = rng.choice(INTERFACES)
        member = rng.choice(MEMBERS) if rng.random() < 0.7 else \
            rng.choice(string.ascii_letters) + "".join(rng.choice(string.ascii_letters + "_0123456789")
                                                       for _ in range(rng.randint(0, 12)))
        signature = "".join(random_type(rng) for _ in range(rng.randint(0, 3)))
        body = [random_value(rng, t) for t in split_types(signature)]
    flags = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if rng.random() < 0.2 else MessageFlag.NONE
    return Message(destination=BUS_NAME, path=path, interface=interface, member=member,
                   signature=signature, body=body, flags=flags)


async def fuzz(address: str) -> Counter[str]:
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    buses = [await MessageBus(bus_address=address).connect() for _ in range(4)]

    async def send(bus: MessageBus, msg: Message) -> None:
        reply = await asyncio.wait_for(bus.call(msg), 30)
        assert reply.message_type in (MessageType.METHOD_RETURN, MessageType.ERROR)
        outcomes[reply.error_name or "reply"] += 1

    for start in range(0, CALLS, BATCH):
        messages = [random_message(rng) for _ in range(min(BATCH, CALLS - start))]
        await asyncio.gather(*(send(buses[i % len(buses)], msg) for i, msg in enumerate(messages)))
    for bus in buses:
        bus.disconnect()
    return outcomes


def test_random_calls_are_all_answered(daemon: GuardDaemon) -> None:
    daemon.host.write_config("PollIntervalSec=0.25\n[Sweep]\nDryRun=yes\n")
    daemon.start()
    before = daemon.manager("GetHistory", "u", "0")[0]
    outcomes = asyncio.run(fuzz(daemon.address))
    assert sum(outcomes.values()) == CALLS
    # The mix reached the daemon's own validation, not only the bus library's.
    assert outcomes["org.gpuguard.GpuGuard1.Error.InvalidArgument"] > 50, outcomes
    assert outcomes["reply"] > 50, outcomes
    assert "org.gpuguard.GpuGuard1.Error.Failed" not in outcomes, outcomes
    assert "org.freedesktop.DBus.Error.NoReply" not in outcomes, outcomes
    # Still up, still right.
    assert daemon.alive()
    assert daemon.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 2
    assert daemon.get_property(MANAGER_PATH, MANAGER, "Busy") is False
    report = daemon.manager("Sweep", "a{sv}", "1", "reason", "s", "after the fuzz")[0]
    assert report["outcome"] == "dry-run" and report["terminated"] == []
    history = daemon.manager("GetHistory", "u", "0")[0]
    assert history[0]["id"] == report["id"] and len(history) > len(before)
    stderr = daemon.stderr()
    assert "Traceback" not in stderr and "internal error" not in stderr

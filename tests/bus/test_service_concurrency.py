"""Many clients at once while sweeps run: the event loop keeps answering, and answers right;
sweeps of one GPU never overlap, and each is in the history once."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd.bus.marshal import unwrap
from tests.conftest import GiB
from tests.dbus_harness import (
    BUS_NAME,
    COMM,
    MANAGER,
    MANAGER_PATH,
    PRIVATE_MINOR,
    GuardDaemon,
    private_gpu,
    private_holder,
)

pytest_plugins = ["tests.dbus_harness"]

CLIENTS = 100
GRACE_MS = 6000
# Enough reports that 100 GetHistory replies at once overflow the daemon's socket buffer, where
# dbus-fast alone would drop the connection (see gpuguardd/bus/compat.py).
REPORTS = 40


async def call(bus: MessageBus, member: str, signature: str = "", body: list[Any] | None = None,
               interface: str = MANAGER) -> Message:
    return await asyncio.wait_for(bus.call(Message(
        destination=BUS_NAME, path=MANAGER_PATH, interface=interface, member=member,
        signature=signature, body=body or [])), 30)


async def one_client(address: str) -> dict[str, Any]:
    bus = await MessageBus(bus_address=address).connect()
    try:
        started = time.monotonic()
        holders, history, busy = await asyncio.gather(
            call(bus, "ListHolders", "a{sv}", [{}]),
            call(bus, "GetHistory", "u", [0]),
            call(bus, "Get", "ss", [MANAGER, "Busy"], interface="org.freedesktop.DBus.Properties"))
        elapsed = time.monotonic() - started
    finally:
        bus.disconnect()
    for reply in (holders, history, busy):
        assert reply.message_type == MessageType.METHOD_RETURN, (reply.error_name, reply.body)
    return {"pids": [h["pid"].value for h in holders.body[0]], "history": len(history.body[0]),
            "busy": busy.body[0].value, "elapsed": elapsed}


async def scenario(address: str, gpu: int, pid: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    bus = await MessageBus(bus_address=address).connect()
    for n in range(REPORTS):
        filled = await call(bus, "Sweep", "a{sv}", [{"dry_run": Variant("b", True),
                                                     "reason": Variant("s", f"filler {n}")}])
        assert filled.message_type == MessageType.METHOD_RETURN
    sweep = asyncio.ensure_future(call(bus, "Sweep", "a{sv}", [{
        "gpus": Variant("au", [gpu]), "grace_ms": Variant("u", GRACE_MS)}]))
    deadline = time.monotonic() + 10
    while True:
        busy = await call(bus, "Get", "ss", [MANAGER, "Busy"], interface="org.freedesktop.DBus.Properties")
        if busy.body[0].value:
            break
        assert time.monotonic() < deadline, "the sweep never started"
        await asyncio.sleep(0.02)
    results = await asyncio.gather(*(one_client(address) for _ in range(CLIENTS)))
    reply = await asyncio.wait_for(sweep, 60)
    bus.disconnect()
    assert reply.message_type == MessageType.METHOD_RETURN, (reply.error_name, reply.body)
    report: dict[str, Any] = unwrap(reply.body[0])
    return report, list(results)


def test_hundred_clients_during_a_sweep(guard: GuardDaemon) -> None:
    # A holder that ignores SIGTERM keeps the sweep running for its whole grace period.
    pid = private_holder(guard.host, 2 * GiB, "--ignore-term")
    gpu = private_gpu(guard.host)
    started = time.monotonic()
    report, results = asyncio.run(scenario(guard.address, gpu, pid))
    assert len(results) == CLIENTS
    # Every client was answered while the sweep was running, and correctly.
    assert all(r["busy"] is True for r in results), "answers came after the sweep: loop blocked?"
    assert all(pid in r["pids"] for r in results)
    assert all(r["history"] == REPORTS for r in results)
    assert max(r["elapsed"] for r in results) < GRACE_MS / 1000
    assert time.monotonic() - started >= GRACE_MS / 1000
    assert report["outcome"] == "freed", report
    assert [(t["pid"], t["signal"]) for t in report["terminated"]] == [(pid, "SIGKILL")]
    assert report["targets"][0]["comm"] == COMM
    assert guard.get_property(MANAGER_PATH, MANAGER, "Busy") is False


POLLERS = 12
GRACE_SWEEPS_MS = 1500


async def poll_until(address: str, done: asyncio.Event) -> int:
    """ListHolders, GetHistory and Busy, one after another until `done`: the calls answered."""
    bus = await MessageBus(bus_address=address).connect()
    answered = 0
    try:
        while not done.is_set():
            for reply in (await call(bus, "ListHolders", "a{sv}", [{}]),
                          await call(bus, "GetHistory", "u", [0]),
                          await call(bus, "Get", "ss", [MANAGER, "Busy"],
                                     interface="org.freedesktop.DBus.Properties")):
                assert reply.message_type == MessageType.METHOD_RETURN, (reply.error_name, reply.body)
                answered += 1
    finally:
        bus.disconnect()
    return answered


async def sweeps_under_polling(address: str, scopes: list[list[int]]) -> tuple[list[Message], list[int]]:
    done = asyncio.Event()
    pollers = [asyncio.ensure_future(poll_until(address, done)) for _ in range(POLLERS)]
    await asyncio.sleep(0.2)  # the polling is under way before the first sweep
    buses = [await MessageBus(bus_address=address).connect() for _ in scopes]
    try:
        replies = await asyncio.gather(*(
            call(bus, "Sweep", "a{sv}", [{"gpus": Variant("au", gpus),
                                          "grace_ms": Variant("u", GRACE_SWEEPS_MS)}])
            for bus, gpus in zip(buses, scopes)))
    finally:
        done.set()
        for bus in buses:
            bus.disconnect()
    return list(replies), list(await asyncio.gather(*pollers))


def test_concurrent_sweeps_of_two_gpus_under_polling(guard: GuardDaemon) -> None:
    """Five sweeps at once (two of GPU a, two of GPU b, one of both) while
    twelve clients poll ListHolders, GetHistory and Busy. Every call is answered, sweeps of one
    GPU do not overlap, each holder is ended by one sweep, each sweep is in the history once."""
    host = guard.host
    a, b = private_gpu(host), private_gpu(host, PRIVATE_MINOR + 1)
    holders = {a: private_holder(host, 2 * GiB, "--ignore-term"),
               b: private_holder(host, 2 * GiB, "--ignore-term", minor=PRIVATE_MINOR + 1)}
    scopes = [[a], [b], [a, b], [a], [b]]
    replies, answered = asyncio.run(sweeps_under_polling(guard.address, scopes))
    for reply in replies:
        assert reply.message_type == MessageType.METHOD_RETURN, (reply.error_name, reply.body)
    reports: list[dict[str, Any]] = [unwrap(reply.body[0]) for reply in replies]
    assert all(n > 0 for n in answered), answered
    assert {r["outcome"] for r in reports} <= {"freed", "nothing-to-do"}, reports

    ended = collections.Counter(t["pid"] for r in reports for t in r["terminated"])
    assert ended == collections.Counter(holders.values()), ended
    for gpu in (a, b):
        spans = sorted((r["started_usec"], r["started_usec"] + r["duration_ms"] * 1000)
                       for r, scope in zip(reports, scopes) if gpu in scope)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"two sweeps of GPU {gpu} overlapped: {spans}"
    history = collections.Counter(r["id"] for r in guard.manager("GetHistory", "u", "0")[0])
    assert all(history[r["id"]] == 1 for r in reports), history

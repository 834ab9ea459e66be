"""No reply nears the bus's message limit, whatever the host holds: dbus-daemon disconnects a
sender whose message is over max_message_size (32 MiB: the tests' bus sets none, so it has the
system bus's default, as /usr/share/dbus-1/system.conf documents), and gpuguardd would exit.

The worst cases are built for real: holders with as much argv as the kernel allows, and a
history file that an older gpuguard could have written. Reply sizes are measured on the wire.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd import safetext
from gpuguardd.bus import names, replysize
from gpuguardd.daemon.history import FILE_NAME
from tests.bus.adversarial.hostile_holder import ARG_MAX_ONE, spawn
from tests.dbus_harness import BUS_NAME, MANAGER, MANAGER_PATH, GuardDaemon, wait_until
from tests.unit.adversarial.test_reply_size import MiB, big_report, plain

pytest_plugins = ["tests.dbus_harness"]


def call_sized(address: str, member: str, signature: str, body: list[Any]) -> tuple[Any, int]:
    """The reply's body and its size as marshalled on the wire."""
    async def go() -> tuple[Any, int]:
        bus = await MessageBus(bus_address=address).connect()
        try:
            reply = await bus.call(Message(destination=BUS_NAME, path=MANAGER_PATH,
                                           interface=MANAGER, member=member,
                                           signature=signature, body=body))
        finally:
            bus.disconnect()
        assert reply is not None
        assert reply.message_type == MessageType.METHOD_RETURN, reply.body
        return reply.body, len(bytes(reply._marshall(False)))
    return asyncio.run(go())


def test_holders_with_maximal_argv_keep_list_holders_small(guard: GuardDaemon) -> None:
    # 18 holders with ~1.9 MB of argv each: 34 MB of command lines, over the bus's limit.
    junk = [b"A" * ARG_MAX_ONE] * 15
    procs = [spawn(guard.host, junk) for _ in range(18)]
    pids = {p.pid for p in procs}

    def listed() -> tuple[list[Any], int] | None:
        body, size = call_sized(guard.address, "ListHolders", "a{sv}",
                                [{"fresh": Variant("b", True)}])
        holders = plain(body[0])
        return (holders, size) if pids <= {h["pid"] for h in holders} else None
    holders, size = wait_until(listed, 20, "ListHolders to list the 18 holders", interval=0.2)
    assert size < 1 * MiB, size  # 18 holders: no compaction needed, the caps do it
    for holder in holders:
        if holder["pid"] in pids:
            assert len(holder["cmdline"].encode()) <= safetext.CMDLINE_MAX
            assert holder["cmdline"].endswith(safetext.MARKER)
            assert "holder.py" in holder["cmdline"]
    # Another user's call, and a dry run that plans all of them, also answer.
    nobody = guard.manager("ListHolders", "a{sv}", "0", as_nobody=True)[0]
    assert pids <= {h["pid"] for h in nobody}
    report, size = call_sized(guard.address, "Sweep", "a{sv}", [{"dry_run": Variant("b", True)}])
    assert pids <= {t["pid"] for t in plain(report[0])["targets"]}
    assert size < replysize.REPORT_BUDGET + 4096
    assert guard.alive()
    assert "disconnected" not in guard.stderr().lower()


def write_history(daemon: GuardDaemon, reports: list[dict[str, Any]]) -> Path:
    state = Path(str(daemon.host.root)) / "state"
    state.mkdir(exist_ok=True)
    with open(state / FILE_NAME, "w") as handle:
        for report in reports:
            handle.write(json.dumps(report) + "\n")
    return state / FILE_NAME


def test_a_35_mb_history_keeps_get_history_small(daemon: GuardDaemon) -> None:
    # 999 reports of ~36 KB and one of ~13 MB (40,000 targets): 48 MB on disk.
    reports = [big_report(n, 100) for n in range(999)] + [big_report(999, 40_000)]
    path = write_history(daemon, reports)
    assert path.stat().st_size > 35 * MiB
    daemon.host.write_config()
    for _ in range(2):  # the same after a restart
        daemon.start()
        body, size = call_sized(daemon.address, "GetHistory", "u", [0])
        got = plain(body[0])
        assert size <= replysize.REPLY_BUDGET + 4096, size
        # The newest (the huge one) first, its lists cut with a warning saying so.
        assert got[0]["id"] == f"{999:032x}"
        assert len(got[0]["targets"]) < 40_000
        assert any("left out of this copy" in w for w in got[0]["warnings"])
        # Older reports follow until the budget; the last one says how many were left out.
        assert 100 < len(got) < 1000
        assert got[-1][names.OMITTED_KEY] == 1000 - len(got)
        assert all(names.OMITTED_KEY not in r for r in got[:-1])
        ids = [r["id"] for r in got]
        assert ids == [f"{n:032x}" for n in range(999, 999 - len(got), -1)]
        # The huge report alone, and LastSweep (it too) in Properties.GetAll, are bounded.
        _, size = call_sized(daemon.address, "GetHistory", "u", [1])
        assert size <= replysize.REPORT_BUDGET + 4096
        result = daemon.busctl("call", "--json=short", BUS_NAME, MANAGER_PATH,
                               "org.freedesktop.DBus.Properties", "GetAll", "s", MANAGER)
        assert result.returncode == 0, result.stderr
        history = daemon.ctl("history", "-n", "1000", "--json", as_nobody=True)
        assert history.returncode == 0, history.stderr
        text = daemon.ctl("history", "-n", "1000")
        assert text.returncode == 0, text.stderr
        assert f"({1000 - len(got)} more reports not shown" in text.stdout
        assert daemon.alive()
        daemon.stop()
    # The file itself is untouched: the whole huge report is still there.
    with open(path, "rb") as handle:
        assert sum(1 for _ in handle) == 1000


# One process with a long executable path and a long argv that forks HOLDERS children: each
# inherits its device fd, its exe and its command line, so each is a holder with ~8 KiB of text.
FORKER = """
import os, signal, sys, time
os.setsid()
fd = os.open(sys.argv[1], os.O_PATH)
for _ in range(int(sys.argv[2])):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(3600)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""
HOLDERS = 1200


def test_many_long_holders_are_compacted_not_dropped(guard: GuardDaemon,
                                                           tmp_path: Path) -> None:
    import os
    import signal
    import subprocess

    import psutil

    from tests.bus.adversarial.hostile_holder import odd_interpreter
    from tests.dbus_harness import PRIVATE_MINOR, private_gpu
    private_gpu(guard.host)
    deep = tmp_path / "/".join(["d" * 200] * 18)  # a 3.6 KB path: exe near PATH_MAX
    exe = odd_interpreter(deep)
    node = str(guard.host.dev / f"nvidia{PRIVATE_MINOR}")
    proc = subprocess.Popen([exe, "-c", FORKER, node, str(HOLDERS), "C" * 4096],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        pids = {proc.pid} | {child.pid for child in psutil.Process(proc.pid).children()}
        assert len(pids) == HOLDERS + 1

        def listed() -> tuple[list[Any], int] | None:
            body, size = call_sized(guard.address, "ListHolders", "a{sv}",
                                    [{"fresh": Variant("b", True)}])
            holders = [h for h in plain(body[0]) if h["pid"] in pids]
            return (holders, size) if len(holders) == len(pids) else None
        holders, size = wait_until(listed, 60, f"ListHolders to list {HOLDERS + 1} holders",
                                   interval=1)
        # Sent in full they would make ~10 MB: every one is still listed, its text cut.
        assert size <= replysize.REPLY_BUDGET + 4096, size
        assert all(len(h["exe"].encode()) <= replysize.COMPACT_TEXT for h in holders)
        assert all(h["exe"].endswith(safetext.MARKER) for h in holders)
        assert not any(names.OMITTED_KEY in h for h in holders)
        assert guard.alive()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

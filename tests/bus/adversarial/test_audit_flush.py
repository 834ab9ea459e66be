"""The audit cannot be flushed: dry runs by users other than root are answered, signalled and
logged, but not kept in the history, so no number of them pushes a real sweep's record out of
GetHistory or, by compaction, out of history.jsonl. Root's dry runs (hooks, admins) are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuguardd.daemon.history import FILE_NAME
from tests.dbus_harness import FAST_POLL, NOBODY, PYTHON, GuardDaemon, private_gpu, private_holder, run

pytest_plugins = ["tests.dbus_harness"]

HISTORY_MAX = 20
FLOOD = 3 * HISTORY_MAX  # past HistoryMax and past the compaction point (max + 10)

# As uid 65534, on one connection: FLOOD dry runs, printing each report id.
FLOODER = """
import asyncio, sys
from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    for _ in range(int(sys.argv[2])):
        reply = await bus.call(Message(
            destination="org.gpuguard.GpuGuard1", path="/org/gpuguard/GpuGuard1",
            interface="org.gpuguard.GpuGuard1.Manager", member="Sweep", signature="a{sv}",
            body=[{"dry_run": Variant("b", True), "reason": Variant("s", "flush")}]))
        assert reply.message_type == MessageType.METHOD_RETURN, reply.body
        print(reply.body[0]["id"].value, reply.body[0]["requested_by"].value, flush=True)
    bus.disconnect()

asyncio.run(main())
"""


def history_ids(guard: GuardDaemon) -> list[str]:
    return [r["id"] for r in guard.manager("GetHistory", "u", "0")[0]]


def test_dry_runs_by_nobody_never_displace_a_real_sweep(daemon: GuardDaemon) -> None:
    daemon.host.write_config(FAST_POLL + f"HistoryMax={HISTORY_MAX}\n")
    daemon.start()
    pid = private_holder(daemon.host)
    gpu = str(private_gpu(daemon.host))
    real = daemon.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "grace_ms", "u", "1000")[0]
    assert real["outcome"] == "freed" and [t["pid"] for t in real["terminated"]] == [pid]
    root_dry = daemon.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")[0]

    flood = run([*NOBODY, PYTHON, "-c", FLOODER, daemon.address, str(FLOOD)], env=daemon.env,
                timeout=300)
    assert flood.returncode == 0, flood.stderr
    dry_ids = [line.split()[0] for line in flood.stdout.splitlines()]
    assert len(dry_ids) == FLOOD
    assert all("uid 65534" in line for line in flood.stdout.splitlines())

    kept = history_ids(daemon)
    assert real["id"] in kept and root_dry["id"] in kept
    assert not set(dry_ids) & set(kept)
    # On disk as well, and after a restart (history.jsonl read back).
    path = Path(str(daemon.host.root)) / "state" / FILE_NAME
    on_disk = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert real["id"] in on_disk and not set(dry_ids) & set(on_disk)
    daemon.stop()
    daemon.start()
    assert real["id"] in history_ids(daemon)
    assert daemon.manager("GetHistory", "u", "2")[0][1]["id"] == real["id"]

"""The daemon's replies are never stale: a new report, a new holder, a different count or
filter each get their own reply, however often the same call came before."""

from __future__ import annotations

from typing import Any

from tests.dbus_harness import GuardDaemon, dry_sweep, private_holder, wait_until

pytest_plugins = ["tests.dbus_harness"]


def history(guard: GuardDaemon, count: int) -> list[str]:
    return [r["id"] for r in guard.manager("GetHistory", "u", str(count))[0]]



def test_get_history_follows_every_new_report(guard: GuardDaemon) -> None:
    ids = [dry_sweep(guard, f"sweep {n}") for n in range(3)]
    for _ in range(3):
        assert history(guard, 10) == ids[::-1]
    assert history(guard, 2) == ids[:0:-1]
    newest = dry_sweep(guard, "after the others")
    assert history(guard, 10) == [newest, *ids[::-1]]
    assert history(guard, 2) == [newest, ids[-1]]
    reports: list[dict[str, Any]] = guard.manager("GetHistory", "u", "1")[0]
    assert reports[0]["reason"] == "after the others"


def test_list_holders_follows_a_new_holder(guard: GuardDaemon) -> None:
    def pids(*args: str) -> set[int]:
        holders = guard.manager("ListHolders", "a{sv}", *(args or ("0",)))[0]
        return {h["pid"] for h in holders}

    first = pids()
    for _ in range(3):  # served from one fresh scan
        assert pids() == first
    pid = private_holder(guard.host)
    # fresh=true waits for a scan that started after the call: a new reply, with the holder.
    assert pid in pids("1", "fresh", "b", "true")
    wait_until(lambda: pid in pids(), 15, f"ListHolders to list {pid}")
    assert pid not in pids("1", "gpus", "au", "1", "0")  # its own filter, its own reply


def test_redacted_and_full_replies_never_mix(guard: GuardDaemon) -> None:
    """Root sees command lines, another user (without view-details) does not, asked in turn,
    from one scan and the next."""
    pid = private_holder(guard.host)
    wait_until(lambda: pid in {h["pid"] for h in guard.manager("ListHolders", "a{sv}", "0")[0]},
               15, f"ListHolders to list {pid}")
    for _ in range(4):
        full = guard.manager("ListHolders", "a{sv}", "0")[0]
        redacted = guard.manager("ListHolders", "a{sv}", "0", as_nobody=True)[0]
        assert "holder.py" in next(h for h in full if h["pid"] == pid)["cmdline"]
        assert next(h for h in redacted if h["pid"] == pid)["cmdline"] == ""

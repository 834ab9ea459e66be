"""Forged signals and the Cockpit page: any user can send a
signal claiming gpuguardd's path and interface, straight to every connection on the bus (the
Cockpit bridge's among them) or as a broadcast. The page listens through cockpit.dbus clients
opened on a bus name (gpuguardd's, and org.freedesktop.DBus for NameOwnerChanged); the bridge
matches such a client's signals on that name's current owner, so only gpuguardd's unique name
(and the bus daemon) can put an event on the page. Checked here with Debian's cockpit-bridge.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

from playwright.sync_api import expect

from tests.bus.adversarial.test_forged_signals import forge
from tests.cockpit_harness import CockpitWs
from tests.dbus_harness import BUS_NAME, FAST_POLL, MANAGER, MANAGER_PATH, GuardDaemon, private_gpu

pytest_plugins = ["tests.dbus_harness", "tests.cockpit_harness"]

FORGED_PID = 424242


def unique_names(guard: GuardDaemon) -> list[str]:
    names = subprocess.run(["busctl", f"--address={guard.address}", "--json=short", "call",
                            "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                            "ListNames"], capture_output=True, text=True, timeout=30, check=True)
    return [str(n) for n in json.loads(names.stdout)["data"][0] if str(n).startswith(":")]


def test_the_page_shows_only_gpuguardds_signals(daemon: GuardDaemon,
                                                cockpit_ws: Callable[..., CockpitWs],
                                                browser_page: Callable[..., Any]) -> None:
    daemon.host.write_config(FAST_POLL)
    daemon.start()
    page = browser_page(cockpit_ws().url)
    expect(page.locator("section.gg-gpu")).to_have_count(2)
    events = page.locator(".gg-event")
    shown_before = events.count()

    # To every connection (the bridge's is one of them), and to everyone (a broadcast).
    for destination in [*unique_names(daemon), ""]:
        forge(daemon.address, destination, MANAGER_PATH, f"{MANAGER}.ProcessTerminated", "susss",
              "forged000", FORGED_PID, "forged-comm", "sshd.service", "SIGKILL")
        forge(daemon.address, destination, MANAGER_PATH, f"{MANAGER}.LeakSuspected", "ust",
              0, "GPU-forged", 1 << 30)
        forge(daemon.address, destination, MANAGER_PATH, f"{MANAGER}.SweepStarted", "sa{sv}",
              "forged111", {})
        forge(daemon.address, destination, "/org/freedesktop/DBus",
              "org.freedesktop.DBus.NameOwnerChanged", "sss", BUS_NAME, ":1.1", "")

    # A real sweep after the forgeries: once its events are on the page, they were read.
    gpu = str(private_gpu(daemon.host))
    report = daemon.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "dry_run", "b", "true")[0]
    expect(page.locator(f".gg-event[data-sweep='{report['id']}']")).to_have_count(2)
    shown = events.all_inner_texts()
    assert len(shown) == shown_before + 2, shown
    assert not [text for text in shown if "forged" in text.lower() or "stopped" in text], shown
    expect(page.locator(f".gg-event[data-pid='{FORGED_PID}']")).to_have_count(0)
    expect(page.locator(".gg-status")).to_have_count(0)  # not "gpuguardd stopped"

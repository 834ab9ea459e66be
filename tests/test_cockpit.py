"""The Cockpit page (cockpit/) in a real browser: Debian's cockpit-ws and chromium, gpuguardd
on the tests' private system bus over the fake NVML, real holder processes.

What the page shows is checked against what the daemon itself answers on the bus (busctl), and
every change must reach the page without a reload: the tests mark the window once and check
the mark is still there at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.cockpit_harness import CockpitWs
from tests.conftest import GiB, GpuHost
from tests.dbus_harness import COMM, FAST_POLL, GPU, MANAGER, MANAGER_PATH, GuardDaemon

pytest_plugins = ["tests.dbus_harness", "tests.cockpit_harness"]

LIVE_SEC = 2.0  # the bound for a holder to appear or disappear on the page


def holder(host: GpuHost, gpu: int, used: int = 2 * GiB, *extra: str) -> int:
    """A compute process on one of this test host's GPUs (their device numbers are this host's
    alone, so a sweep of them can only end the test's own processes)."""
    proc = host.spawn("--hold", host.node(f"nvidia{gpu}"), "--comm", COMM, *extra, nvml=(gpu, used))
    return proc.pid


def alive(host: GpuHost, pid: int) -> bool:
    return any(p.pid == pid and p.alive() for p in host.procs)


def end(host: GpuHost, pid: int) -> None:
    """End a holder as its own program would (not through gpuguard), and drop it from NVML."""
    proc = next(p for p in host.procs if p.pid == pid)
    proc.stop()
    host.state.procs = [p for p in host.state.procs if p.pid != pid]
    host.publish()


def open_gpuguard(ws: CockpitWs, browser_page: Callable[..., Any], **kwargs: Any) -> Any:
    page = browser_page(ws.url, **kwargs)
    page.evaluate("window.ggNoReload = 'still here'")
    return page


def assert_not_reloaded(page: Any) -> None:
    assert page.evaluate("window.ggNoReload") == "still here", "the page was reloaded"


def row(page: Any, pid: int) -> Any:
    return page.locator(f"table.gg-holders tr[data-pid='{pid}']")


def gpu_paths(guard: GuardDaemon) -> list[str]:
    managed = guard.busctl_call(MANAGER_PATH, "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")[0]
    return sorted((path for path, ifaces in managed.items() if GPU in ifaces),
                  key=lambda p: int(p.rsplit("/", 1)[1]))


@pytest.fixture
def guard(daemon: GuardDaemon) -> GuardDaemon:
    """gpuguardd polling every 0.25 s, protecting a copy of the Python interpreter (by file)."""
    protected = daemon.host.root / "protected-python"
    shutil.copy2(os.path.realpath(sys.executable), protected)
    daemon.host.write_config(FAST_POLL + f"[Sweep]\nProtectedExecutables={protected}\n")
    daemon.start()
    return daemon


def protected_holder(host: GpuHost, gpu: int) -> int:
    exe = str(host.root / "protected-python")
    return host.spawn("--hold", host.node(f"nvidia{gpu}"), "--comm", "protected-job", exe=exe,
                      nvml=(gpu, GiB)).pid


def test_page_shows_the_daemons_gpus_and_holders_live(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                                     browser_page: Callable[..., Any]) -> None:
    first = holder(guard.host, 0)
    # A management client (no CUDA context: NVML does not list it) and a protected process.
    management = guard.host.spawn("--hold", guard.host.node("nvidia1"), "--comm", "nvidia-smi").pid
    protected = protected_holder(guard.host, 1)
    page = open_gpuguard(cockpit_ws(), browser_page)

    # The cards: one per Gpu object, with the daemon's own values.
    paths = gpu_paths(guard)
    assert len(paths) == 2
    cards = page.locator("section.gg-gpu")
    expect(cards).to_have_count(len(paths))
    for path in paths:
        index = guard.get_property(path, GPU, "Index")
        card = page.locator(f"section.gg-gpu[data-index='{index}']")
        expect(card).to_contain_text(guard.get_property(path, GPU, "Name"))
        expect(card.locator(".gg-uuid")).to_have_text(guard.get_property(path, GPU, "Uuid"))
        expect(card.locator(".gg-state")).to_have_text(guard.get_property(path, GPU, "State"))
    version = guard.get_property(MANAGER_PATH, MANAGER, "Version")
    expect(page.locator(".gg-versions")).to_contain_text(f"gpuguardd {version}")

    # The holders: every process ListHolders reports, with its user, kind and how it was found.
    expect(row(page, first)).to_be_visible()
    expect(row(page, management)).to_be_visible()
    expect(row(page, protected)).to_be_visible()
    listed = {h["pid"]: h for h in guard.manager("ListHolders", "a{sv}", "0")[0]}
    for pid in (first, management, protected):
        cells = row(page, pid).locator("td")
        expect(cells.nth(0)).to_have_text(str(pid))
        expect(cells.nth(1)).to_have_text(listed[pid]["user"])
        expect(cells.nth(4)).to_contain_text(listed[pid]["kind"])
        expect(cells.nth(5)).to_have_text(", ".join(map(str, listed[pid]["gpus"])))
        expect(cells.nth(7)).to_have_text(", ".join(listed[pid]["how"]))
        expect(cells.nth(8)).to_contain_text(listed[pid]["cmdline"] or listed[pid]["exe"])
    assert listed[management]["kind"] == "management" and not listed[management]["protected"]
    assert listed[protected]["protected"] and listed[protected]["protected_why"]
    expect(row(page, protected).locator(".gg-protected-why")).to_contain_text(listed[protected]["protected_why"])
    expect(row(page, management).locator(".gg-protected-why")).to_have_count(0)
    expect(page.locator("section.gg-gpu[data-index='1'] .gg-holder-kinds")).to_contain_text(
        "1 compute, 1 management, 1 protected")
    expect(page.locator("section.gg-gpu[data-index='0'] .gg-holder-kinds")).to_contain_text("1 compute")
    expect(page.locator("section.gg-gpu[data-index='0'] .gg-state")).to_have_text("in-use")
    expect(page.locator("section.gg-gpu[data-index='0']")).to_contain_text("2.0 GiB of 80.0 GiB")

    # Live: a new holder appears, an ended one disappears, within LIVE_SEC and without reload.
    started = time.monotonic()
    second = holder(guard.host, 1, 3 * GiB)
    expect(row(page, second)).to_be_visible(timeout=LIVE_SEC * 1000)
    appeared = time.monotonic() - started
    expect(page.locator("section.gg-gpu[data-index='1']")).to_contain_text("4.0 GiB of 80.0 GiB")
    started = time.monotonic()
    end(guard.host, first)
    expect(row(page, first)).to_have_count(0, timeout=LIVE_SEC * 1000)
    gone = time.monotonic() - started
    assert appeared < LIVE_SEC and gone < LIVE_SEC, (appeared, gone)
    expect(page.locator("section.gg-gpu[data-index='0'] .gg-state")).to_have_text("idle")

    # Filters: by GPU, by unit (none of these processes has one).
    page.select_option("#filter-gpu", "1")
    expect(row(page, second)).to_be_visible()
    page.select_option("#filter-gpu", "0")
    expect(row(page, second)).to_have_count(0)
    page.select_option("#filter-gpu", "")
    page.fill("#filter-unit", "no-such.service")
    expect(page.locator(".gg-holders-empty")).to_contain_text("No holder matches the filter")
    page.fill("#filter-unit", "")
    expect(row(page, second)).to_be_visible()
    assert_not_reloaded(page)
    assert alive(guard.host, second) and alive(guard.host, management) and alive(guard.host, protected)

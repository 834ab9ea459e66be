"""The Cockpit page (cockpit/) in a real browser: Debian's cockpit-ws and chromium, gpuguardd
on the tests' private system bus over the fake NVML, real holder processes.

What the page shows is checked against what the daemon itself answers on the bus (busctl), and
every change must reach the page without a reload: the tests mark the window once and check
the mark is still there at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from gpuguardd import __version__
from tests import dbus_harness
from tests.cockpit_harness import NOBODY, CockpitWs, require_cockpit_tools, screenshot
from tests.conftest import GiB, GpuHost
from tests.dbus_harness import COMM, FAST_POLL, GPU, MANAGER, MANAGER_PATH, GuardDaemon, wait_until
from tests.host.test_mig import MIG_A, MIG_B, MIG_C, setup_mig
from tests.packages import build

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
        # Whose GPU, and its marketing name, in the card's title.
        expect(card.locator(".gg-gpu-name")).to_have_text(guard.get_property(path, GPU, "Name"))
        assert guard.get_property(path, GPU, "Vendor") == "nvidia"
        expect(card.locator(".gg-vendor")).to_have_text("NVIDIA")
        expect(card.locator(".gg-vendor")).to_have_attribute("data-vendor", "nvidia")
        expect(card.locator(".gg-uuid")).to_have_text(guard.get_property(path, GPU, "Uuid"))
        expect(card.locator(".gg-state")).to_have_text(guard.get_property(path, GPU, "State"))
    version = guard.get_property(MANAGER_PATH, MANAGER, "Version")
    expect(page.locator(".gg-versions")).to_contain_text(f"gpuguardd {version}")
    expect(page.locator(".gg-versions")).to_contain_text("NVIDIA driver")
    expect(page.locator(".gg-vendors")).to_have_text(", GPUs: nvidia")

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
    # gpuguardd itself is the other management holder, protected: its NVML library holds every
    # GPU's node, as libnvidia-ml does (the fake's default).
    expect(page.locator("section.gg-gpu[data-index='1'] .gg-holder-kinds")).to_contain_text(
        "1 compute, 2 management, 2 protected")
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


def open_sweep_dialog(page: Any) -> Any:
    page.click("#open-sweep")
    dialog = page.locator(".gg-sweep-dialog")
    expect(dialog).to_be_visible()
    return dialog


def choose_gpus(page: Any, *indices: int) -> None:
    page.check("#scope-gpus")
    for index in indices:
        page.check(f"#sweep-gpu-{index}")


def report_cell(section: Any, pid: int, label: str) -> Any:
    """The cell under column `label` of the row of `pid` in a report section."""
    pid_cell = section.page.locator(f"td[data-label='PID']:text-is('{pid}')")
    return section.locator("tbody tr", has=pid_cell).locator(f"td[data-label='{label}']")


def event(page: Any, pid: int) -> Any:
    return page.locator(f".gg-event[data-pid='{pid}']")


def test_preview_then_sweep_as_admin(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                     browser_page: Callable[..., Any]) -> None:
    """Preview shows the plan and ends nothing; Sweep ends the holders, each exit shows in the
    event feed, and the new history row opens to the full report."""
    polite = holder(guard.host, 1)
    stubborn = holder(guard.host, 1, 4 * GiB, "--ignore-term")
    # NVML charges it nothing: gpu_memory 0, which the contract reads as "NVML does not know"
    # (every process's while gpuguardd runs in a container, where NVML's PIDs are the host's).
    # The page says unknown, not "0 B" beside a GPU whose memory is in use.
    unknown = holder(guard.host, 1, 0)
    bystander = holder(guard.host, 0)
    page = open_gpuguard(cockpit_ws(), browser_page)
    expect(row(page, stubborn)).to_be_visible()
    expect(page.locator(".gg-admin-note")).to_have_count(0)

    dialog = open_sweep_dialog(page)
    choose_gpus(page, 1)
    page.fill("#sweep-grace", "2")
    page.fill("#sweep-reason", "cockpit test")
    page.click("#sweep-preview")
    plan = dialog.locator(".gg-report-section[data-section='targets']")
    expect(plan).to_be_visible()
    expect(dialog.locator(".gg-plan-summary")).to_contain_text("would end 3 processes; nothing was ended")
    for pid in (polite, stubborn, unknown):
        expect(plan.locator("td", has_text=str(pid)).first).to_be_visible()
    expect(plan).not_to_contain_text(str(bystander))
    expect(report_cell(plan, stubborn, "Memory")).to_have_text("4.0 GiB")
    expect(report_cell(plan, unknown, "Memory")).to_have_text("—")
    expect(row(page, unknown).locator("td[data-label='Memory']")).to_have_text("—")
    time.sleep(0.5)
    assert all(alive(guard.host, pid) for pid in (polite, stubborn, unknown, bystander)), \
        "a preview ended a process"
    expect(row(page, polite)).to_be_visible()

    history_before = len(guard.manager("GetHistory", "u", "0")[0])
    page.click("#sweep-run")
    # While it runs (the stubborn holder for its 2 s of grace): the progress from the signals.
    running = page.locator(".gg-running")
    expect(running).to_contain_text("2 processes ended so far")
    expect(running).to_contain_text("GPU 1")
    expect(dialog.locator(".gg-sweep-summary")).to_contain_text("Sweep finished: freed", timeout=30000)
    expect(running).to_have_count(0)
    report = guard.manager("GetHistory", "u", "1")[0][0]
    assert report["outcome"] == "freed" and report["reason"] == "cockpit test", report
    assert report["requested_by"].startswith("uid 0 (root)"), report["requested_by"]
    assert {t["pid"]: t["signal"] for t in report["terminated"]} == {
        polite: "SIGTERM", stubborn: "SIGKILL", unknown: "SIGTERM"}
    assert len(guard.manager("GetHistory", "u", "0")[0]) == history_before + 1
    wait_until(lambda: not any(alive(guard.host, pid) for pid in (polite, stubborn, unknown)), 10,
               "the holders to end")
    assert alive(guard.host, bystander), "the sweep of GPU 1 ended a process on GPU 0"
    terminated = dialog.locator(".gg-report-section[data-section='terminated']")
    expect(terminated).to_contain_text("SIGKILL")
    page.click("#sweep-close")
    expect(dialog).to_have_count(0)

    # The event feed: the sweep's start, each exit with its signal, the end.
    expect(event(page, polite)).to_contain_text(f"Process {polite} ({COMM}) ended after SIGTERM")
    expect(event(page, stubborn)).to_contain_text(f"Process {stubborn} ({COMM}) ended after SIGKILL")
    short = report["id"][:8]
    expect(page.locator(".gg-event", has_text=f"Sweep {short} started")).to_have_count(1)
    expect(page.locator(".gg-event", has_text=f"Sweep {short} finished: freed")).to_have_count(1)
    expect(row(page, polite)).to_have_count(0)
    expect(row(page, stubborn)).to_have_count(0)
    expect(row(page, bystander)).to_be_visible()

    # The card's last sweep, and the history row that opens to the whole report.
    expect(page.locator("section.gg-gpu[data-index='1'] .gg-last-sweep")).to_contain_text("freed")
    expect(page.locator("section.gg-gpu[data-index='0'] .gg-last-sweep")).to_contain_text("never swept")
    history_row = page.locator(f"tbody.gg-history-row[data-report-id='{report['id']}']")
    expect(history_row).to_be_visible()
    expect(page.locator("tbody.gg-history-row").first).to_have_attribute("data-report-id", report["id"])
    details = history_row.locator(f".gg-report[data-report-id='{report['id']}']")
    expect(details).to_have_count(0)
    history_row.locator("button[id^='history-expand']").click()
    expect(details).to_be_visible()
    expect(details).to_contain_text(report["requested_by"])
    expect(details).to_contain_text("cockpit test")
    for section in ("targets", "terminated", "gpus"):
        expect(details.locator(f".gg-report-section[data-section='{section}']")).to_be_visible()
    expect(details.locator(".gg-report-section[data-section='terminated']")).to_contain_text(str(stubborn))
    gpu_row = details.locator(".gg-report-section[data-section='gpus'] tbody tr")
    expect(gpu_row).to_have_count(1)
    assert report["gpus"][0]["memory_used_before"] == 6 * GiB
    expect(gpu_row).to_contain_text("6.0 GiB")  # before: both holders' memory
    expect(gpu_row.locator("td").last).to_have_text("yes")
    assert_not_reloaded(page)
    # The README's picture (cockpit/screenshot.png is a copy): two GPUs, the report of the
    # sweep that had to SIGKILL the stubborn holder.
    page.set_viewport_size({"width": 1280, "height": 900})
    screenshot(page, "readme")


def test_invalid_argument_is_shown(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                   browser_page: Callable[..., Any]) -> None:
    page = open_gpuguard(cockpit_ws(), browser_page)
    dialog = open_sweep_dialog(page)
    page.check("#scope-unit")
    page.fill("#sweep-unit", "bad unit/name")
    page.click("#sweep-preview")
    error = dialog.locator(".gg-dialog-error")
    expect(error).to_contain_text("Invalid request:")
    expect(error).to_contain_text("bad unit/name")
    screenshot(page, "invalid-argument")
    # The page's own checks come first: no call for an empty scope.
    page.fill("#sweep-unit", "")
    page.click("#sweep-preview")
    expect(error).to_contain_text("Enter a unit name.")


def test_non_admin_session_cannot_sweep_and_is_told_why(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                                       browser_page: Callable[..., Any]) -> None:
    """A Cockpit session without administrative access (the bridge runs as uid 65534, whose
    superuser is "none") sees everything, may preview, and cannot sweep."""
    pid = holder(guard.host, 0)
    page = open_gpuguard(cockpit_ws(uid=NOBODY), browser_page)
    expect(row(page, pid)).to_be_visible()
    note = page.locator(".gg-admin-note")
    expect(note).to_contain_text("needs administrative access, which is off")
    dialog = open_sweep_dialog(page)
    choose_gpus(page, 0)
    run = page.locator("#sweep-run")
    expect(run).to_be_disabled()
    expect(dialog.locator("#sweep-disabled-why")).to_contain_text("turn it on with the \"Limited access\" button")
    expect(run).to_have_attribute("aria-describedby", "sweep-disabled-why")
    # A dry run is anyone's: the plan shows, nothing ends.
    page.click("#sweep-preview")
    expect(dialog.locator(".gg-plan-summary")).to_contain_text("would end 1 process; nothing was ended")
    expect(dialog.locator(".gg-report")).to_contain_text("uid 65534")
    run.click(force=True)  # a disabled button does nothing, even when clicked
    time.sleep(1)
    assert alive(guard.host, pid)
    assert not [r for r in guard.manager("GetHistory", "u", "0")[0] if not r["dry_run"]], "a sweep ran"
    screenshot(page, "non-admin-dialog")


def test_daemon_missing_stopped_and_restarted(daemon: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                              browser_page: Callable[..., Any]) -> None:
    """No daemon at start (and nothing D-Bus could start): "not installed"; it starts: the page
    connects by itself; it stops mid-session: said so; it is back: the page recovers."""
    daemon.host.write_config(FAST_POLL)
    page = open_gpuguard(cockpit_ws(), browser_page)
    status = page.locator(".gg-status")
    expect(status).to_have_attribute("data-daemon", "not-installed")
    expect(status).to_contain_text("gpuguard is not installed on this machine")
    screenshot(page, "daemon-not-installed")

    daemon.start()
    expect(page.locator("section.gg-gpu")).to_have_count(2)
    expect(status).to_have_count(0)
    pid = holder(daemon.host, 0)
    expect(row(page, pid)).to_be_visible()

    daemon.stop()
    expect(status).to_have_attribute("data-daemon", "stopped")
    expect(status).to_contain_text("gpuguardd stopped at")
    expect(page.locator("section.gg-gpu")).to_have_count(0)
    expect(page.locator(".gg-event", has_text="gpuguardd stopped")).to_have_count(1)
    expect(page.locator("#open-sweep")).to_be_disabled()
    screenshot(page, "daemon-stopped")

    daemon.start()
    expect(page.locator("section.gg-gpu")).to_have_count(2)
    expect(status).to_have_count(0)
    expect(row(page, pid)).to_be_visible()
    expect(page.locator(".gg-event", has_text="gpuguardd started")).to_have_count(2)
    # Live again: signals and properties from the new daemon reach the page.
    second = holder(daemon.host, 1)
    expect(row(page, second)).to_be_visible(timeout=LIVE_SEC * 1000)
    expect(page.locator("#open-sweep")).to_be_enabled()
    assert_not_reloaded(page)


def test_dark_theme_and_keyboard(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                 browser_page: Callable[..., Any]) -> None:
    holder(guard.host, 0)
    ws = cockpit_ws()
    light = open_gpuguard(ws, browser_page)
    expect(light.locator("section.gg-gpu")).to_have_count(2)
    assert light.evaluate("document.documentElement.classList.contains('pf-v6-theme-dark')") is False
    background = "getComputedStyle(document.querySelector('.gg-page')).backgroundColor"
    light_bg = light.evaluate(background)

    dark = open_gpuguard(ws, browser_page, color_scheme="dark")
    expect(dark.locator("section.gg-gpu")).to_have_count(2)
    assert dark.evaluate("document.documentElement.classList.contains('pf-v6-theme-dark')") is True
    assert dark.evaluate(background) != light_bg
    # Cockpit's own switch (shell:style in localStorage, announced by a storage event) wins.
    dark.evaluate("""() => {
        localStorage.setItem('shell:style', 'light');
        window.dispatchEvent(new StorageEvent('storage', {key: 'shell:style'}));
    }""")
    assert dark.evaluate("document.documentElement.classList.contains('pf-v6-theme-dark')") is False
    dark.evaluate("""() => {
        localStorage.setItem('shell:style', 'dark');
        window.dispatchEvent(new StorageEvent('storage', {key: 'shell:style'}));
    }""")
    screenshot(dark, "dark-theme")

    # Keyboard only: Tab reaches the Sweep button, Enter opens the dialog, Escape closes it.
    light.locator("body").click(position={"x": 5, "y": 5})
    for _ in range(10):
        light.keyboard.press("Tab")
        if light.evaluate("document.activeElement && document.activeElement.id") == "open-sweep":
            break
    assert light.evaluate("document.activeElement.id") == "open-sweep"
    light.keyboard.press("Enter")
    dialog = light.locator(".gg-sweep-dialog")
    expect(dialog).to_be_visible()
    light.keyboard.press("Tab")
    assert light.evaluate("document.querySelector('.gg-sweep-dialog').contains(document.activeElement)")
    light.keyboard.press("Escape")
    expect(dialog).to_have_count(0)


def test_the_packaged_page_works(guard: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                 browser_page: Callable[..., Any], tmp_path: Path) -> None:
    """What cockpit-gpuguard.deb installs is a working page on its own (no node, no checkout)."""
    deb = build("deb").with_name(f"cockpit-gpuguard_{__version__}_all.deb")
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    installed = root / "usr/share/cockpit/gpuguard"
    os.chmod(tmp_path, 0o755)
    pid = holder(guard.host, 1)
    page = open_gpuguard(cockpit_ws(page_dir=installed), browser_page)
    expect(page.locator("section.gg-gpu")).to_have_count(2)
    expect(row(page, pid)).to_be_visible()
    # Its styles and fonts come from the package too: the body text is in Red Hat Text, loaded.
    loaded = page.evaluate("""async () => {
        await document.fonts.ready;
        return [...document.fonts].filter(f => f.status === 'loaded').map(f => f.family);
    }""")
    assert any("Red Hat Text" in family for family in loaded), loaded


def test_leaked_and_unknown_gpus(daemon: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                 browser_page: Callable[..., Any]) -> None:
    """A leak (memory used, no holder) and a GPU whose state NVML cannot give (a hung call):
    each card says so, the leak is in the event feed, and both recover."""
    host = daemon.host
    host.write_config(FAST_POLL + "NvmlTimeoutSec=300ms\n")
    daemon.start()
    page = open_gpuguard(cockpit_ws(), browser_page)
    card0 = page.locator("section.gg-gpu[data-index='0']")
    card1 = page.locator("section.gg-gpu[data-index='1']")
    expect(card0.locator(".gg-state")).to_have_text("idle")

    host.state.gpus[0].base_used = 5 * GiB
    host.publish()
    expect(card0.locator(".gg-state")).to_have_text("leaked")
    expect(card0.locator(".gg-state-text")).to_contain_text("no process holds it")
    expect(page.locator(".gg-event", has_text="GPU 0 keeps 5.0 GiB with no process holding it")).to_have_count(1)

    host.state.hang = [("nvmlDeviceGetMemoryInfo_v2", 4000, 1)]
    host.publish()
    expect(card1.locator(".gg-state")).to_have_text("unknown")
    expect(card1.locator(".gg-state-text")).to_contain_text("cannot read this GPU's state")
    expect(card1.locator(".gg-error-text")).to_contain_text("has not returned")
    expect(card1.locator(".gg-uuid")).to_have_text(host.state.gpus[1].uuid)
    expect(card1.locator(".gg-memory-unknown")).to_have_text("unknown")  # not "0 B of 0 B"
    screenshot(page, "leaked-and-unknown")

    host.state.hang = []
    host.state.gpus[0].base_used = 0
    host.publish()
    expect(card0.locator(".gg-state")).to_have_text("idle", timeout=15000)
    expect(card1.locator(".gg-state")).to_have_text("idle", timeout=15000)
    expect(card1.locator(".gg-error-text")).to_have_count(0)
    expect(card1).to_contain_text("0 B of 80.0 GiB")
    assert_not_reloaded(page)


def test_a_leak_shows_its_kind_and_an_admin_resets_the_gpu(
        daemon: GuardDaemon, cockpit_ws: Callable[..., CockpitWs], browser_page: Callable[..., Any]) -> None:
    """The card names the leak's kind and offers "Reset GPU…" (confirmed in a dialog); the
    reset runs through the fake nvidia-smi on the daemon's PATH and the card goes idle."""
    host = daemon.host
    host.write_config(FAST_POLL)
    daemon.extra_env["PATH"] = f"{dbus_harness.ROOT / 'tests' / 'fakenvml'}:{os.environ['PATH']}"
    daemon.start()
    page = open_gpuguard(cockpit_ws(), browser_page)
    card0 = page.locator("section.gg-gpu[data-index='0']")
    expect(card0.locator(".gg-state")).to_have_text("idle")
    expect(card0.locator(".gg-reset")).to_have_count(0)
    host.state.gpus[0].base_used = 5 * GiB
    host.publish()
    expect(card0.locator(".gg-leak-kind")).to_have_text("Leak kind: no-process")
    page.once("dialog", lambda dialog: dialog.accept())
    card0.locator(".gg-reset").click()
    expect(card0.locator(".gg-state")).to_have_text("idle", timeout=20000)
    expect(page.locator(".gg-event", has_text="GPU 0: reset")).to_have_count(1)
    expect(card0.locator(".gg-leak-kind")).to_have_count(0)
    host.state.gpus[0].base_used = 0  # what the reset left in the state file


def test_daemon_installed_but_not_running(browser_page: Callable[..., Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuguardd installed (D-Bus could start it: the bus lists the name as activatable) but not
    running, and not started by the attempt: the page says "not running" and how to start it."""
    services = tmp_path / "system-services"
    services.mkdir()
    (services / "org.gpuguard.GpuGuard1.service").write_text(
        "[D-BUS Service]\nName=org.gpuguard.GpuGuard1\nExec=/bin/false\nUser=root\n")
    os.chmod(tmp_path, 0o755)
    config = dbus_harness.BUS_CONFIG.replace("<type>system</type>",
                                             f"<type>system</type>\n  <servicedir>{services}</servicedir>")
    monkeypatch.setattr(dbus_harness, "BUS_CONFIG", config)
    require_cockpit_tools()
    bus = dbus_harness.BusDaemon()
    try:
        ws = CockpitWs(bus)
        try:
            page = open_gpuguard(ws, browser_page)
            status = page.locator(".gg-status")
            expect(status).to_have_attribute("data-daemon", "not-running")
            expect(status).to_contain_text("gpuguardd is not running")
            expect(status).to_contain_text("systemctl start gpuguardd.service")
            screenshot(page, "daemon-not-running")
        finally:
            ws.close()
    finally:
        bus.close()


def test_mig_instances_under_their_gpu_and_one_swept_alone(daemon: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
                                                          browser_page: Callable[..., Any]) -> None:
    """GPU 1 in MIG mode (tests/host/test_mig.py's host): its instances under its card with the
    daemon's MigInstances, tenants' MIG UUIDs in the table, and a sweep of instance A alone."""
    mig = setup_mig(daemon.host, "[Daemon]\nPollIntervalSec=0.25\n")
    daemon.start()
    page = open_gpuguard(cockpit_ws(), browser_page)
    card = page.locator("section.gg-gpu[data-index='1']")
    expect(card).to_contain_text("MIG mode on")
    expect(card.locator(".gg-mig-instance")).to_have_count(3)
    expect(page.locator("section.gg-gpu[data-index='0'] .gg-mig")).to_have_count(0)
    wait_until(lambda: next(i for i in daemon.get_property(f"{MANAGER_PATH}/gpu/1", GPU, "MigInstances")
                            if i["uuid"] == MIG_A)["holder_count"] == 1, 10, "instance A's tenant")
    for instance in daemon.get_property(f"{MANAGER_PATH}/gpu/1", GPU, "MigInstances"):
        shown = card.locator(".gg-mig-instance", has_text=instance["uuid"])
        expect(shown.locator(".gg-state")).to_have_text(instance["state"])
        expect(shown.locator(".gg-mig-holders")).to_contain_text(f"{instance['holder_count']} holder")
    instance_a = card.locator(".gg-mig-instance", has_text=MIG_A)
    expect(instance_a).to_contain_text("GPU instance 1, compute instance 0")
    expect(instance_a).to_contain_text("3.0 GiB of 40.0 GiB")
    expect(row(page, mig.a.pid).locator("td").nth(5)).to_contain_text(MIG_A)
    expect(row(page, mig.b.pid).locator("td").nth(5)).to_contain_text(MIG_B)

    dialog = open_sweep_dialog(page)
    page.check("#scope-gpus")
    expect(dialog.locator(f"[id='sweep-mig-{MIG_C}']")).to_be_visible()
    page.check(f"[id='sweep-mig-{MIG_A}']")
    page.fill("#sweep-grace", "1")
    page.click("#sweep-preview")
    plan = dialog.locator(".gg-report-section[data-section='targets']")
    expect(plan).to_contain_text(str(mig.a.pid))
    expect(plan).not_to_contain_text(str(mig.b.pid))
    page.click("#sweep-run")
    expect(dialog.locator(".gg-sweep-summary")).to_contain_text("Sweep finished", timeout=30000)
    report = daemon.manager("GetHistory", "u", "1")[0][0]
    assert [t["pid"] for t in report["terminated"]] == [mig.a.pid], report
    gpus = dialog.locator(".gg-report-section[data-section='gpus']")
    expect(gpus).to_contain_text(MIG_A)
    expect(dialog.locator(".gg-report")).to_contain_text(f"MIG instance {MIG_A}")
    wait_until(lambda: not mig.a.alive(), 10, "A's tenant to end")
    assert mig.b.alive(), "a sweep of instance A ended B's tenant"
    page.click("#sweep-close")
    expect(row(page, mig.a.pid)).to_have_count(0)
    expect(instance_a.locator(".gg-mig-holders")).to_contain_text("0 holders")
    screenshot(page, "mig")

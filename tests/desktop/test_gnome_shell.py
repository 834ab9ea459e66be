"""The GNOME Shell extension in the real GNOME Shell 43, against the real gpuguardd.

gpuguardd runs over the fake NVML on the tests' private system bus (tests/dbus_harness.py);
the shell runs headless as nobody with DBUS_SYSTEM_BUS_ADDRESS on that bus
(tests/desktop/shell_harness.py). The extension is the GNOME 43 layout build.py makes. What
the indicator shows is read from its actors by the test helper extension.

Checks: the extension is enabled (state 1) and the shell logs no JS ERROR; the indicator
follows a holder appearing and leaving within 2 s, gpuguardd going away (greyed) and coming
back, a leak (its icon, and a notification); the menu opened lists the GPUs. "Sweep GPU N…"
shows the dry run's plan, and the sweep asked for with interactive authorization: refused by
polkit (the tests' fake one, tests/dbus_harness.py) it says so; allowed, it ends the holder and
says how it went. Its screenshots
(the open menu; the indicator with the leak's notification) go to the test's own directory,
or with GPUGUARD_DESKTOP_SHOTS=docs to docs/desktop-menu.png and docs/desktop-indicator.png.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bus.test_reset import smi_calls
from tests.bus.test_reset import start as start_with_fake_smi
from tests.conftest import GiB
from tests.dbus_harness import (
    COMM,
    GPU,
    MANAGER_PATH,
    FakePolkit,
    GuardDaemon,
    SignalRecorder,
    leak_on,
    private_gpu,
    private_holder,
    wait_until,
)
from tests.desktop.shell_harness import ROOT, UUID, GnomeShell

pytest_plugins = ["tests.dbus_harness"]

FOLLOW_SEC = 2.0  # the bound for the indicator to follow a change
SHOTS = os.environ.get("GPUGUARD_DESKTOP_SHOTS", "")


@pytest.fixture(scope="module")
def extension_43(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("gnome-shell", "gsettings", "dbus-run-session", "convert"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required (make deps installs gnome-shell and imagemagick)")
    out = tmp_path_factory.mktemp("extension")
    subprocess.run([sys.executable, str(ROOT / "gnome-shell-extension/build.py"), str(out)],
                   check=True, capture_output=True)
    return out / "43" / UUID


@pytest.fixture
def shell(guard: GuardDaemon, system_bus: Any, extension_43: Path) -> Iterator[GnomeShell]:
    desktop = GnomeShell(system_bus.address, extension_43)
    try:
        yield desktop
    finally:
        log = desktop.log()
        desktop.close()
    assert "JS ERROR" not in log, f"the shell logged a JS error:\n{log}"
    assert "JS WARNING" not in log, f"the shell logged a JS warning:\n{log}"


def indicator(shell: GnomeShell) -> dict[str, Any]:
    shown = shell.describe()["indicator"]
    assert shown is not None, "the GPU Guard indicator is not in the panel"
    return dict(shown)


def follows(shell: GnomeShell, what: str, check: Any) -> float:
    """Seconds until the indicator satisfies `check`; fails past FOLLOW_SEC."""
    started = time.monotonic()
    try:
        wait_until(lambda: check(indicator(shell)), FOLLOW_SEC, what, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the indicator shows {indicator(shell)}") from None
    return time.monotonic() - started


def daemon_says(guard: GuardDaemon, gpu: int, state: str) -> None:
    """Wait for gpuguardd's own State of `gpu`: the indicator is timed from there (the daemon
    may take a few scan durations to see a holder leave: inventory.py, CHURN_FACTOR)."""
    wait_until(lambda: guard.property_is(f"{MANAGER_PATH}/gpu/{gpu}", GPU, "State", state), 10,
               f"gpuguardd: GPU {gpu} {state}")


def gpu_line(shown: dict[str, Any], index: int) -> str:
    lines = [item for item in shown["items"] if item.startswith(f"GPU {index}:")]
    assert lines, shown["items"]
    return str(lines[0])


def test_indicator_follows_gpuguardd(shell: GnomeShell, guard: GuardDaemon,
                                     recorder: SignalRecorder, tmp_path: Path) -> None:
    shots = ROOT / SHOTS if SHOTS else tmp_path
    assert shell.extension_state() == 1.0, shell.log()
    wait_until(lambda: indicator(shell)["icon"] == "emblem-ok-symbolic", 10, "the idle icon")
    assert indicator(shell)["opacity"] == 255

    # A holder appears on GPU 1, then leaves.
    host = guard.host
    holder = host.spawn("--hold", host.node("nvidia1"), "--comm", "gg-desktop", nvml=(1, 2 * GiB))
    daemon_says(guard, 1, "in-use")
    follows(shell, "the in-use icon", lambda s: s["icon"] == "system-run-symbolic"
            and "in use" in gpu_line(s, 1))
    shell.menu(True)
    wait_until(lambda: any("gg-desktop" in item for item in indicator(shell)["items"]), 5,
               "the holder in the menu")
    shown = indicator(shell)
    assert shown["menu_open"]
    assert gpu_line(shown, 0).startswith("GPU 0: nvidia NVIDIA H100 80GB HBM3, ")
    assert "2.0 GiB of 80.0 GiB" in gpu_line(shown, 1)
    assert "Sweep GPU 1…" in shown["items"]
    shell.screenshot(shots / "desktop-menu.png", crop="620x420+660+0")
    shell.menu(False)
    holder.stop()
    host.state.remove_proc(holder.pid)
    host.publish()
    daemon_says(guard, 1, "idle")
    follows(shell, "the idle icon again", lambda s: s["icon"] == "emblem-ok-symbolic")

    # gpuguardd goes away (greyed, the menu says so) and comes back.
    guard.stop()
    follows(shell, "the greyed indicator", lambda s: s["opacity"] < 255
            and s["icon"] == "action-unavailable-symbolic")
    assert indicator(shell)["items"] == ["gpuguardd is not running"]
    guard.start()
    follows(shell, "the indicator back", lambda s: s["opacity"] == 255
            and s["icon"] == "emblem-ok-symbolic" and len([i for i in s["items"] if i.startswith("GPU ")]) == 2)

    # A leak: the warning icon, and a notification.
    leak_on(guard, recorder, 0)
    follows(shell, "the leak icon", lambda s: s["icon"] == "dialog-warning-symbolic")
    wait_until(lambda: any(n.startswith("GPU 0: memory leaked") for n in shell.describe()["notifications"]),
               FOLLOW_SEC, "the leak notification")
    shell.screenshot(shots / "desktop-indicator.png", crop="1280x360+0+0")
    assert (shots / "desktop-indicator.png").stat().st_size > 1000


SWEEP = "org.gpuguard.GpuGuard1.sweep"
NOBODY_UID = 65534  # the shell's user (shell_harness.NOBODY)


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_sweep_shows_the_plan_then_sweeps(shell: GnomeShell, guard: GuardDaemon, system_bus: Any,
                                          tmp_path: Path, allowed: bool) -> None:
    host = guard.host
    index = private_gpu(host)
    pid = private_holder(host)
    polkit = FakePolkit(system_bus.address, tmp_path, {NOBODY_UID: [SWEEP] if allowed else []})
    try:
        daemon_says(guard, index, "in-use")
        wait_until(lambda: f"Sweep GPU {index}…" in indicator(shell)["items"], 5, "the sweep item")
        shell.helper("ActivateMenuItem", f"Sweep GPU {index}…")
        plan = wait_until(lambda: (d := shell.dialog()) and "Sweep" in d["buttons"] and d, 10,
                          "the plan and its Sweep button")
        assert plan["title"] == f"Sweep GPU {index}"
        assert plan["description"].startswith("These processes will be ended"), plan
        assert plan["plan"] == f"{COMM} (PID {pid}) · 2.0 GiB", plan
        assert os.path.exists(f"/proc/{pid}"), "the dry run ended the holder"
        if allowed and SHOTS:
            time.sleep(1)  # the dialog's first frames after its text changed
            shell.screenshot(ROOT / SHOTS / "desktop-sweep.png", crop="520x280+380+260")
        shell.helper("PressDialogButton", "Sweep")
        expected = "Done: 1 process ended, memory freed." if allowed \
            else "Not authorized: the sweep was refused."
        wait_until(lambda: (shell.dialog() or {}).get("description") == expected, 20,
                   f"the dialog saying {expected!r}")
        asked = [r for r in polkit.requests() if r["action"] == SWEEP]
        assert asked and asked[-1]["uid"] == NOBODY_UID
        assert asked[-1]["flags"] & 1, "the sweep did not allow interactive authorization"
        assert os.path.exists(f"/proc/{pid}") != allowed
        shell.helper("PressDialogButton", "Close")
        wait_until(lambda: shell.dialog() is None, 5, "the dialog closed")
        if allowed:
            # The menu's last sweep: outcome, when, who asked (the shell's user, by the bus).
            last = wait_until(lambda: [i for i in indicator(shell)["items"] if i.startswith("memory freed, ")],
                              5, "the last sweep in the menu")
            assert f"asked by uid {NOBODY_UID} (nobody)" in last[0], last
    finally:
        polkit.close()


RESET = "org.gpuguard.GpuGuard1.reset-gpu"


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_a_leaked_gpu_offers_a_reset_that_polkit_decides(
        shell: GnomeShell, guard: GuardDaemon, system_bus: Any, recorder: SignalRecorder,
        tmp_path: Path, allowed: bool) -> None:
    # gpuguardd again with the fake nvidia-smi first on PATH (tests/bus/test_reset.py): the
    # indicator follows the daemon going away and coming back.
    guard.stop()
    index, smi_log = start_with_fake_smi(guard, "LeakGraceSec=0\n")
    polkit = FakePolkit(system_bus.address, tmp_path, {NOBODY_UID: [RESET] if allowed else []})
    try:
        leak_on(guard, recorder, index, 5 * GiB)
        wait_until(lambda: f"Reset GPU {index}…" in indicator(shell)["items"], 10, "the reset item")
        assert f"Reset GPU {1 - index}…" not in indicator(shell)["items"]  # only a leaked GPU
        shell.helper("ActivateMenuItem", f"Reset GPU {index}…")
        shown = wait_until(lambda: (d := shell.dialog()) and "Reset" in d["buttons"] and d, 10,
                           "the reset dialog and its Reset button")
        assert shown["title"] == f"Reset GPU {index}"
        assert smi_calls(smi_log) == [], "nothing is reset before the user says so"
        shell.helper("PressDialogButton", "Reset")
        expected = "Done: the GPU was reset and its memory is back." if allowed \
            else "Not authorized: the reset was refused."
        wait_until(lambda: (shell.dialog() or {}).get("description") == expected, 30,
                   f"the dialog saying {expected!r}")
        asked = [r for r in polkit.requests() if r["action"] == RESET]
        assert asked and asked[-1]["uid"] == NOBODY_UID
        assert asked[-1]["flags"] & 1, "the reset did not allow interactive authorization"
        assert bool(smi_calls(smi_log)) == allowed
        shell.helper("PressDialogButton", "Close")
        wait_until(lambda: shell.dialog() is None, 5, "the dialog closed")
    finally:
        polkit.close()

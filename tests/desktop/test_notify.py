"""gpuguard-notify against a real notification server: dunst (Debian's 1.9) on a session bus
and an Xvfb display of the test's own, gpuguardd over the fake NVML on the private system bus.

A leak, and a sweep of the private GPU that ends the test's own process (whose name carries a
right-to-left override) and leaves its memory held past the verification: three
notifications, read back from dunst's history, the process name escaped by the CLI's rule.
The events' rules alone (another user's process is not "yours", dry runs say nothing) are in
tests/unit/notify/test_events.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bus.test_dbus_compat import PlainBus
from tests.conftest import GiB
from tests.dbus_harness import (
    PRIVATE_MINOR,
    PYTHON,
    GuardDaemon,
    SignalRecorder,
    leak_on,
    private_gpu,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]

# Notifications stay on screen until the test closes them into the history.
DUNSTRC = """[global]
font = Liberation Sans 10
[urgency_low]
timeout = 0
[urgency_normal]
timeout = 0
[urgency_critical]
timeout = 0
"""


class Desktop:
    """A session bus, an X display and dunst on them; close() ends all three."""

    def __init__(self) -> None:
        for tool in ("dunst", "dunstctl", "Xvfb", "dbus-daemon"):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} is required (make deps installs dunst and xvfb)")
        self.dir = Path(tempfile.mkdtemp(prefix="gg-notify-desktop-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.session = PlainBus()  # a session-type bus where everyone may do anything
        self.address = self.session.address
        read, write = os.pipe()
        # No socket in /tmp/.X11-unix: Xvfb would create that directory by name, and on a
        # machine where nothing made it at boot (no systemd-tmpfiles) it outlives the run.
        # X clients on Linux reach the server by its abstract socket, which it keeps.
        self._start(["Xvfb", "-displayfd", str(write), "-screen", "0", "800x600x24", "-nolisten",
                     "tcp", "-nolisten", "unix"], pass_fds=(write,))
        os.close(write)
        with os.fdopen(read) as display:
            self.display = ":" + display.readline().strip()
        (self.dir / "dunstrc").write_text(DUNSTRC)
        self.env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": self.address, "DISPLAY": self.display,
                    "HOME": str(self.dir)}
        self._start(["dunst", "-config", str(self.dir / "dunstrc")], env=self.env)
        wait_until(lambda: self.dunstctl("is-paused").returncode == 0, 20, "dunst on the bus")

    def _start(self, argv: list[str], env: dict[str, str] | None = None,
               pass_fds: tuple[int, ...] = ()) -> None:
        log = open(self.dir / f"{Path(argv[0]).name}.log", "wb")  # noqa: SIM115
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           pass_fds=pass_fds))
        log.close()

    def dunstctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["dunstctl", *args], env=self.env, capture_output=True, text=True,
                              timeout=30, check=False)

    def shown(self) -> int:
        result = self.dunstctl("count", "displayed")
        return int(result.stdout.strip() or 0)

    def history(self) -> list[dict[str, Any]]:
        """Every notification dunst showed (closing those still shown first)."""
        self.dunstctl("close-all")
        result = self.dunstctl("history")
        assert result.returncode == 0, result.stderr
        entries: list[dict[str, Any]] = json.loads(result.stdout)["data"][0]
        return [{key: value["data"] for key, value in entry.items()} for entry in entries]

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.session.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def desktop() -> Iterator[Desktop]:
    session = Desktop()
    try:
        yield session
    finally:
        session.close()


def test_notifications_reach_a_real_server(guard: GuardDaemon, recorder: SignalRecorder,
                                           desktop: Desktop) -> None:
    said = desktop.dir / "gpuguard-notify.log"
    with open(said, "wb") as log:
        notifier = subprocess.Popen(
            [PYTHON, "-m", "gpuguardd.notify.main", "--bus-address", guard.address,
             "--session-address", desktop.address],
            env=guard.env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        # It says so once its match rules are in place: no signal after this is missed.
        wait_until(lambda: b"listening to gpuguardd" in said.read_bytes(), 20, "gpuguard-notify")
        leak_on(guard, recorder, 0)
        wait_until(lambda: desktop.shown() >= 1, 10, "the leak's notification")

        host = guard.host
        index = private_gpu(host)
        holder = host.spawn("--hold", str(host.dev / f"nvidia{PRIVATE_MINOR}"), "--comm",
                            "gg\u202enotify", nvml=(index, 3 * GiB), release_delay_ms=120_000)
        swept = guard.ctl("sweep", "--gpu", str(index), "--grace", "1")
        assert "memory-not-released" in swept.stdout + swept.stderr, swept
        wait_until(lambda: desktop.shown() >= 3, 10, "the sweep's two notifications")
        holder.stop()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ngpuguard-notify said:\n{said.read_text()}") from None
    finally:
        notifier.send_signal(signal.SIGTERM)
        notifier.wait(timeout=10)
    errors = said.read_text()
    shown = {entry["summary"]: entry for entry in desktop.history()}
    assert "GPU 0: memory leaked" in shown, (shown, errors)
    assert shown["GPU 0: memory leaked"]["body"].startswith("5.0 GiB in use")
    assert "A GPU sweep left something behind" in shown, (shown, errors)
    mine = shown["Your GPU processes were ended"]["body"]
    # Escaped by the CLI's rule: the override is text, never applied.
    assert mine.startswith(f"gg\\u202enotify ({holder.pid}), by a sweep asked by "), mine
    assert "\u202e" not in json.dumps(shown, ensure_ascii=False)
    assert "Traceback" not in errors, errors


"""A real Cockpit for the page's tests: cockpit-ws and its bridge on 127.0.0.1, chromium.

* CockpitWs: Debian's cockpit-ws (--no-tls --local-session=cockpit-bridge, 127.0.0.1 only)
  serving cockpit/dist as the plugin `gpuguard` (from $XDG_DATA_HOME/cockpit, no install),
  with its bridge's system bus the tests' private dbus-daemon and a session bus of its own.
  As root the bridge has administrative access (Cockpit's superuser is "root"); run with
  `uid=65534` (setpriv) it is an ordinary user's session, whose superuser is "none", as when
  an admin has not turned administrative access on.
* Chromium: Debian's /usr/bin/chromium, headless, driven by Python playwright (never
  `playwright install`: these machines cannot download browsers).

Every file lives in a directory the fixture removes; every process is ended by its pid (or
its own process group) at teardown.

Loaded as a pytest plugin by the test modules (pytest_plugins) after they import it, so its
asserts are plain: PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dbus_harness import BusDaemon, wait_until
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGE_DIR = ROOT / "cockpit" / "dist"
SCREENSHOTS = ROOT / "build" / "cockpit-screenshots"
COCKPIT_WS = "/usr/lib/cockpit/cockpit-ws"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--disable-breakpad", "--disable-crash-reporter"]
NOBODY = 65534


def require_cockpit_tools() -> None:
    """A skip is a failure here (make deps and make cockpit provide all of these)."""
    missing = [path for path in (COCKPIT_WS, CHROMIUM, "/usr/bin/cockpit-bridge") if not os.path.exists(path)]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: make deps installs cockpit-ws, cockpit-bridge, chromium")
    if not (PAGE_DIR / "gpuguard.js").is_file():
        pytest.fail(f"{PAGE_DIR} is not built: run make cockpit")
    try:
        import playwright  # noqa: F401
    except ImportError:
        pytest.fail("Python playwright is missing: make venv installs the test extras")



def _demote(uid: int | None) -> list[str]:
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


class CockpitWs:
    """cockpit-ws with the page installed for its user, talking to `bus` as the system bus."""

    def __init__(self, bus: BusDaemon, uid: int | None = None, page_dir: Path = PAGE_DIR) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpuguard-cockpit-"))
        os.chmod(self.dir, 0o755)
        self.uid = uid
        home = self.dir / "home"
        runtime = self.dir / "run"
        plugins = self.dir / "data" / "cockpit"
        for path in (home, runtime, plugins):
            path.mkdir(parents=True)
        (plugins / "gpuguard").symlink_to(page_dir)
        if uid is not None:
            for path in (home, runtime):
                os.chown(path, uid, uid)
        os.chmod(runtime, 0o700)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/cockpit/@localhost/gpuguard/index.html"
        session_socket = runtime / "session.sock"
        self.env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(home),
            "XDG_DATA_HOME": str(self.dir / "data"),
            "XDG_RUNTIME_DIR": str(runtime),
            "DBUS_SYSTEM_BUS_ADDRESS": bus.address,
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path={session_socket}",
        }
        self.log = open(self.dir / "cockpit-ws.log", "w")  # noqa: SIM115
        # The bridge's session bus, as the bridge's user (otherwise the 287 bridge starts one of
        # its own that outlives it).
        self.session_bus = subprocess.Popen(
            [*_demote(uid), "setpriv", "--pdeathsig", "TERM", "dbus-daemon", "--session",
             f"--address=unix:path={session_socket}", "--nofork", "--nopidfile"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(session_socket.exists, 10, "the session bus's socket")
        # Its own process group: the bridge it spawns goes with it at teardown.
        self.proc = subprocess.Popen(
            [*_demote(uid), COCKPIT_WS, "--no-tls", "--local-session=cockpit-bridge",
             "--port", str(self.port), "--address", "127.0.0.1"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._answers, 15, "cockpit-ws to answer", interval=0.1)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"cockpit-ws exited with {self.proc.returncode}:\n{self.logs()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/cockpit/socket", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answered (a plain GET of the socket is refused)
        except OSError:
            return False

    def logs(self) -> str:
        self.log.flush()
        return (self.dir / "cockpit-ws.log").read_text(errors="replace")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # The bridge (same process group) may outlive cockpit-ws by a moment.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.session_bus.terminate()
        self.session_bus.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cockpit_ws(system_bus: BusDaemon) -> Iterator[Callable[..., CockpitWs]]:
    """Start a cockpit-ws (as root, or `uid=65534`; the page from `page_dir`, by default the
    checkout's cockpit/dist); all are stopped after the test."""
    require_cockpit_tools()
    started: list[CockpitWs] = []

    def start(uid: int | None = None, page_dir: Path = PAGE_DIR) -> CockpitWs:
        ws = CockpitWs(system_bus, uid, page_dir)
        started.append(ws)
        return ws

    yield start
    for ws in started:
        ws.close()


# Module scope, not session: playwright's sync API keeps an asyncio loop running in this thread
# for as long as it is open, and every later test that calls asyncio.run() would then fail.
@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    require_cockpit_tools()
    from playwright.sync_api import sync_playwright

    # Chromium writes ~/.config/chromium (crash reports) and ~/.cache (dconf) whatever its
    # profile directory: give it a home of its own, removed afterwards.
    home = Path(tempfile.mkdtemp(prefix="gpuguard-chromium-"))
    env: dict[str, str | float | bool] = {
        **os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache")}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=env)
            try:
                yield browser
            finally:
                browser.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def browser_page(chromium: Any, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """New pages (each in its own context, so its own Cockpit session); console errors of the
    page fail the test, and each page's last view is saved to build/cockpit-screenshots/."""
    contexts: list[Any] = []
    errors: list[str] = []

    def open_page(url: str, color_scheme: str = "light") -> Any:
        context = chromium.new_context(viewport={"width": 1400, "height": 1000}, color_scheme=color_scheme)
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        return page

    yield open_page
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for i, context in enumerate(contexts):
        for j, page in enumerate(context.pages):
            page.screenshot(path=str(SCREENSHOTS / f"{request.node.name}-{i}{j}.png"), full_page=True)
        context.close()
    assert errors == [], f"the page logged errors: {errors}"


def screenshot(page: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path

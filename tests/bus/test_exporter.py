"""gpuguard-exporter: socket-activated (systemd-socket-activate passes the socket as systemd
would), unprivileged (it runs as nobody here, as DynamicUser= there), asking gpuguardd over a
real bus on each scrape. The real Prometheus scrapes it under real systemd in tests/e2e.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.dbus_harness import NOBODY, PYTHON, GuardDaemon, wait_until
from tests.helpers import free_port
from tests.unit.daemon.test_metrics import promtool_check, samples

pytest_plugins = ["tests.dbus_harness"]



def get(url: str, accept: str = "") -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


@pytest.fixture
def exporter(guard: GuardDaemon) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    env = dict(guard.env)
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", f"127.0.0.1:{port}",
         *(f"-E{name}={env[name]}" for name in ("GPUGUARD_BUS_ADDRESS", "PYTHONPATH")),
         *NOBODY, PYTHON, "-m", "gpuguardd.exporter.main", "--idle-exit", "3s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wait_until(lambda: _connects(port), 10, "the activation socket")
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_serves_the_daemons_metrics_as_nobody(exporter: tuple[str, subprocess.Popen[str]],
                                              guard: GuardDaemon) -> None:
    url, proc = exporter
    code, content_type, body = get(url + "/metrics")
    assert code == 200, body
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    promtool_check(body)
    got = samples(body)
    assert got[("gpuguard_nvml_up", ())] == 1
    indices = {dict(k[1])["gpu"] for k in got if k[0] == "gpuguard_gpu_state"}
    assert indices == {str(g.index) for g in guard.host.state.gpus}
    # What the daemon says, not a copy of its own: a dry run shows up in the next scrape.
    guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")
    dry = ("gpuguard_dry_runs_total", ())
    assert samples(get(url + "/metrics")[2])[dry] == 1
    code, content_type, body = get(url + "/metrics", accept="application/openmetrics-text; version=1.0.0")
    assert code == 200 and content_type.startswith("application/openmetrics-text"), content_type
    assert body.endswith("# EOF\n")
    assert get(url + "/other")[0] == 404
    assert proc.poll() is None


def test_unavailable_daemon_is_a_503_and_idle_exporter_exits(
        exporter: tuple[str, subprocess.Popen[str]], guard: GuardDaemon) -> None:
    url, proc = exporter
    assert get(url + "/metrics")[0] == 200
    assert guard.stop() == 0
    code, _, body = get(url + "/metrics")
    assert code == 503 and "gpuguardd unavailable" in body, body
    # No requests for --idle-exit: it exits 0 (systemd's socket starts it on the next one).
    started = time.monotonic()
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - started >= 2
    assert proc.stdout is not None
    assert "scrape failed" in proc.stdout.read()


def test_a_silent_client_cannot_hold_it(exporter: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = exporter
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
        silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        started = time.monotonic()
        # Connections are served side by side: the silent one delays no scrape.
        code, _, _ = get(url + "/metrics")
        assert code == 200
        assert time.monotonic() - started < 5

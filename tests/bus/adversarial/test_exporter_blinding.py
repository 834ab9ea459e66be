"""Any local user blinded gpuguard-exporter. It served one connection at a
time, so five idle TCP connections, or one client sending a header byte every few seconds
(the timeout was per read), kept every scrape from being answered. Now idle and slow clients
cost a coroutine each, the whole request has a deadline, and a full house of them makes room
for a new connection: a scrape is answered within a second whatever they do."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

from gpuguardd.exporter.main import MAX_CONNECTIONS, MAX_PER_PEER, REQUEST_DEADLINE_SEC
from tests.bus.test_exporter import exporter, get  # noqa: F401 (exporter is a fixture)
from tests.dbus_harness import GuardDaemon

pytest_plugins = ["tests.dbus_harness"]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _timed_scrape(url: str) -> float:
    started = time.monotonic()
    code, _, body = get(url + "/metrics")
    assert code == 200 and "gpuguard_nvml_up 1.0" in body, (code, body[:200])
    return time.monotonic() - started


@contextlib.contextmanager
def trickling(port: int, every: float) -> Iterator[list[float]]:
    """A client sending a request a byte at a time; yields [seconds until the server closed it]."""
    closed: list[float] = []
    stop = threading.Event()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)

    def run() -> None:
        started = time.monotonic()
        try:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                if stop.wait(every):
                    return
                sock.send(bytes([byte]))
        except OSError:
            closed.append(time.monotonic() - started)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        yield closed
    finally:
        stop.set()
        worker.join(5)
        sock.close()


def test_idle_and_slow_clients_cannot_delay_a_scrape(
        exporter: tuple[str, subprocess.Popen[str]], guard: GuardDaemon) -> None:  # noqa: F811
    url, proc = exporter
    port = _port(url)
    _timed_scrape(url)  # socket activation: the exporter is running from here on
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30)
            for _ in range(MAX_CONNECTIONS + MAX_PER_PEER)]
    half = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(5)]
    for sock in half:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    try:
        with trickling(port, 0.2) as closed:
            time.sleep(0.5)
            # Scrapes keep coming (and keep the exporter from its --idle-exit) until the trickle
            # is cut at the whole-request deadline, not kept alive byte by byte.
            deadline = time.monotonic() + REQUEST_DEADLINE_SEC + 5
            scrapes = 0
            while (not closed or scrapes < 3) and time.monotonic() < deadline:
                took = _timed_scrape(url)
                scrapes += 1
                assert took < 1.0, f"a scrape took {took:.2f} s beside idle and slow clients"
                time.sleep(0.3)
            assert closed and closed[0] < REQUEST_DEADLINE_SEC + 2, closed
    finally:
        for sock in idle + half:
            sock.close()
    assert proc.poll() is None


def test_a_huge_request_head_is_refused(exporter: tuple[str, subprocess.Popen[str]]) -> None:  # noqa: F811
    url, _ = exporter
    _timed_scrape(url)
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n")
        except OSError:
            pass  # closed while we were still sending: refused too
        answer = sock.recv(100)
    assert answer == b"" or answer.split(b" ", 2)[1] == b"431", answer
    assert _timed_scrape(url) < 1.0

"""gpuguard-exporter: serves gpuguardd's Prometheus metrics on /metrics, unprivileged.

The root daemon keeps PrivateNetwork=yes; this small program runs as a DynamicUser= under
gpuguard-exporter.socket (systemd passes the listening socket, so allow-lists go on the
.socket unit), asks the daemon for GetMetrics over the system bus on each scrape, and exits
after a while without requests (the socket starts it again).

What comes over the bus is parsed and rendered again with prometheus_client rather than
relayed as bytes: a scraper only ever gets well-formed exposition, in the format it asked
for (Prometheus text or OpenMetrics). Each request is bounded in time (client socket timeout,
D-Bus call timeout) and served one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import socketserver
import sys
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpuguardd import __version__
from gpuguardd.bus.names import BUS_NAME, ENV_BUS_ADDRESS, MANAGER_INTERFACE, MANAGER_PATH
from gpuguardd.config import parse_timespan
from gpuguardd.log import setup_logging

log = logging.getLogger("gpuguard.exporter")

SD_LISTEN_FDS_START = 3
DEFAULT_LISTEN = "127.0.0.1:9835"
CALL_TIMEOUT_SEC = 10.0
CLIENT_TIMEOUT_SEC = 10.0
MAX_METRICS_BYTES = 4 * 1024 * 1024  # far above a 16-GPU node's few kB


class DaemonError(RuntimeError):
    pass


async def _get_metrics(address: str | None, timeout: float) -> str:
    bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
    await bus.connect()
    try:
        reply = await asyncio.wait_for(bus.call(Message(
            destination=BUS_NAME, path=MANAGER_PATH, interface=MANAGER_INTERFACE,
            member="GetMetrics")), timeout)
    finally:
        bus.disconnect()
    if reply is None or reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply is not None and reply.body else ""
        raise DaemonError(f"{reply.error_name if reply else 'no reply'}: {detail}")
    text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
    if len(text) > MAX_METRICS_BYTES:
        raise DaemonError(f"GetMetrics answered {len(text)} bytes, more than {MAX_METRICS_BYTES}")
    return text


def fetch(address: str | None, timeout: float = CALL_TIMEOUT_SEC) -> str:
    try:
        return asyncio.run(asyncio.wait_for(_get_metrics(address, timeout), timeout))
    except DaemonError:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        raise DaemonError(f"gpuguardd did not answer within {timeout:.0f} s") from None
    except Exception as exc:  # connection refused, auth, parse errors of the bus library
        raise DaemonError(f"{type(exc).__name__}: {exc}") from None


class _Parsed:
    """A collector that yields the families parsed from the daemon's text."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def render(text: str, accept: str | None) -> tuple[bytes, str]:
    """The daemon's exposition, validated and in the format the scraper accepts."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Parsed(list(text_string_to_metric_families(text))))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


class Handler(BaseHTTPRequestHandler):
    server_version = f"gpuguard-exporter/{__version__}"
    timeout = CLIENT_TIMEOUT_SEC  # a client that sends nothing cannot hold the exporter
    bus_address: str | None = None

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, b"gpuguard-exporter: metrics at /metrics\n", "text/plain; charset=utf-8")
            return
        if path != "/metrics":
            self._send(404, b"not found: try /metrics\n", "text/plain; charset=utf-8")
            return
        try:
            body, content_type = render(fetch(self.bus_address), self.headers.get("Accept"))
        except DaemonError as exc:
            log.warning("scrape failed: gpuguardd: %s", exc)
            self._send(503, f"gpuguardd unavailable: {exc}\n".encode(errors="replace"),
                       "text/plain; charset=utf-8")
            return
        except ValueError as exc:
            log.error("scrape failed: unreadable metrics from gpuguardd: %s", exc)
            self._send(502, b"unreadable metrics from gpuguardd\n", "text/plain; charset=utf-8")
            return
        self._send(200, body, content_type)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def listening_socket(listen: str) -> tuple[socket.socket, bool]:
    """The socket systemd passed (socket activation), else one bound to `listen`."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and int(os.environ.get("LISTEN_FDS", "0")) >= 1:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(name, None)
        return socket.socket(fileno=SD_LISTEN_FDS_START), True
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(16)
    return sock, False


class _Server(HTTPServer):
    """HTTPServer on a socket it is given; one request at a time, counted, so the idle timer
    knows a timeout from a request. It never creates a socket of its own: the unit allows
    AF_UNIX only (the listening socket comes from systemd)."""

    handled = 0

    def __init__(self, sock: socket.socket, handler: type[BaseHTTPRequestHandler]) -> None:
        address = sock.getsockname()
        socketserver.BaseServer.__init__(self, address, handler)
        self.socket = sock
        self.server_name, self.server_port = str(address[0]), int(address[1])

    def finish_request(self, request: Any, client_address: Any) -> None:
        self.handled += 1
        super().finish_request(request, client_address)


def serve(sock: socket.socket, bus_address: str | None, idle_exit: float) -> None:
    handler = type("BoundHandler", (Handler,), {"bus_address": bus_address})
    server = _Server(sock, handler)
    server.timeout = 1.0
    last, seen = time.monotonic(), 0
    try:
        while True:
            server.handle_request()
            if server.handled != seen:
                last, seen = time.monotonic(), server.handled
            if idle_exit and time.monotonic() - last >= idle_exit:
                log.info("no request for %.0f s; exiting (the socket starts it again)", idle_exit)
                return
    finally:
        server.server_close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuguard-exporter",
        description="Serve gpuguardd's Prometheus metrics over HTTP (socket-activated).")
    parser.add_argument("--version", action="version", version=f"gpuguard-exporter {__version__}")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDRESS:PORT",
                        help="where to listen when systemd passes no socket")
    parser.add_argument("--bus-address", default=None, metavar="ADDRESS",
                        help="ask gpuguardd on this D-Bus address instead of the system bus")
    parser.add_argument("--idle-exit", default="0", metavar="SEC",
                        help="exit after this long without a request (0: never)")
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("gpuguard-exporter")
    try:
        idle_exit = parse_timespan(args.idle_exit)
    except ValueError as exc:
        parser.error(f"--idle-exit: {exc}")
    address = args.bus_address or os.environ.get(ENV_BUS_ADDRESS) or None
    try:
        sock, activated = listening_socket(args.listen)
    except (OSError, ValueError) as exc:
        log.error("cannot listen on %s: %s", args.listen, exc)
        return 1
    log.info("serving /metrics on %s%s", sock.getsockname()[:2], " (socket-activated)" if activated else "")
    serve(sock, address, idle_exit)
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()

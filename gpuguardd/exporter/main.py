"""gpuguard-exporter: gpuguardd's GetMetrics on /metrics, as a DynamicUser= under its .socket
unit (allow-lists go there), so the root daemon keeps PrivateNetwork=yes. The metrics are parsed
and rendered again, never relayed as bytes: a scraper only gets well-formed exposition.
"""

from __future__ import annotations

import argparse
import asyncio
import email.parser
import email.policy
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpuguardd import __version__
from gpuguardd.bus.names import BUS_NAME, ENV_BUS_ADDRESS, MANAGER_INTERFACE, MANAGER_PATH
from gpuguardd.config import parse_timespan
from gpuguardd.log import setup_logging
from gpuguardd.numbers import parse_uint

log = logging.getLogger("gpuguard.exporter")

SD_LISTEN_FDS_START = 3
DEFAULT_LISTEN = "127.0.0.1:9835"
CALL_TIMEOUT_SEC = 10.0
MAX_METRICS_BYTES = 4 * 1024 * 1024  # far above a 16-GPU node's few kB


class DaemonError(RuntimeError):
    pass


async def _get_metrics(address: str | None) -> str:
    bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
    await bus.connect()
    try:
        reply = await bus.call(Message(destination=BUS_NAME, path=MANAGER_PATH, interface=MANAGER_INTERFACE,
                                       member="GetMetrics"))
    finally:
        bus.disconnect()
    if reply is None or reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply is not None and reply.body else ""
        raise DaemonError(f"{reply.error_name if reply else 'no reply'}: {detail}")
    text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
    if len(text) > MAX_METRICS_BYTES:
        raise DaemonError(f"GetMetrics answered {len(text)} bytes, more than {MAX_METRICS_BYTES}")
    return text


@dataclass(eq=False)
class _Parsed:
    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def render(text: str, accept: str | None) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_Parsed(list(text_string_to_metric_families(text)))), content_type


# One event loop serves every connection: an idle or trickling client costs a coroutine, not the
# scrape's thread. The whole request must come within REQUEST_DEADLINE_SEC (not per read). Past
# MAX_CONNECTIONS or MAX_PER_PEER, the oldest connection still sending its request is closed for a
# new one: idle connections make room for the scraper, never the reverse (127.0.0.1 is everyone's).
REQUEST_DEADLINE_SEC = 5.0
WRITE_DEADLINE_SEC = 10.0
MAX_REQUEST_BYTES = 8192
MAX_CONNECTIONS = 64
MAX_PER_PEER = 16
_TEXT = "text/plain; charset=utf-8"


@dataclass(eq=False)
class _Connection:
    peer: str
    writer: asyncio.StreamWriter
    pending: bool = True  # still sending its request: the one that may be closed for room


class Exporter:
    def __init__(self, bus_address: str | None) -> None:
        self.bus_address = bus_address
        self.connections: list[_Connection] = []  # oldest first
        self.last_request = time.monotonic()
        self._fetching: asyncio.Future[str] | None = None

    def _admit(self, new: _Connection) -> None:
        """Make room for `new` by closing the oldest connections still sending a request."""
        same_peer = [c for c in self.connections if c.peer == new.peer]
        for group, bound in ((same_peer, MAX_PER_PEER), (self.connections, MAX_CONNECTIONS)):
            while len([c for c in group if c in self.connections]) >= bound:
                victim = next((c for c in group if c.pending and c in self.connections), None)
                if victim is None:
                    break  # every one is being answered: each ends within its deadlines
                self._drop(victim)
        self.connections.append(new)

    def _drop(self, connection: _Connection) -> None:
        if connection in self.connections:
            self.connections.remove(connection)
        connection.writer.transport.abort()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        connection = _Connection(peer, writer)
        self._admit(connection)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_DEADLINE_SEC)
            except (asyncio.TimeoutError, TimeoutError):
                await self._reply(writer, 408, b"request not received in time\n", _TEXT)
                return
            except asyncio.LimitOverrunError:
                await self._reply(writer, 431, b"request too large\n", _TEXT)
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # closed before a whole request
            connection.pending = False
            self.last_request = time.monotonic()
            request = _parse_request(head)
            head_only = request is not None and request[0] == "HEAD"
            await self._reply(writer, *await self._answer(request), head_only)
        except (ConnectionError, asyncio.TimeoutError, TimeoutError) as exc:
            log.debug("%s: %s", peer, exc)
        finally:
            self._drop(connection)

    async def _answer(self, request: tuple[str, str, str] | None) -> tuple[int, bytes, str]:
        if request is None:
            return 400, b"bad request\n", _TEXT
        method, path, accept = request
        if method not in ("GET", "HEAD"):
            return 405, b"only GET\n", _TEXT
        if path == "/":
            return 200, b"gpuguard-exporter: metrics at /metrics\n", _TEXT
        if path != "/metrics":
            return 404, b"not found: try /metrics\n", _TEXT
        try:
            return (200, *render(await self.metrics(), accept))
        except DaemonError as exc:
            log.warning("scrape failed: gpuguardd: %s", exc)
            return 503, f"gpuguardd unavailable: {exc}\n".encode(errors="replace"), _TEXT
        except ValueError as exc:
            log.error("scrape failed: unreadable metrics from gpuguardd: %s", exc)
            return 502, b"unreadable metrics from gpuguardd\n", _TEXT

    async def metrics(self) -> str:
        """GetMetrics, one call at a time: scrapes that come while one is in flight share its
        answer, so any number of clients cost the daemon one call."""
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._fetch())
            self._fetching.add_done_callback(self._fetched)
        return await asyncio.shield(self._fetching)

    def _fetched(self, future: asyncio.Future[str]) -> None:
        self._fetching = None
        if not future.cancelled():
            future.exception()  # retrieved: each waiter gets it raised

    async def _fetch(self) -> str:
        try:
            return await asyncio.wait_for(_get_metrics(self.bus_address), CALL_TIMEOUT_SEC)
        except DaemonError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            raise DaemonError(f"gpuguardd did not answer within {CALL_TIMEOUT_SEC:.0f} s") from None
        except Exception as exc:  # connection refused, auth, parse errors of the bus library
            raise DaemonError(f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, code: int, body: bytes, content_type: str,
                     head_only: bool = False) -> None:
        head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n"
                f"Server: gpuguard-exporter/{__version__}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        writer.write(head if head_only else head + body)
        # A client that does not read cannot hold its coroutine (or its buffer) for long.
        await asyncio.wait_for(writer.drain(), WRITE_DEADLINE_SEC)


def _parse_request(head: bytes) -> tuple[str, str, str] | None:
    """(method, path, Accept) of an HTTP/1.x request head, or None when it is not one."""
    line, _, rest = head.decode("latin-1").partition("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return None
    try:
        headers = email.parser.Parser(policy=email.policy.HTTP).parsestr(rest, headersonly=True)
        accept = str(headers.get("Accept") or "")
    except (ValueError, TypeError):
        return None
    return parts[0], parts[1].split("?", 1)[0], accept


def listening_socket(listen: str) -> tuple[socket.socket, bool]:
    """The socket systemd passed (socket activation), else one bound to `listen`."""
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS", "0") != "0":
        parse_uint(os.environ.get("LISTEN_FDS", ""), "LISTEN_FDS", minimum=1)
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(name, None)
        return socket.socket(fileno=SD_LISTEN_FDS_START), True
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, parse_uint(port, "port", 65535)))
    sock.listen(128)
    return sock, False


async def _serve(sock: socket.socket, exporter: Exporter, idle_exit: float) -> None:
    async with await asyncio.start_server(exporter.handle, sock=sock, limit=MAX_REQUEST_BYTES):
        while True:
            await asyncio.sleep(min(1.0, idle_exit) if idle_exit else 1.0)
            busy = any(not c.pending for c in exporter.connections)
            if idle_exit and not busy and time.monotonic() - exporter.last_request >= idle_exit:
                log.info("no request for %.0f s; exiting (the socket starts it again)", idle_exit)
                return


def main() -> None:
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
    args = parser.parse_args()
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
        sys.exit(1)
    log.info("serving /metrics on %s%s", sock.getsockname()[:2], " (socket-activated)" if activated else "")
    asyncio.run(_serve(sock, Exporter(address), idle_exit))


if __name__ == "__main__":
    main()

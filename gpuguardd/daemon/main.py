"""gpuguardd: the system service, serving the engine on D-Bus as org.gpuguard.GpuGuard1.

The objects (GPUs included) are exported before the name is requested and READY=1 sent, so a
client that sees the name sees complete objects. SIGHUP reloads (a bad file keeps the last good
one); SIGTERM/SIGINT wait for running sweeps and exit 0. Exit 1: no bus or name; 78: bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sdnotify
from dbus_fast import BusType, DBusError, NameFlag, RequestNameReply

from gpuguardd import __version__
from gpuguardd.bus import compat
from gpuguardd.bus.connection import GuardBus, name_owner
from gpuguardd.bus.interfaces import cancel_running_calls
from gpuguardd.bus.names import BUS_NAME
from gpuguardd.config import Config, load_config
from gpuguardd.daemon.history import History
from gpuguardd.daemon.runner import SweepRunner
from gpuguardd.daemon.service import Service
from gpuguardd.engine.engine import Engine, log_device_refusals
from gpuguardd.errors import ConfigError
from gpuguardd.log import setup_logging
from gpuguardd.numbers import is_digits

log = logging.getLogger("gpuguard.daemon")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 78
# At shutdown: how often the stop timeout is extended while sweeps finish, and the time for the exit.
SHUTDOWN_STEP_SEC = 5.0
SHUTDOWN_EXIT_SEC = 10.0
# How long calls still running at the stop get to send their "stopping" answer.
SHUTDOWN_CALLS_SEC = 2.0


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not is_digits(usec) or len(usec) > 20 or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (we were started by a wrapper)
    return int(usec) / 2 / 1_000_000


class Notifier:
    def __init__(self) -> None:
        self._notifier = sdnotify.SystemdNotifier()
        sock = getattr(self._notifier, "socket", None)
        if sock is not None:
            # Never block the loop on a full systemd queue: sdnotify drops the update (EAGAIN).
            sock.setblocking(False)
        self._status = ""

    def send(self, *lines: str) -> None:
        self._notifier.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self._status = _one_line(status)
        self.send("READY=1", f"STATUS={self._status}")

    def status(self, status: str) -> None:
        text = _one_line(status)
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")

    def reloaded(self) -> None:
        self.send("READY=1", f"STATUS={self._status}")

    def extend_timeout(self, seconds: float) -> None:  # systemd 236+
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


def _one_line(text: str) -> str:
    # sdnotify encodes as Latin-1 and a newline would start a new assignment.
    return "".join(c if c.isprintable() and ord(c) < 256 else "?" for c in text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuguardd", description="gpuguard's D-Bus system service (org.gpuguard.GpuGuard1).")
    parser.add_argument("--version", action="version", version=f"gpuguardd {__version__}")
    parser.add_argument("--config", action="append", metavar="FILE", default=None,
                        help="read FILE instead of /etc/gpuguard/gpuguard.conf{,.d/} (repeatable)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--bus-address", metavar="ADDRESS",
                       help="connect to this D-Bus address instead of the system bus")
    where.add_argument("--session", action="store_true", help="use the session bus (development)")
    parser.add_argument("--debug", action="store_true", help="log debug messages")
    return parser


class Daemon:
    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.args = args
        self.engine = Engine(config)
        self.notifier = Notifier()
        self.history = History(config.state_directory, config.history_max)
        self.scan_executor = ThreadPoolExecutor(2, thread_name_prefix="gpuguard-scan")
        self.sweep_executor = ThreadPoolExecutor(16, thread_name_prefix="gpuguard-sweep")
        self.io_executor = ThreadPoolExecutor(2, thread_name_prefix="gpuguard-io")
        # Created in run(): asyncio primitives bind to the running loop on Python 3.9.
        self._reload_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.service: Service | None = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        await loop.run_in_executor(self.io_executor, self.history.load)
        where = self.args.bus_address or ("the session bus" if self.args.session else "the system bus")
        if warning := compat.version_warning():
            log.warning("%s", warning)
        try:
            # dbus-fast before 5.0 connects the socket in the constructor, later ones in connect().
            bus = GuardBus(bus_address=self.args.bus_address) if self.args.bus_address else \
                GuardBus(bus_type=BusType.SESSION if self.args.session else BusType.SYSTEM)
            await bus.connect()
        except Exception as exc:  # OSError, AuthError, InvalidAddressError...
            log.error("cannot connect to %s: %s", where, exc)
            return EXIT_FAILURE
        self.service = service = Service(bus, self.engine, self.history, self.scan_executor,
                                         self.sweep_executor, self.io_executor, self.reload)
        await service.start()
        if not await self._own_name(bus):
            bus.disconnect()
            return EXIT_FAILURE
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._sighup)
        service.on_change = lambda: self.notifier.status(service.status_line())
        self.notifier.ready(service.status_line())
        log.info("gpuguardd %s ready on %s: %s", __version__, where, service.status_line())
        self._spawn(service.inventory.run(service.poll_interval))
        self._spawn(service.units.finish_unfinished(service.resume_work))
        if interval := watchdog_interval():
            self._spawn(self._watchdog(interval))
        disconnected = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([disconnected, stopping], return_when=asyncio.FIRST_COMPLETED)
        if disconnected.done():
            stopping.cancel()
            why = disconnected.exception()
            log.error("lost the connection to %s%s; exiting", where, f" ({why})" if why else "")
            self._cancel_tasks()
            if service.runner.busy:
                # Exit now: no one hears their end, and joining their threads would delay systemd's
                # restart by a grace period. The next gpuguardd finishes them (units.py).
                log.warning("%d sweep(s) still running: left to the next gpuguardd, which finishes them",
                            service.runner.active)
                await loop.run_in_executor(self.io_executor, self.history.flush)
                logging.shutdown()
                os._exit(EXIT_FAILURE)
            return EXIT_FAILURE
        await self._shutdown(bus, service, disconnected)
        return EXIT_OK

    async def _own_name(self, bus: GuardBus) -> bool:
        try:
            reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        except DBusError as exc:
            log.error("not allowed to own %s on this bus: %s (run as root, with dbus/%s.conf installed "
                      "in /usr/share/dbus-1/system.d)", BUS_NAME, exc.text, BUS_NAME)
            return False
        if reply in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            return True
        log.error("%s is already owned by %s: another gpuguardd is running; exiting", BUS_NAME,
                  await name_owner(bus, BUS_NAME) or "another connection")
        return False

    async def _watchdog(self, interval: float) -> None:
        # Pinged from the event loop, so a blocked loop stops the pings and systemd notices.
        while True:
            self.notifier.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _sighup(self) -> None:
        log.info("SIGHUP: reloading the configuration")
        self._spawn(self._reload_quietly())

    async def _reload_quietly(self) -> None:
        with contextlib.suppress(ConfigError):  # logged; the last good configuration stays
            await self.reload()

    async def reload(self) -> None:
        assert self._reload_lock is not None and self.service is not None
        async with self._reload_lock:
            loop = asyncio.get_running_loop()
            # MONOTONIC_USEC lets Type=notify-reload (systemd 253+) match this to its SIGHUP.
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
            try:
                config = await loop.run_in_executor(self.io_executor, load_config, self.args.config)
            except ConfigError as exc:
                log.error("configuration not reloaded: %s; keeping the last good configuration", exc)
                raise
            finally:
                self.notifier.reloaded()
            old = self.engine.config
            if config.state_directory != old.state_directory:
                log.warning("StateDirectory changed to %s: the history stays in %s until restart",
                            config.state_directory, old.state_directory)
            self.engine.config = config
            log_device_refusals(config)
            self.service.config_changed()
            log.info("configuration reloaded from %s", ", ".join(config.sources) or "built-in defaults")

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def _finish_sweeps(self, runner: SweepRunner) -> None:
        """Let running sweeps finish as long as their settings allow, keeping systemd's stop timeout
        ahead; record whatever is still running then."""
        if not runner.busy:
            return
        budget = runner.budget_sec()
        log.info("waiting for %d running sweep(s) to finish (their settings allow %.0f s)", runner.active, budget)
        deadline = time.monotonic() + budget
        while runner.busy:
            left = deadline - time.monotonic()
            if left > 0:
                self.notifier.extend_timeout(min(left, SHUTDOWN_STEP_SEC) + SHUTDOWN_EXIT_SEC)
                self.notifier.send("WATCHDOG=1")
            if await runner.wait_idle(max(0.0, min(left, SHUTDOWN_STEP_SEC))):
                return
            if left <= 0:
                break
        if not runner.busy:
            return
        log.warning("sweeps still running after %.0f s, longer than their settings allow", budget)
        self.notifier.extend_timeout(SHUTDOWN_EXIT_SEC)
        await runner.record_interrupted()

    async def _shutdown(self, bus: GuardBus, service: Service, disconnected: asyncio.Future[None]) -> None:
        log.info("stopping")
        self.notifier.send("STOPPING=1", "STATUS=stopping")
        self._cancel_tasks()
        await self._finish_sweeps(service.runner)
        # A report a full disk kept in memory gets a last chance (history.py retries it).
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(self.io_executor, self.history.flush):
            log.error("the sweep history could not be written: reports kept in memory only are lost at this stop")
        try:
            await asyncio.wait_for(bus.release_name(BUS_NAME), 5)
        except (DBusError, asyncio.TimeoutError, OSError, EOFError) as exc:
            log.debug("releasing %s: %s", BUS_NAME, exc)
        # After the name is gone (no new calls come to it), before the connection is.
        await cancel_running_calls(SHUTDOWN_CALLS_SEC)
        bus.disconnect()
        try:
            await asyncio.wait_for(disconnected, 5)
        except Exception as exc:
            log.debug("disconnecting: %s", exc)
        for executor in (self.scan_executor, self.io_executor, self.sweep_executor):
            executor.shutdown(wait=False)
        self.engine.nvml.shutdown()


def _route_library_logs() -> None:
    # dbus-fast (old ones: the root logger) and asyncio get our handler, for priorities.
    ours = logging.getLogger("gpuguard")
    for name in ("dbus_fast", "asyncio", None):
        theirs = logging.getLogger(name)
        theirs.handlers[:] = list(ours.handlers)
        theirs.setLevel(logging.WARNING)
        theirs.propagate = False


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("gpuguardd", level=logging.DEBUG if args.debug else logging.INFO, sd_daemon=True)
    _route_library_logs()
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        log.error("unusable configuration: %s", exc)
        return EXIT_CONFIG
    log_device_refusals(config)
    return asyncio.run(Daemon(args, config).run())


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()

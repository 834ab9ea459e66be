"""gpuguard-notify's entry point: gpuguardd's signals in (through DBusBackend.watch, which
follows gpuguardd's restarts), org.freedesktop.Notifications out. A notification server that
is missing or refuses a notice costs that notice, logged, not the service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd import __version__
from gpuguardd.cli.client import DBusBackend
from gpuguardd.cli.output import gpu_title
from gpuguardd.errors import DaemonUnavailable
from gpuguardd.notify.events import Events, Notice

log = logging.getLogger("gpuguard.notify")

RETRY_SEC = 10.0
APP_NAME = "GPU Guard"
ICON = "dialog-warning-symbolic"
_SERVER = "org.freedesktop.Notifications"
_SERVER_PATH = "/org/freedesktop/Notifications"


class Notifier:
    def __init__(self, address: str | None) -> None:
        self.address = address or os.environ.get("DBUS_SESSION_BUS_ADDRESS", "")
        self._bus: MessageBus | None = None
        self._markup = False
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, notice: Notice) -> None:
        """From a bus callback on the running loop: send without blocking the listener."""
        task = asyncio.get_running_loop().create_task(self._send(notice))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, notice: Notice) -> None:
        try:
            if self._bus is None or not self._bus.connected:
                if not self.address:
                    raise ConnectionError("no session bus: DBUS_SESSION_BUS_ADDRESS is not set")
                self._bus = await MessageBus(bus_address=self.address).connect()
                reply = await self._bus.call(Message(destination=_SERVER, path=_SERVER_PATH,
                                                     interface=_SERVER, member="GetCapabilities"))
                self._markup = bool(reply and reply.message_type == MessageType.METHOD_RETURN
                                    and "body-markup" in reply.body[0])
            summary, body = notice.for_server(self._markup)
            reply = await self._bus.call(Message(
                destination=_SERVER, path=_SERVER_PATH, interface=_SERVER, member="Notify",
                signature="susssasa{sv}i",
                body=[APP_NAME, 0, ICON, summary, body, [], {"urgency": Variant("y", notice.urgency)}, -1]))
        except (OSError, EOFError, ValueError) as exc:
            log.warning("notification %r not sent: %s", notice.summary, exc)
            self._bus = None
            return
        if reply is not None and reply.message_type == MessageType.ERROR:  # None only without a reply asked for
            log.warning("notification %r refused: %s %s", notice.summary, reply.error_name, reply.body)


def listen(bus_address: str | None, notifier: Notifier, events: Events) -> None:
    """Until the connection to the system bus ends (DaemonUnavailable)."""
    def on_signal(member: str, fields: dict[str, Any]) -> None:
        try:
            notices = events.signal(member, fields)
        except (KeyError, TypeError, ValueError) as exc:
            # A signal of this contract's signature but odd content: skip it, keep listening.
            log.warning("%s not understood: %s", member, exc)
            return
        for notice in notices:
            log.info("%s: %s", notice.summary, notice.body)
            notifier.send(notice)

    def on_owner(owner: str) -> None:
        log.info("gpuguardd %s", "is back" if owner else "stopped; waiting for it to return")
        if owner:  # its GPUs may have changed meanwhile
            threading.Thread(target=read_titles, name="gpu-titles", daemon=True).start()

    def read_titles() -> None:
        # On a connection of its own beside the subscription; without them a GPU is named by its index.
        try:
            gpus = DBusBackend(bus_address, interactive=False).gpus()
        except Exception as exc:  # names are a nicety
            log.info("GPU names not read: %s", exc)
            return
        events.titles = {gpu.index: gpu_title(gpu) for gpu in gpus}

    def on_ready() -> None:
        log.info("listening to gpuguardd on %s", bus_address or "the system bus")
        threading.Thread(target=read_titles, name="gpu-titles", daemon=True).start()

    DBusBackend(bus_address, interactive=False).watch(on_signal, on_owner, on_ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuguard-notify", description=(
        "Desktop notifications of gpuguardd's events: a leak, a sweep that left something "
        "behind, your processes ended by a sweep."))
    parser.add_argument("--bus-address", help="gpuguardd's bus (default: the system bus, or "
                        "$GPUGUARD_BUS_ADDRESS)")
    parser.add_argument("--session-address", help="the notification server's bus (default: "
                        "$DBUS_SESSION_BUS_ADDRESS)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    notifier = Notifier(args.session_address)
    events = Events(os.getuid())
    while True:
        try:
            listen(args.bus_address, notifier, events)
        except DaemonUnavailable as exc:
            log.info("%s; trying again in %.0f s", exc, RETRY_SEC)
        except KeyboardInterrupt:
            return 0
        time.sleep(RETRY_SEC)


if __name__ == "__main__":
    sys.exit(main())

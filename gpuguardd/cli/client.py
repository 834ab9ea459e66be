"""gpuguardctl's blocking calls to the daemon over D-Bus, returning what LocalBackend returns.
Each opens its own connection in asyncio.run: no threads, no shared state, for one or two calls.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Container, Mapping
from typing import Any, TypeVar

from dbus_fast import BusType, Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd.bus import contract, marshal
from gpuguardd.bus.compat import CompatBus
from gpuguardd.bus.connection import bus_daemon_call, name_owner, name_owner_change
from gpuguardd.bus.names import (
    BUS_NAME,
    ERROR_PREFIX,
    GPU_INTERFACE,
    MANAGER_INTERFACE,
    MANAGER_PATH,
    PROPERTIES_INTERFACE,
    default_address,
)
from gpuguardd.errors import DaemonUnavailable, GpuGuardError, InvalidArgument, NotAuthorized, NvmlError
from gpuguardd.records.models import GpuSummary, Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.records.selectors import INDEX, MIG_UUID, PCI, KnownGpu, one_gpu, selector

CALL_TIMEOUT_SEC = 120.0
_UNAVAILABLE = {"org.freedesktop.DBus.Error." + name for name in (
    "ServiceUnknown", "NameHasNoOwner", "NoReply", "Disconnected", "Spawn.ChildExited",
    "Spawn.ExecFailed", "Spawn.ServiceNotFound", "TimedOut")}
_ERRORS: dict[str, type[GpuGuardError]] = {
    ERROR_PREFIX + "NotAuthorized": NotAuthorized,
    ERROR_PREFIX + "InvalidArgument": InvalidArgument,
    ERROR_PREFIX + "NvmlError": NvmlError,
    "org.freedesktop.DBus.Error.AccessDenied": NotAuthorized,
    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired": NotAuthorized,
}

T = TypeVar("T")


def error_from_reply(reply: Message) -> Exception:
    name = reply.error_name or ""
    text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else name
    if name in _UNAVAILABLE:
        return DaemonUnavailable(text)
    if name in _ERRORS:
        return _ERRORS[name](text)
    return GpuGuardError(f"{text} ({name})" if text != name else name)


def _plain(props: Mapping[str, Any], known: Container[str] | None = None) -> dict[str, Any]:
    """Properties (those `known`) as LocalBackend's dicts spell them: snake_case, plain values."""
    return {marshal.snake_case(k): marshal.unwrap(v) for k, v in props.items() if known is None or k in known}


class DBusBackend:
    """Raises DaemonUnavailable at construction if nobody answers."""

    def __init__(self, bus_address: str | None = None, interactive: bool | None = None) -> None:
        self.address = default_address(bus_address)
        self.where = self.address or "the system bus"
        # Let polkit ask for a password only when someone is at a terminal to type it.
        self.interactive = sys.stdin.isatty() if interactive is None else interactive
        self._run(self._probe)

    def _run(self, fn: Callable[[MessageBus], Awaitable[T]]) -> T:
        async def session() -> T:
            try:
                bus = await (CompatBus(bus_address=self.address) if self.address
                             else CompatBus(bus_type=BusType.SYSTEM)).connect()
            except Exception as exc:
                raise DaemonUnavailable(f"cannot connect to {self.where}: {exc}") from None
            try:
                return await fn(bus)
            except (EOFError, ConnectionError) as exc:
                raise DaemonUnavailable(f"lost the connection to {self.where}: {exc}") from None
            finally:
                bus.disconnect()
        return asyncio.run(session())

    async def _call(self, bus: MessageBus, path: str, interface: str, member: str, signature: str = "",
                    body: list[Any] | None = None, interactive: bool = False,
                    timeout: float | None = CALL_TIMEOUT_SEC) -> list[Any]:
        flags = MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if interactive and self.interactive else MessageFlag.NONE
        msg = Message(destination=BUS_NAME, path=path, interface=interface, member=member,
                      signature=signature, body=body or [], flags=flags)
        try:
            reply = await asyncio.wait_for(bus.call(msg), timeout)
        except asyncio.TimeoutError:
            raise GpuGuardError(f"gpuguardd did not answer {member} within {timeout:.0f} s") from None
        if reply.message_type == MessageType.ERROR:
            raise error_from_reply(reply)
        return list(reply.body)

    async def _manager(self, bus: MessageBus, member: str, *args: Any, interactive: bool, timeout: float | None) -> Any:
        """A Manager method's one result, as plain values; its arguments typed by the contract."""
        signature = contract.interface(MANAGER_INTERFACE).methods[member].in_signature
        (result,) = await self._call(bus, MANAGER_PATH, MANAGER_INTERFACE, member, signature, list(args),
                                     interactive=interactive, timeout=timeout)
        return marshal.unwrap(result)

    def _ask(self, member: str, *args: Any, options: tuple[str, Mapping[str, Any]] | None = None,
             interactive: bool = False, timeout: float | None = CALL_TIMEOUT_SEC) -> Any:
        """_manager on a connection of its own; `options` (dictionary, values) typed, last."""
        async def call(bus: MessageBus) -> Any:
            typed = [await self._options(bus, *options)] if options else []
            return await self._manager(bus, member, *args, *typed, interactive=interactive, timeout=timeout)
        return self._run(call)

    async def _probe(self, bus: MessageBus) -> None:
        for member, signature, body in (("NameHasOwner", "s", [BUS_NAME]), ("ListActivatableNames", "", [])):
            reply = await bus_daemon_call(bus, member, signature, body)
            if reply.message_type == MessageType.ERROR:
                raise DaemonUnavailable(f"{self.where}: {reply.error_name}")
            value = reply.body[0]
            if (value is True) or (isinstance(value, list) and BUS_NAME in value):
                return
        raise DaemonUnavailable(f"{BUS_NAME} is not running on {self.where}")

    def status(self) -> dict[str, Any]:
        async def get(bus: MessageBus) -> dict[str, Any]:
            (props,) = await self._call(bus, MANAGER_PATH, PROPERTIES_INTERFACE, "GetAll", "s", [MANAGER_INTERFACE])
            return {**_plain(props), "mode": "daemon"}
        return self._run(get)

    async def _gpus(self, bus: MessageBus) -> list[GpuSummary]:
        (objects,) = await self._call(bus, MANAGER_PATH, "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        known = contract.interface(GPU_INTERFACE).properties
        gpus = [GpuSummary.from_dict(_plain(interfaces[GPU_INTERFACE], known))
                for interfaces in objects.values() if GPU_INTERFACE in interfaces]
        return sorted(gpus, key=lambda g: g.index)

    def gpus(self) -> list[GpuSummary]:
        return self._run(self._gpus)

    async def _indices(self, bus: MessageBus, wanted: list[str]) -> list[int]:
        """NVML indices for what the user typed; the daemon checks the indices' range."""
        indices: list[int] = []
        known: list[KnownGpu] | None = None
        for item in wanted:
            chosen = selector(item).check()
            if chosen.kind == INDEX:
                indices.append(chosen.index)
                continue
            if known is None:
                known = [KnownGpu(g.index, g.uuid, (), g.pci_bus_id) for g in await self._gpus(bus)]
            found = [match.index for match in chosen.find(known) if not match.mig]
            if not found:
                raise InvalidArgument(f"unknown {'PCI bus id' if chosen.kind == PCI else 'GPU UUID'} {chosen.text!r}")
            indices.extend(found)
        return sorted(set(indices))

    async def _options(self, bus: MessageBus, dictionary: str, values: Mapping[str, Any]) -> dict[str, Variant]:
        """`values` as the contract types `dictionary`'s options. `gpus` go as indices (au), but a
        MIG instance has no index: then they go as typed (as) and the daemon resolves them."""
        options = {key: marshal.option(dictionary, key, value) for key, value in values.items() if key != "gpus"}
        wanted = values.get("gpus")
        if wanted and any(selector(item).kind == MIG_UUID for item in wanted):
            options["gpus"] = marshal.option(dictionary, "gpus", [str(item).strip() for item in wanted], "as")
        elif wanted:
            options["gpus"] = marshal.option(dictionary, "gpus", await self._indices(bus, wanted), "au")
        return options

    def holders(self, gpus: list[str], unit: str, container: str, include_protected: bool) -> list[Holder]:
        asked = SweepRequest(gpus=gpus, unit=unit, container=container).options()
        found = self._ask("ListHolders", interactive=True, options=(marshal.FILTER, {
            **asked, "include_protected": include_protected, "fresh": True}))
        return [Holder.from_dict(h) for h in found]

    def sweep(self, request: SweepRequest) -> Report:
        values = request.options()
        unit = values.pop("unit", "")
        # A sweep waits for grace periods, NVML and other sweeps of its GPUs: no timeout.
        member, args = ("SweepUnit", [unit]) if unit else ("Sweep", [])
        return Report.from_dict(self._ask(member, *args, options=(marshal.SWEEP, values),
                                          interactive=True, timeout=None))

    def wait(self, gpus: list[str], options: dict[str, Any]) -> dict[str, Any]:
        """One Manager.Wait call (at most its timeout_ms, which the daemon caps at 20 s)."""
        return dict(self._ask("Wait", options=("WaitOptions", {**options, "gpus": gpus})))

    def reset(self, gpu: str, reason: str) -> Report:
        async def call(bus: MessageBus) -> Report:
            options = {"reason": marshal.option("ResetOptions", "reason", reason)} if reason else {}
            index = one_gpu(await self._indices(bus, [gpu]), gpu)
            # A reset waits for the command and the verification (ResetTimeoutSec and more).
            report = await self._manager(bus, "ResetGpu", index, options, interactive=True, timeout=None)
            return Report.from_dict(report)
        return self._run(call)

    def history(self, count: int) -> list[Report]:
        # Records of any shape: a history may hold what an older version wrote (codec.py).
        return [Report.from_dict(r) for r in self._ask("GetHistory", count)]

    def watch(self, on_signal: Callable[[str, dict[str, Any]], None], on_owner: Callable[[str], None],
              on_ready: Callable[[], None] | None = None) -> None:
        """on_signal(member, {argument: plain value}) for each Manager signal the contract defines (not
        a later version's), until interrupted; on_ready() once subscribed, so none is missed after."""
        async def listen(bus: MessageBus) -> None:
            rule = f"type='signal',sender='{BUS_NAME}',path='{MANAGER_PATH}',interface='{MANAGER_INTERFACE}'"
            owner_rule = f"type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged',arg0='{BUS_NAME}'"

            # gpuguardd's unique name: only its signals are shown. Anyone may send a signal
            # named SweepFinished straight to this connection; the bus sets the sender.
            owner = [""]

            def handler(msg: Message) -> None:
                if msg.message_type != MessageType.SIGNAL:
                    return
                new_owner = name_owner_change(msg, BUS_NAME)
                if new_owner is not None:
                    owner[0] = new_owner
                    on_owner(new_owner)
                elif msg.interface == MANAGER_INTERFACE and msg.path == MANAGER_PATH \
                        and owner[0] and msg.sender == owner[0] \
                        and (defined := signals.get(msg.member or "")) is not None \
                        and msg.signature == defined.signature:
                    on_signal(msg.member or "", {a.name: marshal.unwrap(v) for a, v in zip(defined.args, msg.body)})

            signals = contract.interface(MANAGER_INTERFACE).signals
            bus.add_message_handler(handler)
            for match in (owner_rule, rule):
                reply = await bus_daemon_call(bus, "AddMatch", "s", [match])
                if reply.message_type == MessageType.ERROR:
                    raise error_from_reply(reply)
            # After the owner match is in place: a change from here on reaches the handler.
            found = await name_owner(bus, BUS_NAME)
            if found and not owner[0]:
                owner[0] = found
            if on_ready is not None:
                on_ready()
            await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
            raise DaemonUnavailable(f"the connection to {self.where} was closed")
        self._run(listen)

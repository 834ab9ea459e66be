"""The Manager and Gpu interfaces, whose dbus-fast members are built from the contract XML.

A subclass of ContractInterface must match the XML (parameters by name, a trailing "_" allowed).
Before a method's body runs, its arguments are checked and its Authorization rule applied (none:
refused to everyone). Properties are served from one table; what calls mean is ManagerBackend's.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import xml.etree.ElementTree as ET
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

from dbus_fast import DBusError, PropertyAccess
from dbus_fast import introspection as intr
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from gpuguardd.bus import contract as xml
from gpuguardd.bus import marshal, replysize
from gpuguardd.bus.auth import DENIAL_LOG_INTERVAL_SEC, Caller, RateLimit, held_back
from gpuguardd.bus.marshal import VarDict
from gpuguardd.bus.names import ERROR_PREFIX, GPU_INTERFACE, MANAGER_INTERFACE
from gpuguardd.errors import GpuGuardError, InvalidArgument, NotAuthorized

log = logging.getLogger("gpuguard.service")

Options = dict[str, Any]

_F = TypeVar("_F", bound=Callable[..., Any])
_REFUSALS = RateLimit(DENIAL_LOG_INTERVAL_SEC)
# The caller of the call being handled, once asked for (each call runs in its own task).
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("gpuguard_caller", default=None)


class Gate(Protocol):
    """Who is calling, a check raising NotAuthorized unless polkit grants an action, [Sweep] DryRun=."""

    async def caller(self) -> Caller: ...

    async def require(self, caller: Caller, action: str) -> None: ...

    def dry_run_default(self) -> bool: ...


def checked_by(check: Callable[..., tuple[Any, ...]]) -> Callable[[_F], _F]:
    """Run `check` on a method's arguments before authorization (malformed arguments are
    InvalidArgument for everyone, as bad options are), and call the method with what it returns."""
    def apply(fn: _F) -> _F:
        fn.__contract_check__ = check  # type: ignore[attr-defined]
        return fn
    return apply


def _dbus_signature(args: tuple[xml.Arg, ...], returns: str) -> inspect.Signature:
    """What dbus-fast reads a member's types from: signature strings as annotations."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind)]
    params += [inspect.Parameter(a.name, kind, annotation=a.signature) for a in args]
    return inspect.Signature(params, return_annotation=returns)


class _ServedInterface(intr.Interface):
    """Introspection whose XML is the contract file's element, annotations and all."""

    def __init__(self, definition: xml.Contract, name: str) -> None:
        parsed = intr.Interface.from_xml(definition.introspection(name))
        super().__init__(name, parsed.methods, parsed.signals, parsed.properties)
        self._definition = definition

    def to_xml(self) -> ET.Element:
        return self._definition.introspection(self.name)


# The method calls being answered now, for the daemon to end as it stops (cancel_running_calls).
_IN_FLIGHT: set[asyncio.Task[Any]] = set()


async def cancel_running_calls(timeout: float) -> None:
    """Answer the calls still running while the bus is there: asyncio.run's exit would cancel them
    with nothing to answer on, and a traceback in the journal."""
    running = [task for task in _IN_FLIGHT if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=timeout)


class ContractInterface(ServiceInterface):
    """`class X(ContractInterface, interface="org...")`: the members of one interface of the XML
    (`definition`: another document than the installed one)."""

    DEFINITION: ClassVar[xml.Contract]
    INTERFACE: ClassVar[xml.Interface]

    def __init_subclass__(cls, interface: str = "", definition: xml.Contract | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not interface:
            return
        cls.DEFINITION = definition or xml.contract()
        cls.INTERFACE = iface = cls.DEFINITION.interfaces[interface]
        where = f"{cls.__name__} ({interface})"
        members = {**iface.methods, **iface.signals, **iface.properties}
        for name, value in vars(cls).items():
            if name[:1].isupper() and callable(value) and name not in members:
                raise TypeError(f"{where}: {name} is not a member of the XML")
        for name, member in iface.methods.items():
            setattr(cls, name, method(name)(cls._method_handler(member, where)))
        for name, sig in iface.signals.items():
            setattr(cls, name, signal(name)(cls._signal_emitter(sig, where)))
        for name, prop in iface.properties.items():
            if name in vars(cls):
                raise TypeError(f"{where}: property {name} is served from the table, not a getter")
            setattr(cls, name, dbus_property(access=PropertyAccess(prop.access), name=name)(_property_getter(prop)))

    @classmethod
    def _python_member(cls, name: str, args: tuple[xml.Arg, ...], where: str) -> Callable[..., Any]:
        fn = vars(cls).get(name)
        if not callable(fn):
            raise TypeError(f"{where}: {name} is in the XML but not implemented")
        wanted = [a.name for a in args]
        names = [p.rstrip("_") for p in list(inspect.signature(fn).parameters)[1:]]
        if names != wanted:
            raise TypeError(f"{where}: {name} takes ({', '.join(names)}), the XML ({', '.join(wanted)})")
        return fn  # type: ignore[no-any-return]

    @classmethod
    def _method_handler(cls, member: xml.Method, where: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        fn = cls._python_member(member.name, member.in_args, where)
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{where}: method {member.name} must be a coroutine")
        check: Callable[..., tuple[Any, ...]] | None = getattr(fn, "__contract_check__", None)
        dry_run_arg = -1
        if member.rule is not None and member.rule.dry_run_public:
            found = [i for i, a in enumerate(member.in_args)
                     if "dry_run" in cls.DEFINITION.dictionaries.get(a.keys, {})]
            if len(found) != 1:
                raise TypeError(f"{where}: {member.name} has dry runs public but no dry_run option")
            dry_run_arg = found[0]

        async def handler(self: ContractInterface, *args: Any) -> Any:
            token = _CALLER.set(None)
            task = asyncio.current_task()
            if task is not None:
                _IN_FLIGHT.add(task)
            try:
                if member.rule is None:
                    raise NotAuthorized(f"{member.name} declares no authorization: refused to everyone")
                values = _arguments(member, args)
                if check is not None:
                    values = list(check(*values))
                await self._authorize(member.rule, values[dry_run_arg] if dry_run_arg >= 0 else None)
                return await fn(self, *values)
            except DBusError:
                raise
            except asyncio.CancelledError:
                # cancel_running_calls: the caller gets an answer while the bus is still there.
                log.info("%s not answered: gpuguardd is stopping", member.name)
                raise DBusError(ERROR_PREFIX + "Failed", "gpuguardd is stopping; call again when it is back") from None
            except GpuGuardError as exc:
                if isinstance(exc, NotAuthorized):
                    admission = _REFUSALS.admit((member.name, exc.uid))
                    if admission.allowed:  # once per method and uid: any user may ask again and again
                        log.info("%s refused: %s%s", member.name, exc, held_back(admission.held_back))
                raise DBusError(ERROR_PREFIX + exc.dbus_name, str(exc)) from None
            except Exception as exc:
                log.exception("internal error in %s", member.name)
                raise DBusError(ERROR_PREFIX + "Failed", f"internal error: {type(exc).__name__}") from None
            finally:
                _CALLER.reset(token)
                _IN_FLIGHT.discard(task)

        handler.__name__ = handler.__qualname__ = member.name
        returns = "".join(a.signature for a in member.out_args)
        handler.__signature__ = _dbus_signature(member.in_args, returns)  # type: ignore[attr-defined]
        return handler

    @classmethod
    def _signal_emitter(cls, sig: xml.Signal, where: str) -> Callable[..., Any]:
        cls._python_member(sig.name, sig.args, where)
        count = len(sig.args)

        def emit(self: ContractInterface, *args: Any) -> Any:
            if len(args) != count:
                raise TypeError(f"{sig.name} takes {count} arguments, got {len(args)}")
            # dbus-fast's shape for a signal body: nothing, the one value, or a list.
            return None if count == 0 else args[0] if count == 1 else list(args)

        emit.__name__ = emit.__qualname__ = sig.name
        emit.__signature__ = _dbus_signature(sig.args, sig.signature)  # type: ignore[attr-defined]
        return emit

    def __init__(self, values: Mapping[str, Any]) -> None:
        missing = set(self.INTERFACE.properties) - set(values)
        if missing:
            raise ValueError(f"{self.INTERFACE.name}: no value for {', '.join(sorted(missing))}")
        super().__init__(self.INTERFACE.name)
        self._values: dict[str, Any] = dict(values)

    def update(self, **values: Any) -> None:
        changed = {k: v for k, v in values.items() if self._values.get(k) != v}
        if changed:
            self._values.update(changed)
            self.emit_properties_changed(changed)

    def introspect(self) -> intr.Interface:
        return _ServedInterface(self.DEFINITION, self.INTERFACE.name)

    def gate(self) -> Gate:
        raise NotAuthorized(f"{self.INTERFACE.name} has no way to authorize callers")

    async def caller(self) -> Caller:
        known = _CALLER.get()
        if known is None:
            known = await self.gate().caller()
            _CALLER.set(known)
        return known

    async def _authorize(self, rule: xml.Rule, options: Options | None) -> None:
        """A dry run is what the options say, else the default, written into them: what was authorized runs."""
        if options is not None and options.get("dry_run") is None:
            options["dry_run"] = self.gate().dry_run_default()
        action = rule.needs(options is not None and bool(options["dry_run"]))
        if action:
            await self.gate().require(await self.caller(), action)


def _arguments(member: xml.Method, args: tuple[Any, ...]) -> list[Any]:
    """a{sv} options checked against their Keys and made plain, then strings (options first, as released)."""
    values = list(args)
    for i, arg in enumerate(member.in_args):
        if arg.signature == "a{sv}":
            values[i] = marshal.parse_options(args[i], arg.keys)
    for i, arg in enumerate(member.in_args):
        if arg.signature == "s":
            marshal.check_text(arg.name, args[i])
    return values


def _property_getter(prop: xml.Property) -> Callable[[ContractInterface], Any]:
    def get(self: ContractInterface) -> Any:
        return self._values[prop.name]
    # dbus-fast finds the value by the getter's name and reads the type from its annotation.
    get.__name__ = get.__qualname__ = prop.name
    get.__signature__ = _dbus_signature((), prop.signature)  # type: ignore[attr-defined]
    return get


class ManagerBackend(Gate, Protocol):
    """Called once the caller is authorized: holders come typed, redacted and bounded."""

    async def list_holders(self, caller: Caller, options: Options) -> list[VarDict]: ...

    async def sweep(self, caller: Caller, options: Options) -> dict[str, Any]: ...

    def history(self, count: int) -> list[dict[str, Any]]: ...

    async def reset_gpu(self, caller: Caller, gpu: int, options: Options) -> dict[str, Any]: ...

    async def reload(self, caller: Caller) -> None: ...

    def get_metrics(self) -> str: ...

    async def wait(self, options: Options) -> dict[str, Any]: ...


def _unit_option(unit: str, options: Options) -> tuple[str, Options]:
    """SweepUnit's unit joins its options (where a `unit` option may only repeat it)."""
    if not unit.strip():
        raise InvalidArgument("empty unit name")
    if options.get("unit", unit) != unit:
        raise InvalidArgument(f"unit given twice: {unit!r} and option unit={options['unit']!r}")
    return unit, {**options, "unit": unit}


class ManagerInterface(ContractInterface, interface=MANAGER_INTERFACE):
    REPORT_CACHE = 4096

    def __init__(self, backend: ManagerBackend, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.backend = backend
        # Stored reports never change, and typing them is most of GetHistory's cost: once, by id.
        self._typed_reports: dict[str, tuple[VarDict, int]] = {}

    def gate(self) -> Gate:
        return self.backend

    def typed_report(self, report: Mapping[str, Any]) -> VarDict:
        return self._sized_report(report)[0]

    def _sized_report(self, report: Mapping[str, Any]) -> tuple[VarDict, int]:
        key = str(report.get("id", ""))
        sized = self._typed_reports.get(key)
        if sized is None:
            sized = replysize.bound_report(report)
            if len(self._typed_reports) >= self.REPORT_CACHE:
                self._typed_reports.clear()
            if key:
                self._typed_reports[key] = sized
        return sized

    async def ListHolders(self, filter: Options) -> list[VarDict]:
        return await self.backend.list_holders(await self.caller(), filter)

    async def Sweep(self, options: Options) -> VarDict:
        return self.typed_report(await self.backend.sweep(await self.caller(), options))

    @checked_by(_unit_option)
    async def SweepUnit(self, unit: str, options: Options) -> VarDict:
        return self.typed_report(await self.backend.sweep(await self.caller(), options))

    async def ResetGpu(self, gpu: int, options: Options) -> VarDict:
        return self.typed_report(await self.backend.reset_gpu(await self.caller(), gpu, options))

    async def GetHistory(self, count: int) -> list[VarDict]:
        return replysize.bound_reports([self._sized_report(r) for r in self.backend.history(count)])

    async def GetMetrics(self) -> str:
        return self.backend.get_metrics()

    async def Wait(self, options: Options) -> VarDict:
        return marshal.to_vardict(await self.backend.wait(options), self.DEFINITION.dictionaries["WaitResult"])

    async def Reload(self) -> None:
        await self.backend.reload(await self.caller())

    # Signals: calling one emits it.

    def SweepStarted(self, id_: str, scope: VarDict) -> None: ...

    def ProcessTerminated(self, id_: str, pid: int, comm: str, unit: str, signal_: str) -> None: ...

    def SweepFinished(self, id_: str, outcome: str, report: VarDict) -> None: ...

    def LeakSuspected(self, gpu: int, uuid: str, bytes_: int) -> None: ...


def gpu_values(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The Gpu properties from an engine GPU summary (MemoryTotal from memory_total)."""
    return {name: marshal.property_value(prop, summary.get(marshal.snake_case(name)))
            for name, prop in xml.interface(GPU_INTERFACE).properties.items()}


class GpuInterface(ContractInterface, interface=GPU_INTERFACE):
    def __init__(self, summary: Mapping[str, Any]) -> None:
        super().__init__(gpu_values(summary))

    def refresh(self, summary: Mapping[str, Any]) -> None:
        self.update(**gpu_values(summary))

"""The D-Bus face of the daemon: the Manager and Gpu interfaces of dbus/org.gpuguard.GpuGuard1.xml.

Only D-Bus concerns live here: signatures, argument names, typed variants, properties with
PropertiesChanged, and turning the engine's exceptions into the contract's error names. What
a call means (authorization, sweeping, history) is the ManagerBackend's business.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from dbus_fast import DBusError, PropertyAccess, Variant
from dbus_fast import introspection as intr
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from gpuguardd.bus import marshal, replysize
from gpuguardd.bus.auth import Caller
from gpuguardd.bus.names import GPU_INTERFACE, MANAGER_INTERFACE, error_name
from gpuguardd.bus.ratelimit import DENIAL_LOG_INTERVAL_SEC, PerKey, held_back
from gpuguardd.errors import GpuGuardError, NotAuthorized

log = logging.getLogger("gpuguard.service")

READ = PropertyAccess.READ
VarDict = dict[str, Variant]

_F = TypeVar("_F", bound=Callable[..., Any])


def dbus_types(*args: str, returns: str = "") -> Callable[[_F], _F]:
    """Declare a member's D-Bus signature, leaving its Python annotations to mypy.

    dbus-fast reads the signature from the annotations; every version (Debian 12 ships 1.84)
    understands plain signature strings there, so they replace the Python types at import.
    """
    def apply(fn: _F) -> _F:
        names = list(inspect.signature(fn).parameters)[1:]  # after self
        if len(names) != len(args):
            raise TypeError(f"{fn.__name__}: {len(args)} signatures for {len(names)} arguments")
        fn.__annotations__ = {**dict(zip(names, args)), "return": returns}
        return fn
    return apply


class ManagerBackend(Protocol):
    async def caller(self) -> Caller: ...

    async def list_holders(self, caller: Caller, options: dict[str, Any]) -> list[VarDict]:
        """Typed holders (marshal.holder), filtered and redacted for `caller`, bounded in
        size (replysize.bound_holders)."""

    async def sweep(self, caller: Caller, options: dict[str, Any]) -> dict[str, Any]: ...

    def history(self, count: int) -> list[dict[str, Any]]: ...

    async def reload(self, caller: Caller) -> None: ...

    def get_metrics(self) -> str:
        """The Prometheus text exposition of the daemon's metrics (metrics.py)."""


_A = TypeVar("_A", bound=Callable[..., Awaitable[Any]])


_REFUSALS = PerKey(DENIAL_LOG_INTERVAL_SEC)


def contract_errors(fn: _A) -> _A:
    """Engine exceptions become the contract's D-Bus errors; bugs become a logged Failed."""
    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except DBusError:
            raise
        except NotAuthorized as exc:
            count = _REFUSALS.admit((fn.__name__, exc.uid))
            if count is not None:  # once per method and uid: any user may ask again and again
                log.info("%s refused: %s%s", fn.__name__, exc, held_back(count))
            raise DBusError(error_name(exc.dbus_name), str(exc)) from None
        except GpuGuardError as exc:
            raise DBusError(error_name(exc.dbus_name), str(exc)) from None
        except Exception as exc:
            log.exception("internal error in %s", fn.__name__)
            raise DBusError(error_name("Failed"), f"internal error: {type(exc).__name__}") from None
    return wrapper  # type: ignore[return-value]


def _name_args(args: list[intr.Arg], names: list[str]) -> None:
    for arg, name in zip(args, names):
        arg.name = name


class PropertyHolder(ServiceInterface):
    """Read-only properties served from a dict, with PropertiesChanged for real changes only."""

    def __init__(self, name: str, values: Mapping[str, Any]) -> None:
        super().__init__(name)
        self._values: dict[str, Any] = dict(values)

    def update(self, **values: Any) -> None:
        changed = {k: v for k, v in values.items() if self._values.get(k) != v}
        if changed:
            self._values.update(changed)
            self.emit_properties_changed(changed)

    def value(self, name: str) -> Any:
        return self._values[name]


class ManagerInterface(PropertyHolder):
    # Out-argument and signal-argument names: dbus-fast only knows the in-arguments' names.
    OUT_NAMES: Mapping[str, list[str]] = {
        "ListHolders": ["holders"], "Sweep": ["report"], "SweepUnit": ["report"],
        "GetHistory": ["reports"], "GetMetrics": ["text"]}
    SIGNAL_ARGS: Mapping[str, list[str]] = {
        "SweepStarted": ["id", "scope"],
        "ProcessTerminated": ["id", "pid", "comm", "unit", "signal"],
        "SweepFinished": ["id", "outcome", "report"],
        "LeakSuspected": ["gpu", "uuid", "bytes"]}

    REPORT_CACHE = 4096

    def __init__(self, backend: ManagerBackend, values: Mapping[str, Any]) -> None:
        super().__init__(MANAGER_INTERFACE, values)
        self.backend = backend
        # Stored reports never change, and typing them costs more than sending them: GetHistory
        # under load is mostly this, so each report is typed once (by id), with its size.
        self._typed_reports: dict[str, tuple[VarDict, int]] = {}

    def typed_report(self, report: Mapping[str, Any]) -> VarDict:
        return self._sized_report(report)[0]

    def _sized_report(self, report: Mapping[str, Any]) -> tuple[VarDict, int]:
        """The report typed, bounded to replysize.REPORT_BUDGET, and its size."""
        key = str(report.get("id", ""))
        sized = self._typed_reports.get(key)
        if sized is None:
            sized = replysize.bound_report(report, marshal.report)
            if len(self._typed_reports) >= self.REPORT_CACHE:
                self._typed_reports.clear()
            if key:
                self._typed_reports[key] = sized
        return sized

    def introspect(self) -> intr.Interface:
        interface = super().introspect()
        for member in interface.methods:
            _name_args(member.out_args, list(self.OUT_NAMES.get(member.name, [])))
        for sig in interface.signals:
            _name_args(sig.args, list(self.SIGNAL_ARGS.get(sig.name, [])))
        return interface

    # -- methods -------------------------------------------------------------------------

    @method()
    @contract_errors
    @dbus_types("a{sv}", returns="aa{sv}")
    async def ListHolders(self, filter: VarDict) -> list[VarDict]:
        options = marshal.parse_options(filter, marshal.FILTER_OPTIONS, "filter")
        caller = await self.backend.caller()
        return await self.backend.list_holders(caller, options)

    @method()
    @contract_errors
    @dbus_types("a{sv}", returns="a{sv}")
    async def Sweep(self, options: VarDict) -> VarDict:
        values = marshal.parse_options(options, marshal.SWEEP_OPTIONS, "sweep")
        caller = await self.backend.caller()
        return self.typed_report(await self.backend.sweep(caller, values))

    @method()
    @contract_errors
    @dbus_types("s", "a{sv}", returns="a{sv}")
    async def SweepUnit(self, unit: str, options: VarDict) -> VarDict:
        values = marshal.parse_options(options, marshal.SWEEP_OPTIONS, "sweep")
        marshal.check_text("unit", unit)
        if not unit.strip():
            raise DBusError(error_name("InvalidArgument"), "empty unit name")
        if values.get("unit", unit) != unit:
            raise DBusError(error_name("InvalidArgument"),
                            f"unit given twice: {unit!r} and option unit={values['unit']!r}")
        values["unit"] = unit
        caller = await self.backend.caller()
        return self.typed_report(await self.backend.sweep(caller, values))

    @method()
    @contract_errors
    @dbus_types("u", returns="aa{sv}")
    async def GetHistory(self, count: int) -> list[VarDict]:
        sized = [self._sized_report(r) for r in self.backend.history(count)]
        return replysize.bound_reports([r for r, _ in sized], sizes=[n for _, n in sized])

    @method()
    @contract_errors
    @dbus_types(returns="s")
    async def GetMetrics(self) -> str:
        return self.backend.get_metrics()

    @method()
    @contract_errors
    @dbus_types()
    async def Reload(self) -> None:
        caller = await self.backend.caller()
        await self.backend.reload(caller)

    # -- properties ----------------------------------------------------------------------

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def Version(self) -> str:
        return self.value("Version")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="b")
    def NvmlAvailable(self) -> bool:
        return self.value("NvmlAvailable")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def NvmlError(self) -> str:
        return self.value("NvmlError")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def DriverVersion(self) -> str:
        return self.value("DriverVersion")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="u")
    def GpuCount(self) -> int:
        return self.value("GpuCount")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="b")
    def Busy(self) -> bool:
        return self.value("Busy")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="a{sv}")
    def LastSweep(self) -> VarDict:
        return self.value("LastSweep")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="as")
    def WatchedUnits(self) -> list[str]:
        return self.value("WatchedUnits")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="as")
    def ConfigFiles(self) -> list[str]:
        return self.value("ConfigFiles")  # type: ignore[no-any-return]

    # -- signals (calling one emits it) --------------------------------------------------

    @signal()
    @dbus_types("s", "a{sv}", returns="sa{sv}")
    def SweepStarted(self, report_id: str, scope: VarDict) -> list[Any]:
        return [report_id, scope]

    @signal()
    @dbus_types("s", "u", "s", "s", "s", returns="susss")
    def ProcessTerminated(self, report_id: str, pid: int, comm: str, unit: str,
                          signal_name: str) -> list[Any]:
        return [report_id, pid, comm, unit, signal_name]

    @signal()
    @dbus_types("s", "s", "a{sv}", returns="ssa{sv}")
    def SweepFinished(self, report_id: str, outcome: str, report: VarDict) -> list[Any]:
        return [report_id, outcome, report]

    @signal()
    @dbus_types("u", "s", "t", returns="ust")
    def LeakSuspected(self, gpu: int, uuid: str, used: int) -> list[Any]:
        return [gpu, uuid, used]


def gpu_values(summary: Mapping[str, Any]) -> dict[str, Any]:
    values = {prop: summary.get(key) for prop, key in marshal.GPU_PROPERTIES.items()}
    for prop in ("Uuid", "Name", "PciBusId", "DevicePath", "State", "Error"):
        values[prop] = str(values[prop] or "")
    for prop in ("Index", "Minor", "MemoryTotal", "MemoryUsed", "HolderCount"):
        values[prop] = max(0, int(values[prop] or 0))
    values["MigMode"] = bool(values["MigMode"])
    values["MigInstances"] = marshal.mig_instances(values["MigInstances"] or [])
    return values


class GpuInterface(PropertyHolder):
    def __init__(self, summary: Mapping[str, Any]) -> None:
        super().__init__(GPU_INTERFACE, gpu_values(summary))

    def refresh(self, summary: Mapping[str, Any]) -> None:
        self.update(**gpu_values(summary))

    @dbus_property(access=READ)
    @dbus_types(returns="u")
    def Index(self) -> int:
        return self.value("Index")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def Uuid(self) -> str:
        return self.value("Uuid")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def Name(self) -> str:
        return self.value("Name")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def PciBusId(self) -> str:
        return self.value("PciBusId")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="u")
    def Minor(self) -> int:
        return self.value("Minor")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def DevicePath(self) -> str:
        return self.value("DevicePath")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="t")
    def MemoryTotal(self) -> int:
        return self.value("MemoryTotal")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="t")
    def MemoryUsed(self) -> int:
        return self.value("MemoryUsed")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="u")
    def HolderCount(self) -> int:
        return self.value("HolderCount")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def State(self) -> str:
        return self.value("State")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="s")
    def Error(self) -> str:
        return self.value("Error")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="b")
    def MigMode(self) -> bool:
        return self.value("MigMode")  # type: ignore[no-any-return]

    @dbus_property(access=READ)
    @dbus_types(returns="aa{sv}")
    def MigInstances(self) -> list[VarDict]:
        return self.value("MigInstances")  # type: ignore[no-any-return]

"""Whom gpuguardctl's verbs ask: the daemon (cli/client.py) or the engine in this process.
The engine is imported only when a LocalBackend is made, dbus-fast only when the daemon is asked.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from gpuguardd import __version__
from gpuguardd.errors import DaemonUnavailable, InvalidArgument
from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import GpuSummary, Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.records.selectors import one_gpu
from gpuguardd.safetext import user_name
from gpuguardd.systemd import dropins

log = logging.getLogger("gpuguard.cli")


def requester_description() -> str:
    uid = os.getuid()
    return f"uid {uid} ({user_name(uid)}) via gpuguardctl --local"


class LocalBackend:
    """The engine in this process: for root, when no daemon runs (or --local is given)."""

    def __init__(self, config_files: Sequence[str] | None, bus_address: str | None) -> None:
        from gpuguardd.config import load_config
        from gpuguardd.engine.engine import Engine

        self.engine = Engine(load_config(config_files))
        self.bus_address = bus_address  # where to ask systemd about units (None: system bus)

    def status(self) -> dict[str, Any]:
        snap = self.engine.snapshot(with_processes=False)
        config = self.engine.config
        return {"version": __version__, "nvml_available": snap.available,
                "nvml_error": snap.error, "driver_version": snap.driver_version,
                "gpu_count": len(snap.gpus), "busy": False, "last_sweep": {},
                "watched_units": list(config.watch_units), "mode": "local",
                "config_files": list(config.sources), "vendors": snap.vendors}

    def gpus(self) -> list[GpuSummary]:
        from gpuguardd.engine.gpustate import all_summaries

        return all_summaries(self.engine.scan(), self.engine.config.released_below_mib * 1024 * 1024,
                             self.engine.device_map())

    def holders(self, gpus: list[str], unit: str, container: str, include_protected: bool) -> list[Holder]:
        scope, _ = self.engine.resolve_request(SweepRequest(gpus=gpus, unit=unit, container=container))
        found, scan = self.engine.list_holders(scope, include_protected)
        for warning in scan.warnings:
            log.warning("%s", warning)
        return found

    def sweep(self, request: SweepRequest) -> Report:
        # The drop-in's --reason "hook:<unit> ..." names the requester, as the daemon records it.
        hook = dropins.requested_by_for_reason(request.reason)
        if not request.requested_by:
            request.requested_by = hook or requester_description()
            if hook:
                request.requester_kind = RequesterKind.HOOK if os.geteuid() == 0 else RequesterKind.HOOK_NONROOT
        # One reading checks the request (a bad unit name is refused first), finds leftovers, starts the sweep.
        prepared = self.engine.prepare(request)
        try:
            if request.unit:
                import asyncio

                asyncio.run(self._adopt_leftovers(request, prepared))
            return self.engine.sweep(request, prepared=prepared)
        finally:
            prepared.release()  # the leftovers' scan, if the sweep never took it over

    def reset(self, gpu: str, reason: str) -> Report:
        return self.engine.reset_gpu(one_gpu(self.engine.resolve_gpus([gpu])[0], gpu),
                                     requester_description(), reason)

    async def _adopt_leftovers(self, request: SweepRequest, prepared: Prepared) -> None:
        """The daemon's rule (adoption.leftovers): the unit's escaped leftovers go with it."""
        from gpuguardd.engine.attribution import normalize_unit_name
        from gpuguardd.systemd.adoption import UnitGpuRecords, leftovers
        from gpuguardd.systemd.client import local_systemd  # dbus-fast only where a unit is swept

        systemd, bus = await local_systemd(self.bus_address)
        try:
            if not request.container:
                request.adopted = sorted(set(request.adopted) | set(await leftovers(
                    systemd, UnitGpuRecords(), normalize_unit_name(request.unit),
                    self.engine.pin(prepared), request.include_management)))
        finally:
            if bus is not None:
                bus.disconnect()

    def history(self, count: int) -> list[Report]:
        raise InvalidArgument("history is kept by the daemon; it is not available with --local")


if TYPE_CHECKING:
    from gpuguardd.cli.client import DBusBackend
    from gpuguardd.engine.engine import Prepared
Backend: TypeAlias = "DBusBackend | LocalBackend"


def local(args: argparse.Namespace) -> LocalBackend:
    if os.geteuid() != 0:
        log.warning("running --local as a non-root user: processes of other users are invisible")
    from gpuguardd.bus.names import default_address
    return LocalBackend(args.config, default_address(args.bus_address))


def connect(args: argparse.Namespace) -> Backend:
    """The daemon if it answers; the local engine when asked, or for root's sweep as fallback."""
    if args.local:
        if args.verb == "watch":
            raise InvalidArgument("watch shows the daemon's signals; it is not available with --local")
        return local(args)
    try:
        from gpuguardd.cli.client import DBusBackend
        return DBusBackend(bus_address=args.bus_address)
    except (ImportError, DaemonUnavailable) as exc:
        if args.verb == "sweep" and os.geteuid() == 0:
            log.warning("no gpuguardd answers (%s); sweeping with the local engine", exc or "not installed")
            return local(args)
        raise DaemonUnavailable(f"no gpuguardd answers ({exc or 'not installed'}); as root, use --local") from None

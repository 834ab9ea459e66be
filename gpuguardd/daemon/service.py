"""What the daemon's D-Bus calls mean (the Manager's backend): authorization, holders,
sweeps, resets, the start gate, history, metrics and reload; and the daemon's parts put
together. What it tells the bus as things happen is publisher.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from gpuguardd import __version__
from gpuguardd.bus import marshal, replysize
from gpuguardd.bus.auth import FRESH_SCAN_INTERVAL_SEC, Authorizer, Caller, RateLimit
from gpuguardd.bus.compat import current_call
from gpuguardd.bus.connection import GuardBus
from gpuguardd.bus.interfaces import ManagerInterface
from gpuguardd.bus.names import ACTION_VIEW_DETAILS, MANAGER_PATH
from gpuguardd.config import MAX_GATE_STABLE_SEC, MAX_RELEASED_BELOW_MIB
from gpuguardd.daemon.gate import FAST_POLL_SEC, MAX_WAIT_SEC, GateService
from gpuguardd.daemon.history import History
from gpuguardd.daemon.inflight import InFlightSweeps
from gpuguardd.daemon.inventory import Inventory
from gpuguardd.daemon.metrics import Metrics
from gpuguardd.daemon.publisher import Publisher
from gpuguardd.daemon.recovery import Recovery
from gpuguardd.daemon.resume import Resume
from gpuguardd.daemon.runner import InFlight, SweepRunner, UnitSweeps
from gpuguardd.engine.engine import Engine, HolderFilter, filter_holders
from gpuguardd.engine.gate import GateRule, MiB
from gpuguardd.errors import InvalidArgument, NotAuthorized
from gpuguardd.records.codec import Wire
from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import ScanResult, Scope, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.systemd import dropins
from gpuguardd.systemd.rules import SLURM_PREFIX
from gpuguardd.systemd.unitwatch import UnitWatch

log = logging.getLogger("gpuguard.service")

# A redacted holder's cmdline, typed as the contract types it.
_NO_CMDLINE = marshal.holder({"cmdline": ""})["cmdline"]


def requester(caller: Caller, reason: str, slurm_job: str = "") -> tuple[str, RequesterKind]:
    """Who a sweep is recorded for (requested_by) and what kind of requester that is, decided
    here, once, for every bus caller. Only root (the ExecStopPost hook) may be just
    "hook:<unit>", of kind HOOK; anyone else who says "hook:" is named as well, so the journal
    cannot be misled, and is of kind HOOK_NONROOT. Root's Slurm epilog (a `slurm_job`
    request) is "slurm:<job>", of kind SLURM. The metrics' trigger label is the kind, so only
    root's requests can be counted as the hook's or the epilog's."""
    hook = dropins.requested_by_for_reason(reason)
    if hook:
        if caller.is_root:
            return hook, RequesterKind.HOOK
        return f"{hook} via {caller.describe()}", RequesterKind.HOOK_NONROOT
    if slurm_job and caller.is_root:
        return f"{SLURM_PREFIX}{slurm_job}", RequesterKind.SLURM
    return caller.describe(), RequesterKind.MANUAL


class Service:
    def __init__(self, bus: GuardBus, engine: Engine, history: History,
                 scan_executor: Executor, sweep_executor: Executor, io_executor: Executor,
                 reloader: Callable[[], Awaitable[None]]) -> None:
        self.bus = bus
        self.engine = engine
        self.store = history
        self.io_executor = io_executor
        self.reloader = reloader
        self.auth = Authorizer(bus)
        self.fresh_scans = RateLimit(FRESH_SCAN_INTERVAL_SEC)
        config = engine.config
        self.manager = ManagerInterface(self, {
            "Version": __version__, "NvmlAvailable": False, "NvmlError": "", "DriverVersion": "",
            "GpuCount": 0, "Vendors": [], "Busy": False,
            "LastSweep": {},
            "WatchedUnits": list(config.watch_units), "ConfigFiles": list(config.sources)})
        for stored in history.newest(1):  # not exported yet: no PropertiesChanged
            self.manager.update(LastSweep=self.manager.typed_report(stored))
        metrics = Metrics()
        metrics.note_history(history.last())
        self.publisher = events = Publisher(bus, self.manager, metrics,
                                            lambda: self.engine.config, io_executor)
        self.inventory = Inventory(engine, scan_executor, events)
        inflight = InFlightSweeps(engine.config.runtime_directory)
        self.runner = SweepRunner(engine, sweep_executor, io_executor, history, events, inflight)
        # Sweeps in flight keep their GPUs from being free at the start gate (sweep_gpus).
        self.gate = GateService(lambda: self.engine.config, self.inventory.scan, self.inventory.wake,
                                lambda: [self.sweep_gpus(f) for f in self.runner.in_flight],
                                self.inventory.scan_age, self.inventory.request_rescan,
                                lambda: self.inventory.scan_cost)
        self._typed_for: ScanResult | None = None
        self._typed: dict[int, marshal.VarDict] = {}
        self._typed_sizes: dict[int, int] = {}
        # Watch mode and unit sweeps (unitwatch.py): which GPUs each unit held, systemd's
        # unit stops, one sweep per stop, and the unit's leftovers outside its cgroup.
        self.unit_watch = UnitWatch(bus, engine.config.watch_units,
                                    os.path.join(engine.config.runtime_directory, "units.json"))
        self.units = UnitSweeps(self.runner, self.unit_watch, self.inventory.fresh_scan,
                                lambda: self.inventory.snapshot)
        # What the last gpuguardd left unfinished (resume.py): claimed in start(), run once
        # the name is owned (Daemon.run).
        self.resume = Resume(inflight,
                             history, self.runner, self.units, lambda: self.engine.config,
                             self.inventory.fresh_scan)
        self.resume_work: list[Awaitable[Report | None]] = []
        # While anyone waits at the start gate a job is about to start: no automatic reset then.
        self.recovery = Recovery(engine, sweep_executor, self._keep, events,
                                 sweeping=lambda: self.runner.busy,
                                 gate_waiting=lambda index: self.gate.waiters > 0)
        events.connect(self.inventory, self.gate, self.unit_watch, self.recovery)

    async def start(self) -> None:
        """Export the objects with the GPUs already in place (before the name is requested)."""
        self.bus.export(MANAGER_PATH, self.manager)
        try:
            await self.inventory.scan()
        except Exception as exc:  # the poll retries; a daemon without GPUs still serves history
            log.error("first holder scan failed: %s: %s", type(exc).__name__, exc)
        await self.units.start()
        self.resume_work = await self.resume.claim()

    def config_changed(self) -> None:
        config = self.engine.config
        self.store.set_max_entries(config.history_max)
        self.manager.update(WatchedUnits=list(config.watch_units), ConfigFiles=list(config.sources))
        self.unit_watch.config_changed(config.watch_units)
        self.inventory.request_rescan()

    def sweep_gpus(self, flight: InFlight) -> list[int] | None:
        """The GPUs a sweep in flight covers, for the start gate: its scope's, else (a unit
        sweep) the GPUs the unit watch saw the unit hold or name; None (every GPU) when
        neither is known yet."""
        scope = flight.scope
        if scope is not None and scope.gpus:
            return list(scope.gpus)
        unit = scope.unit if scope is not None else flight.request.unit
        record = self.unit_watch.records.get(unit) if unit else None
        return sorted(record.all_gpus) if record is not None and record.all_gpus else None

    def poll_interval(self) -> float:
        """NVML's poll interval: fast while a start gate waits on a target no process holds
        (gate.py), else configured."""
        return FAST_POLL_SEC if self.gate.fast else self.engine.config.poll_interval_sec

    def status_line(self) -> str:
        snap = self.inventory.snapshot
        gpus = f"{len(snap.gpus)} GPU(s)" if snap.gpus_known else f"NVML unavailable ({snap.error})"
        holders = len(self.inventory.holders)
        text = f"{gpus}, {holders} holder(s)"
        if self.runner.busy:
            text += f", {self.runner.active} sweep(s) running"
        last = self.store.last()
        if last:
            outcome = "?" if "outcome" in last.unread else last.outcome.value
            text += f", last sweep {last.id[:8]}: {outcome}"
        return text

    async def caller(self) -> Caller:
        msg = current_call()
        if msg is None:
            raise NotAuthorized("cannot tell who is calling")
        return await self.auth.caller(msg)

    async def require(self, caller: Caller, action: str) -> None:
        await self.auth.require(caller, action)

    def dry_run_default(self) -> bool:
        return self.engine.config.dry_run

    async def list_holders(self, caller: Caller, options: dict[str, Any]) -> list[marshal.VarDict]:
        holder_filter = HolderFilter(include_protected=options.get("include_protected", True))
        if options.get("gpus") or options.get("unit") or options.get("container"):
            scope = await self._resolve(SweepRequest.from_options(options))
            holder_filter = HolderFilter(gpus=scope.gpus, unit=scope.unit, container=scope.container,
                                         mig=scope.mig, include_protected=holder_filter.include_protected)
        # The last scan when it is fresh for this call (inventory.py's rule). fresh=true (what
        # gpuguardctl sends: an admin wants the truth, not the last second's view) waits for a
        # scan that starts after the call, at most once per FRESH_SCAN_INTERVAL_SEC for a
        # non-root uid: no caller makes the daemon walk /proc more than once a second.
        fresh = bool(options.get("fresh", False))
        if fresh and not caller.is_root and not self.fresh_scans.admit(caller.uid).allowed:
            fresh = False
        result = await (self.inventory.scan() if fresh else self.inventory.recent())
        typed = self._typed_holders(result)
        holders = filter_holders(result.holders, holder_filter)
        # Below the bus's message limit (replysize.py): a redacted holder is no bigger than its
        # typed one, so the sizes typed once per scan bound it.
        sizes = [self._typed_sizes[id(h)] for h in holders]
        # Command lines can carry secrets (tokens, passwords in arguments).
        redact = not caller.is_root and any(h.uid != caller.uid for h in holders) \
            and not await self.auth.allowed(caller, ACTION_VIEW_DETAILS)
        return replysize.bound_holders(
            [{**typed[id(h)], "cmdline": _NO_CMDLINE} if redact and h.uid != caller.uid else typed[id(h)]
             for h in holders], sizes=sizes)

    async def _resolve(self, request: SweepRequest) -> Scope:
        loop = asyncio.get_running_loop()
        scope, _, _ = await loop.run_in_executor(self.io_executor, self.engine.resolve_request, request)
        return scope

    def _typed_holders(self, result: ScanResult) -> dict[int, marshal.VarDict]:
        """Each holder of `result` as its D-Bus value (by id(): the scan keeps them alive),
        typed once per scan: callers served from one scan share it (never mutated)."""
        if self._typed_for is not result:
            self._typed = {id(h): marshal.holder(h.to_dict()) for h in result.holders}
            self._typed_sizes = {key: replysize.wire_size(value) for key, value in self._typed.items()}
            self._typed_for = result
        return self._typed

    async def sweep(self, caller: Caller, options: dict[str, Any]) -> Wire:
        request = SweepRequest.from_options(options)
        # Authorized by the interface (the XML's rule for Sweep), which set options["dry_run"]
        # to what it authorized: that is what runs (and what the watch sees).
        dry_run = request.dry_run = request.is_dry_run(self.engine.config.dry_run)
        request.requested_by, request.requester_kind = requester(caller, request.reason,
                                                                request.slurm_job)
        request.audited = caller.is_root or not dry_run  # models.SweepRequest.audited
        # Checked before the sweep counts as running, on the GPU reading the sweep works from.
        prepared = await self.runner.validate(request)
        if request.unit:
            # Unit sweeps go through the unit watch: escaped leftovers, one sweep per stop.
            unit_report = await self.units.sweep_unit(request, prepared)
            assert unit_report is not None  # None only for the watch's own requests
            return unit_report.to_dict()
        report = await self.runner.run(request, prepared)
        return report.to_dict()

    async def reset_gpu(self, caller: Caller, gpu: int, options: dict[str, Any]) -> Wire:
        # Authorized by the interface (the XML's rule for ResetGpu).
        snap = self.inventory.snapshot
        if snap.gpus_known and snap.by_index(gpu) is None:
            known = ", ".join(str(g.index) for g in snap.gpus) or "none"
            raise InvalidArgument(f"GPU index {gpu} out of range (GPUs: {known})")
        report = await self.recovery.reset(gpu, caller.describe(), options.get("reason", ""),
                                           RequesterKind.MANUAL)
        return report.to_dict()

    async def _keep(self, report: Report) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.io_executor, self.store.append, report)

    def history(self, count: int) -> list[Wire]:
        return self.store.newest(count)

    def get_metrics(self) -> str:
        return self.publisher.metrics.render().decode()

    async def wait(self, options: dict[str, Any]) -> Wire:
        """Manager.Wait: options checked, GPUs resolved as a sweep's, then the gate (gate.py)."""
        config = self.engine.config
        free_below = options.get("free_below_mib", config.gate_free_below_mib)
        if not 1 <= free_below <= MAX_RELEASED_BELOW_MIB:
            raise InvalidArgument(f"free_below_mib {free_below} out of range (1-{MAX_RELEASED_BELOW_MIB})")
        stable_ms = options.get("stable_ms", int(config.gate_stable_sec * 1000))
        if stable_ms > MAX_GATE_STABLE_SEC * 1000:
            raise InvalidArgument(f"stable_ms {stable_ms} out of range (0-{int(MAX_GATE_STABLE_SEC * 1000)})")
        timeout_ms = options.get("timeout_ms", int(MAX_WAIT_SEC * 1000))
        gpus: tuple[int, ...] = ()
        mig: tuple[str, ...] = ()
        if options.get("gpus"):
            scope = await self._resolve(SweepRequest.from_options({"gpus": options["gpus"]}))
            gpus, mig = scope.gpus, scope.mig
        rule = GateRule(free_below * MiB, config.gate_tolerance_mib * MiB,
                        bool(options.get("allow_unverified", False)))
        outcome = await self.gate.wait(gpus, mig, rule, stable_ms / 1000, timeout_ms / 1000)
        return outcome.to_dict()

    async def reload(self, caller: Caller) -> None:
        # Authorized by the interface (the XML's rule for Reload).
        log.info("reload requested by %s", caller.describe())
        await self.reloader()

"""The daemon's parts put together: the Manager's backend (what each D-Bus call means), and
the listener (events) of the inventory, sweeps and resets that keeps the Manager's properties and
signals, one Gpu object per GPU, and the metrics and their textfile current.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from typing import Any, cast

from gpuguardd import __version__
from gpuguardd.bus import marshal, replysize
from gpuguardd.bus.auth import FRESH_SCAN_INTERVAL_SEC, Authorizer, Caller, RateLimit
from gpuguardd.bus.compat import current_call
from gpuguardd.bus.connection import GuardBus
from gpuguardd.bus.interfaces import GpuInterface, ManagerInterface
from gpuguardd.bus.names import ACTION_VIEW_DETAILS, MANAGER_PATH, gpu_path
from gpuguardd.config import MAX_GATE_STABLE_SEC, MAX_RELEASED_BELOW_MIB
from gpuguardd.daemon.gate import FAST_POLL_SEC, MAX_WAIT_SEC, GateService
from gpuguardd.daemon.history import History
from gpuguardd.daemon.inflight import InFlightSweep, InFlightSweeps
from gpuguardd.daemon.inventory import Inventory
from gpuguardd.daemon.metrics import Metrics, write_textfile
from gpuguardd.daemon.recovery import Recovery
from gpuguardd.daemon.runner import SweepRunner
from gpuguardd.daemon.units import UnitSweeps
from gpuguardd.engine.engine import Engine, Prepared, filter_holders
from gpuguardd.engine.gate import GateRule, MiB
from gpuguardd.errors import InvalidArgument, NotAuthorized
from gpuguardd.records.codec import Wire
from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import GpuSummary, NvmlSnapshot, ScanResult, Scope, SweepRequest
from gpuguardd.records.report import Report, ReportScope
from gpuguardd.systemd import dropins
from gpuguardd.systemd.rules import SLURM_PREFIX

log = logging.getLogger("gpuguard.service")

# A redacted holder's cmdline, typed as the contract types it.
_NO_CMDLINE = marshal.holder({"cmdline": ""})["cmdline"]


def requester(caller: Caller, reason: str, slurm_job: str = "") -> tuple[str, RequesterKind]:
    """Who a sweep is recorded for, and their kind. Only root (the ExecStopPost hook) may be just
    "hook:<unit>"; anyone else saying "hook:" is named as well, so the journal cannot be misled."""
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
            "GpuCount": 0, "Vendors": [], "Busy": False, "LastSweep": {},
            "WatchedUnits": list(config.watch_units), "ConfigFiles": list(config.sources)})
        for stored in history.newest(1):  # not exported yet: no PropertiesChanged
            self.manager.update(LastSweep=self.manager.typed_report(stored))
        self.metrics = Metrics()
        self.metrics.note_history(history.last())
        self.gpus: dict[int, GpuInterface] = {}
        # Told of every change the sd_notify status line shows (main.py sets it).
        self.on_change: Callable[[], None] = lambda: None
        self.inventory = Inventory(engine, scan_executor, self)
        self.runner = SweepRunner(engine, sweep_executor, io_executor, history, self,
                                  InFlightSweeps(engine.config.runtime_directory))
        # Sweeps in flight keep their GPUs from being free at the start gate (sweep_gpus).
        self.gate = GateService(self.inventory, lambda: [self.sweep_gpus(f) for f in self.runner.in_flight])
        self._typed: tuple[ScanResult | None, dict[int, tuple[marshal.VarDict, int]]] = (None, {})
        self.units = UnitSweeps(self.runner, self.inventory, bus, engine.config.watch_units,
                                os.path.join(engine.config.runtime_directory, "units.json"))
        # What the last gpuguardd left unfinished: claimed in start(), run once the name is owned.
        self.resume_work: list[Awaitable[Report | None]] = []
        # While anyone waits at the start gate a job is about to start: no automatic reset then.
        self.recovery = Recovery(engine, sweep_executor, lambda report: self.runner.io(self.store.append, report),
                                 self, held_off=lambda: self.runner.busy or self.gate.waiters > 0)

    async def start(self) -> None:
        """Export the objects, GPUs included, before the name is requested."""
        self.bus.export(MANAGER_PATH, self.manager)
        try:
            await self.inventory.scan()
        except Exception as exc:  # the poll retries; a daemon without GPUs still serves history
            log.error("first holder scan failed: %s: %s", type(exc).__name__, exc)
        await self.units.start()
        self.resume_work = await self.units.claim_unfinished()

    def config_changed(self) -> None:
        config = self.engine.config
        self.store.set_max_entries(config.history_max)
        self.manager.update(WatchedUnits=list(config.watch_units), ConfigFiles=list(config.sources))
        self.units.watcher.patterns = tuple(config.watch_units)
        self.inventory.request_rescan()

    def sweep_gpus(self, flight: InFlightSweep) -> list[int] | None:
        """Its scope's GPUs, else its unit's recorded ones; None (every GPU) when neither is known."""
        scope = flight.scope
        if scope is not None and scope.gpus:
            return list(scope.gpus)
        unit = scope.unit if scope is not None else flight.request.unit
        record = self.units.records.get(unit) if unit else None
        return sorted(record.all_gpus) if record is not None and record.all_gpus else None

    def poll_interval(self) -> float:
        return FAST_POLL_SEC if self.gate.fast else self.engine.config.poll_interval_sec

    def status_line(self) -> str:
        snap = self.inventory.snapshot
        gpus = f"{len(snap.gpus)} GPU(s)" if snap.gpus_known else f"NVML unavailable ({snap.error})"
        text = f"{gpus}, {len(self.inventory.holders)} holder(s)"
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
        scope = Scope()
        if options.get("gpus") or options.get("unit") or options.get("container"):
            scope = await self._resolve(SweepRequest.from_options(options))
        # fresh=true waits for a scan started after the call; a non-root uid once per FRESH_SCAN_INTERVAL_SEC.
        fresh = bool(options.get("fresh", False)) and (caller.is_root or self.fresh_scans.admit(caller.uid).allowed)
        result = await (self.inventory.scan() if fresh else self.inventory.recent())
        typed = self._typed_holders(result)
        holders = filter_holders(result.holders, scope, options.get("include_protected", True))
        # Command lines can carry secrets (tokens, passwords in arguments).
        redact = not caller.is_root and any(h.uid != caller.uid for h in holders) \
            and not await self.auth.allowed(caller, ACTION_VIEW_DETAILS)
        # A redacted holder is no bigger than its typed one: the sizes typed once per scan bound it.
        return replysize.bound_holders(
            [{**typed[id(h)][0], "cmdline": _NO_CMDLINE} if redact and h.uid != caller.uid else typed[id(h)][0]
             for h in holders], sizes=[typed[id(h)][1] for h in holders])

    async def _resolve(self, request: SweepRequest) -> Scope:
        return cast(Scope, (await self.runner.io(self.engine.resolve_request, request))[0])

    def _typed_holders(self, result: ScanResult) -> dict[int, tuple[marshal.VarDict, int]]:
        """Each holder's D-Bus value and its size, by id() (the scan keeps them alive), typed once
        per scan and shared (never mutated)."""
        if self._typed[0] is not result:
            typed = (marshal.holder(h.to_dict()) for h in result.holders)
            self._typed = (result, {id(h): (t, replysize.wire_size(t)) for h, t in zip(result.holders, typed)})
        return self._typed[1]

    async def sweep(self, caller: Caller, options: dict[str, Any]) -> Wire:
        request = SweepRequest.from_options(options)
        # The interface authorized it (the XML's rule) and set options["dry_run"] to what it allowed.
        dry_run = request.dry_run = request.is_dry_run(self.engine.config.dry_run)
        request.requested_by, request.requester_kind = requester(caller, request.reason, request.slurm_job)
        request.audited = caller.is_root or not dry_run  # models.SweepRequest.audited
        # InvalidArgument before the sweep counts as running, on the reading the sweep then uses.
        prepared: Prepared = await self.runner.io(self.engine.prepare, request)
        if request.unit:
            unit_report = await self.units.sweep_unit(request, prepared)
            assert unit_report is not None  # None only for the watch's own requests
            return unit_report.to_dict()
        return (await self.runner.run(request, prepared)).to_dict()

    async def reset_gpu(self, caller: Caller, gpu: int, options: dict[str, Any]) -> Wire:
        # Authorized by the interface (the XML's rule for ResetGpu).
        snap = self.inventory.snapshot
        if snap.gpus_known and snap.by_index(gpu) is None:
            known = ", ".join(str(g.index) for g in snap.gpus) or "none"
            raise InvalidArgument(f"GPU index {gpu} out of range (GPUs: {known})")
        return (await self.recovery.reset(gpu, caller.describe(), options.get("reason", ""))).to_dict()

    def history(self, count: int) -> list[Wire]:
        return self.store.newest(count)

    def get_metrics(self) -> str:
        return self.metrics.render().decode()

    async def wait(self, options: dict[str, Any]) -> Wire:
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
        return (await self.gate.wait(gpus, mig, rule, stable_ms / 1000, timeout_ms / 1000)).to_dict()

    async def reload(self, caller: Caller) -> None:
        # Authorized by the interface (the XML's rule for Reload).
        log.info("reload requested by %s", caller.describe())
        await self.reloader()

    def _publish_metrics(self) -> None:
        """Rewrite [Metrics] TextfileDirectory='s file, off the loop."""
        directory = self.engine.config.textfile_directory
        if not directory:
            return
        future = self.io_executor.submit(write_textfile, directory, self.metrics.render())

        def done(f: Future[None]) -> None:
            if f.exception() is not None:
                log.error("cannot write the metrics textfile in %s: %s", directory, f.exception())
        future.add_done_callback(done)

    def inventory_changed(self, snapshot: NvmlSnapshot, summaries: list[GpuSummary]) -> None:
        holders = self.inventory.holders
        self.units.observe(holders)
        self.manager.update(NvmlAvailable=snapshot.available, NvmlError=snapshot.error,
                            DriverVersion=snapshot.driver_version, GpuCount=len(snapshot.gpus),
                            Vendors=snapshot.vendors)
        self.gate.observe(snapshot, summaries, holders)
        current = {s.index: {**s.to_dict(), **self.gate.gpu_values(s.index)} for s in summaries}
        for index in sorted(set(self.gpus) - set(current)):
            log.warning("GPU %d is gone (%s)", index, snapshot.error or "no longer listed by NVML")
            self.bus.unexport(gpu_path(index), self.gpus.pop(index))
        for index, summary in sorted(current.items()):
            gpu = self.gpus.get(index)
            if gpu is None:
                gpu = self.gpus[index] = GpuInterface(summary)
                self.bus.export(gpu_path(index), gpu)
            else:
                gpu.refresh(summary)
        self.metrics.observe_inventory(snapshot.available, summaries, holders)
        self._publish_metrics()
        self.recovery.observe(summaries)
        self.on_change()

    def leak_suspected(self, index: int, uuid: str, used: int) -> None:
        log.warning("GPU %d (%s): %d MiB in use with no process holding it", index, uuid, used // (1024 * 1024))
        self.manager.LeakSuspected(index, uuid, used)

    def sweep_started(self, report_id: str, scope: ReportScope) -> None:
        self.manager.SweepStarted(report_id, marshal.scope(scope.to_dict()))

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str, signal_name: str) -> None:
        self.manager.ProcessTerminated(report_id, pid, comm, unit, signal_name)

    def sweep_finished(self, report: Report) -> None:
        data = self.manager.typed_report(report.to_dict())
        self.manager.SweepFinished(report.id, report.outcome.value, data)
        self.manager.update(LastSweep=data)
        for leak in report.leaks:  # a MIG instance is named by its own UUID
            self.leak_suspected(leak.gpu, leak.mig_uuid or leak.uuid, leak.bytes)
            self.inventory.note_leak_reported(leak.gpu, leak.mig_uuid)
        self.reset_finished(report)

    def busy_changed(self, busy: bool) -> None:
        self.manager.update(Busy=busy)
        # The start gate judges sweeps in flight: judge again now, on the last reading.
        self.inventory.republish()
        self.on_change()

    def reset_finished(self, report: Report) -> None:
        """Recovery's, and the end of every sweep's as well."""
        self.metrics.observe_report(report)
        self._publish_metrics()
        self.inventory.request_rescan()
        self.on_change()

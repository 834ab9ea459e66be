"""What gpuguardd tells the world as things happen: the Manager's properties and signals, one
Gpu object per GPU, the metrics and their textfile, and the start gate's and the unit watch's
view of each new inventory.

service.py says what a call means; this module is the other direction, driven by the
inventory (InventoryListener), the sweeps (runner.SweepEvents) and the resets
(recovery.ResetEvents). The parts it feeds are made after it (they take it as their
listener), so Service hands them over with connect().
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future

from gpuguardd.bus import marshal
from gpuguardd.bus.connection import GuardBus
from gpuguardd.bus.interfaces import GpuInterface, ManagerInterface
from gpuguardd.bus.names import gpu_path
from gpuguardd.config import Config
from gpuguardd.daemon.gate import GateService
from gpuguardd.daemon.inventory import Inventory
from gpuguardd.daemon.metrics import Metrics, write_textfile
from gpuguardd.daemon.recovery import Recovery
from gpuguardd.daemon.units import UnitSweeps
from gpuguardd.records.models import GpuSummary, NvmlSnapshot
from gpuguardd.records.report import Report, ReportScope

log = logging.getLogger("gpuguard.service")


class Publisher:
    inventory: Inventory
    gate: GateService
    units: UnitSweeps
    recovery: Recovery

    def __init__(self, bus: GuardBus, manager: ManagerInterface, metrics: Metrics,
                 config: Callable[[], Config], io_executor: Executor) -> None:
        self.bus = bus
        self.manager = manager
        self.metrics = metrics
        self.config = config
        self.io_executor = io_executor
        self.gpus: dict[int, GpuInterface] = {}
        # Told of every change the sd_notify status line shows (main.py sets it).
        self.on_change: Callable[[], None] = lambda: None

    def connect(self, inventory: Inventory, gate: GateService, units: UnitSweeps,
                recovery: Recovery) -> None:
        self.inventory = inventory
        self.gate = gate
        self.units = units
        self.recovery = recovery

    def _publish_metrics(self) -> None:
        """Rewrite the node_exporter textfile ([Metrics] TextfileDirectory=), off the loop."""
        directory = self.config().textfile_directory
        if not directory:
            return
        future = self.io_executor.submit(write_textfile, directory, self.metrics.render())

        def done(f: Future[str]) -> None:
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
        log.warning("GPU %d (%s): %d MiB in use with no process holding it", index, uuid,
                    used // (1024 * 1024))
        self.manager.LeakSuspected(index, uuid, used)

    def sweep_started(self, report_id: str, scope: ReportScope) -> None:
        self.manager.SweepStarted(report_id, marshal.scope(scope.to_dict()))

    def process_terminated(self, report_id: str, pid: int, comm: str, unit: str,
                           signal_name: str) -> None:
        self.manager.ProcessTerminated(report_id, pid, comm, unit, signal_name)

    def sweep_finished(self, report: Report) -> None:
        data = self.manager.typed_report(report.to_dict())
        self.manager.SweepFinished(report.id, report.outcome.value, data)
        self.manager.update(LastSweep=data)
        for leak in report.leaks:
            # A MIG instance is named by its own UUID.
            self.leak_suspected(leak.gpu, leak.mig_uuid or leak.uuid, leak.bytes)
            self.inventory.note_leak_reported(leak.gpu, leak.mig_uuid)
        self.reset_finished(report)

    def busy_changed(self, busy: bool) -> None:
        self.manager.update(Busy=busy)
        # The start gate judges sweeps in flight: judge again now, on the last reading (a
        # sweep's end asks for a rescan anyway, reset_finished; its start reads the GPUs).
        self.inventory.republish()
        self.on_change()

    def reset_finished(self, report: Report) -> None:
        """ResetEvents, and the end of every sweep's as well."""
        self.metrics.observe_report(report)
        self._publish_metrics()
        self.inventory.request_rescan()
        self.on_change()

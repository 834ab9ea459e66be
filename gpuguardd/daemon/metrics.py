"""Prometheus metrics: counters from finished reports, per-GPU gauges from inventory refreshes,
for node_exporter's textfile collector and GetMetrics (the root daemon needs no network).

Per-GPU series carry dcgm-exporter's `gpu` and `UUID` labels (so queries can join) and `vendor`;
never pid, command or user (unbounded). Every label value maps onto a small fixed set.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from gpuguardd import __version__
from gpuguardd.records.enums import GpuState, HolderKind, LeakKind, Outcome, RequesterKind, SpareReason, Vendor
from gpuguardd.records.models import GpuSummary, Holder, MigSummary
from gpuguardd.records.report import REPORT_RESET, Report
from gpuguardd.safefiles import write_atomic

TEXTFILE_NAME = "gpuguard.prom"
GPU_STATES = tuple(state.value for state in GpuState)
KINDS = tuple(kind.value for kind in HolderKind)
LEAK_KINDS = tuple(kind.value for kind in LeakKind)
VENDORS = tuple(vendor.value for vendor in Vendor)
RESET_OUTCOMES = (Outcome.RESET.value, Outcome.RESET_REFUSED.value, Outcome.RESET_FAILED.value)
SIGNALS = ("SIGTERM", "SIGKILL")
PROCESS_STATES = ("R", "S", "D", "Z", "T", "t", "X", "I")
# Sweeps finish in milliseconds (nothing to do) to minutes (grace + kill + verify timeouts).
SWEEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RELEASE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# The trigger label of each requester kind; anyone else (a non-root "hook:" too) is "manual".
_TRIGGERS: dict[RequesterKind, str] = {
    RequesterKind.HOOK: "hook", RequesterKind.WATCH: "watch", RequesterKind.SLURM: "slurm",
    RequesterKind.RECOVERED: "recovered"}


def trigger_of(report: Report) -> str:
    """Who started a sweep, by the requester kind, never the requested_by or reason words."""
    return _TRIGGERS.get(report.requester_kind, "manual")


# The `why` label of each spared reason; the scope's own rules are "other".
_SPARED: dict[SpareReason, str] = {
    SpareReason.MANAGEMENT: "management", SpareReason.PROTECTED_EXECUTABLE: "protected-executable",
    SpareReason.PROTECTED_UNIT: "protected-unit", SpareReason.INIT: "init",
    SpareReason.KERNEL_THREAD: "kernel-thread", SpareReason.SELF: "self",
    SpareReason.ANCESTOR: "self", SpareReason.EXECUTABLE_UNKNOWN: "executable-unknown"}


def spared_label(code: SpareReason) -> str:
    return _SPARED.get(code, "other")


def _one_of(value: object, allowed: Iterable[str]) -> str:
    return str(value) if str(value) in allowed else "other"


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        bounds = [*(repr(float(b)) for b in self.bounds), "+Inf"]
        return HistogramMetricFamily(name, documentation, buckets=list(zip(bounds, accumulate(self.counts))),
                                     sum_value=self.total)


class Metrics:
    """observe_* are called from the event loop; collect() may run in another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sweeps: Counter[tuple[str, str]] = Counter()
        self._resets: Counter[str] = Counter()
        self._dry_runs = 0
        self._terminated: Counter[str] = Counter()
        self._survived: Counter[str] = Counter()
        self._spared: Counter[str] = Counter()
        self._reclaimed = 0
        self._duration = _Histogram(SWEEP_BUCKETS)
        self._release = _Histogram(RELEASE_BUCKETS)
        self._last_sweep = 0.0
        self._nvml_up = False
        self._gpus: list[dict[str, Any]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe_report(self, report: Report) -> None:
        with self._lock:
            if report.kind == REPORT_RESET:
                # A GPU reset is no sweep: counted by outcome alone (a fixed set).
                self._resets[_one_of(report.outcome.value, RESET_OUTCOMES)] += 1
                return
            if report.dry_run:
                # Anyone may dry-run, as often as they like: never in a real sweep's series.
                self._dry_runs += 1
                return
            outcome = report.outcome.value
            self._sweeps[(outcome, trigger_of(report))] += 1
            self._terminated.update(_one_of(e.signal or "none", (*SIGNALS, "none")) for e in report.terminated)
            self._survived.update(_one_of(s.state, PROCESS_STATES) for s in report.survived)
            self._spared.update(spared_label(s.code) for s in report.spared)
            duration = max(0, report.duration_ms) / 1000.0
            self._duration.observe(duration)
            self._reclaimed += sum(max(0, gpu.memory_used_before - gpu.memory_used_after) for gpu in report.gpus)
            # A freed sweep ends when NVML shows the memory back: request to usable memory.
            if outcome == Outcome.FREED:
                self._release.observe(duration)
            self._note_finished(report)

    def _note_finished(self, report: Report) -> None:
        self._last_sweep = max(self._last_sweep, report.started_usec / 1e6 + report.duration_ms / 1e3)

    def note_history(self, last: Report | None) -> None:
        """The newest report from before a restart: its time, not its counts (rate() expects zero)."""
        if last:
            with self._lock:
                self._note_finished(last)

    def observe_inventory(self, nvml_available: bool, summaries: list[GpuSummary], holders: Iterable[Holder]) -> None:
        kinds: defaultdict[int, Counter[str]] = defaultdict(Counter)
        for holder in holders:
            for index in holder.gpus:
                kinds[index][_one_of(holder.kind, KINDS)] += 1
        gpus: list[dict[str, Any]] = []
        for summary in summaries:
            units: list[GpuSummary | MigSummary] = [summary, *(summary.mig_instances or [])]
            gpus.append({"gpu": str(summary.index), "UUID": summary.uuid, "vendor": _one_of(summary.vendor, VENDORS),
                         "state": summary.state.value, "memory_used": summary.memory_used,
                         "holders": kinds.get(summary.index, {}),
                         # (UUID, leak kind, bytes): the GPU's and each MIG instance's leak
                         "leaks": [(u.uuid, _one_of(u.leak_kind, LEAK_KINDS), u.memory_used)
                                   for u in units if u.state == GpuState.LEAKED]})
        with self._lock:
            self._nvml_up = nvml_available
            self._gpus = gpus

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sweeps = CounterMetricFamily("gpuguard_sweeps", "Sweeps finished, by outcome and trigger.",
                                         labels=["outcome", "trigger"])
            for (outcome, by), count in sorted(self._sweeps.items()):
                sweeps.add_metric([outcome, by], count)
            yield sweeps
            yield CounterMetricFamily("gpuguard_dry_runs", "Dry runs answered (anyone may ask for one).",
                                      value=self._dry_runs)
            for name, documentation, label, counts in (
                    ("gpuguard_processes_terminated", "Processes ended by a sweep, by the signal that ended them.",
                     "signal", self._terminated),
                    ("gpuguard_processes_survived", "Processes that outlived a sweep, by process state.",
                     "state", self._survived),
                    ("gpuguard_processes_spared", "Processes a sweep left alone on purpose, by why.",
                     "why", self._spared)):
                family = CounterMetricFamily(name, documentation, labels=[label])
                for value, count in sorted(counts.items()):
                    family.add_metric([value], count)
                yield family
            yield self._duration.family("gpuguard_sweep_duration_seconds", "Time a sweep took.")
            yield self._release.family("gpuguard_memory_release_seconds",
                                       "Time from a sweep's start until NVML showed the memory released.")
            yield CounterMetricFamily("gpuguard_memory_reclaimed_bytes",
                                      "GPU memory that sweeps gave back.", value=self._reclaimed)
            leaked = GaugeMetricFamily("gpuguard_leaked_memory_bytes",
                                       "GPU memory in use with no process holding the GPU.",
                                       labels=["gpu", "UUID", "vendor"])
            holders = GaugeMetricFamily("gpuguard_gpu_holders", "Processes holding the GPU, by kind.",
                                        labels=["gpu", "UUID", "vendor", "kind"])
            state = GaugeMetricFamily("gpuguard_gpu_state", "1 for the GPU's current state, 0 for the others.",
                                      labels=["gpu", "UUID", "vendor", "state"])
            by_kind = GaugeMetricFamily("gpuguard_leaked_memory_by_kind_bytes",
                                        "Leaked GPU memory by leak kind, per GPU or MIG instance (UUID).",
                                        labels=["gpu", "UUID", "vendor", "kind"])
            for gpu in self._gpus:
                ids = [gpu["gpu"], gpu["UUID"], gpu["vendor"]]
                leaked.add_metric(ids, gpu["memory_used"] if gpu["state"] == GpuState.LEAKED else 0)
                for kind in KINDS:
                    holders.add_metric([*ids, kind], gpu["holders"].get(kind, 0))
                for name in GPU_STATES:
                    state.add_metric([*ids, name], 1 if gpu["state"] == name else 0)
                for uuid, kind, used in gpu["leaks"]:
                    by_kind.add_metric([gpu["gpu"], uuid, gpu["vendor"], kind], used)
            yield leaked
            yield by_kind
            resets = CounterMetricFamily("gpuguard_gpu_resets", "GPU resets, by outcome.", labels=["outcome"])
            for outcome in RESET_OUTCOMES:
                resets.add_metric([outcome], self._resets.get(outcome, 0))
            yield resets
            yield holders
            yield state
            yield GaugeMetricFamily("gpuguard_last_sweep_timestamp_seconds",
                                    "When the newest sweep finished (Unix time; 0: none yet).",
                                    value=self._last_sweep)
            yield GaugeMetricFamily("gpuguard_nvml_up", "1 when NVML answers, 0 when it is unavailable.",
                                    value=1 if self._nvml_up else 0)
            info = GaugeMetricFamily("gpuguard_build_info", "gpuguard's version.", labels=["version"])
            info.add_metric([__version__], 1)
            yield info

    def render(self) -> bytes:
        return generate_latest(self.registry)


def write_textfile(directory: str, data: bytes) -> None:
    """Replaced atomically; the temporary name does not end in .prom, so the collector ignores it."""
    write_atomic(os.path.join(directory, TEXTFILE_NAME), [data], prefix=".gpuguard.tmp-")

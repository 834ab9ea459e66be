"""`gpuguardctl wait`, the start gate (ExecStartPre=, Slurm Prolog=): exit 0 once the GPUs are free.

"Free" is engine/gate.py's rule, judged by the daemon (Manager.Wait, called again until --timeout) or,
with --local, here. CUDA_VISIBLE_DEVICES names the GPUs when nothing else does (an ExecStartPre= has the
unit's Environment=); its numbers are NVML indices, CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from gpuguardd.cli import output
from gpuguardd.cli.exits import EXIT_GATE_TIMEOUT, error_exit
from gpuguardd.errors import GpuGuardError, InvalidArgument
from gpuguardd.escaping import escape_text
from gpuguardd.numbers import is_digits
from gpuguardd.records.selectors import selector

log = logging.getLogger("gpuguard.cli")

NO_GPUS = {"", "none", "void", "NoDevFiles"}  # CUDA (or the NVIDIA container runtime) sees no GPU
ONE_CALL_SEC = 20.0  # what the daemon grants one Wait call
PROGRESS_CALL_SEC = 1.0  # on a terminal: a Wait call per second, for the progress line
LOCAL_POLL_SEC = 0.25  # --local: each observation is a full holder scan
SLURM_PROLOG_TIMEOUT_SEC = 60.0  # under a PrologEpilogTimeout of 120 s (the epilog's advice)


def visible_devices(value: str, name: str) -> list[str] | None:
    """Selectors for a CUDA_VISIBLE_DEVICES list: None for "all", [] for none. As in CUDA, a negative
    ordinal ends the list ("-1" hides everything)."""
    text = value.strip()
    if text == "all":
        return None
    if text in NO_GPUS:
        return []
    chosen: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if token.startswith("-"):
            break
        try:
            selector(token).check()
        except InvalidArgument as exc:
            raise InvalidArgument(f"{name}: {exc}") from None
        chosen.append(token)
    return chosen


def selectors_from(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str] | None:
    if args.gpu:
        return list(args.gpu)
    if args.cuda_visible_devices is not None:
        return visible_devices(args.cuda_visible_devices, "--cuda-visible-devices")
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if name in environ:
            return visible_devices(environ[name], name)
    return None


def describe(result: Mapping[str, Any]) -> list[str]:
    lines = [f"waiting on: {escape_text(str(w))}" for w in result.get("waiting_on", [])]
    for gpu in result.get("gpus", []):
        used = output.human_bytes(int(gpu.get("memory_used", 0)))
        waits = [escape_text(str(w)) for w in gpu.get("waiting_on", [])]
        lines.append(f"{_name(gpu)}: {used} used; {'; '.join(waits)}" if waits
                     else f"{_name(gpu)}: {used} used, free and steady for {int(gpu.get('stable_ms', 0)) / 1000:.1f} s")
    return lines


def _name(gpu: Mapping[str, Any]) -> str:
    return f"GPU {gpu.get('index', '?')}" + (f" {escape_text(str(gpu['mig_uuid']))}" if gpu.get("mig_uuid") else "")


def poll(call: Callable[[float], dict[str, Any]], timeout: float | None, out: TextIO,
         progress: bool) -> tuple[bool, dict[str, Any], float]:
    """`call(seconds)` until free or `timeout`, with a progress line: (free, last result, seconds waited)."""
    started = time.monotonic()
    while True:
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        step = PROGRESS_CALL_SEC if progress else ONE_CALL_SEC
        result = call(step if left is None else min(step, left))
        waited = time.monotonic() - started
        if progress:
            out.write(f"\r\033[K[{waited:5.1f} s] {' | '.join(describe(result))}"[:400])
            out.flush()
        if result.get("free") or (timeout is not None and waited >= timeout):
            return bool(result.get("free")), result, waited


def local_call(backend: Any, selectors: list[str] | None, free_below: int, stable_sec: float,
               allow_unverified: bool, tolerance: int) -> Callable[[float], dict[str, Any]]:
    """--local: the gate's rule on a scan per poll (no daemon: no sweeps to wait for)."""
    from gpuguardd.cli.check import _selected
    from gpuguardd.engine.gate import GateRule, GateTracker, MiB, Target, outcome, targets_of
    from gpuguardd.engine.gpustate import gpu_summaries

    tracker = GateTracker(GateRule(free_below, tolerance, allow_unverified))
    engine = backend.engine
    wanted = selectors or []
    seen: set[str] = set()

    def once(record: logging.LogRecord) -> bool:
        """Each distinct warning once: every poll scans again and finds the same."""
        new = record.getMessage() not in seen
        seen.add(record.getMessage())
        return new
    # On the "gpuguard" logger's handlers (setup_logging's): a caller's root handlers are left alone.
    for handler in logging.getLogger("gpuguard").handlers:
        handler.addFilter(once)

    def chosen(gpus: list[Any]) -> list[Target]:
        every = targets_of(gpus)
        if not wanted or not gpus:  # no GPU list: judged below on the holders, as `check` is
            return every
        return [t for gpu, instance in _selected(gpus, wanted) for t in every
                if t.index == gpu.index and t.mig_uuid == (instance.uuid if instance else "")]

    def call(seconds: float) -> dict[str, Any]:
        started = time.monotonic()
        while True:
            scan = engine.scan()
            error = None if scan.nvml.gpus_known else (scan.nvml.error or "unavailable")
            gpus = gpu_summaries(scan, engine.config.released_below_mib * MiB) if error is None else []
            tracker.observe(time.monotonic(), time.time_ns() // 1000, gpus, scan.holders, error, ())
            # No GPU list: the holders of the GPUs asked for by index (as the daemon).
            found = outcome(tracker, chosen(gpus), scan.holders, error, [int(w) for w in wanted if w.isdigit()],
                            bool(wanted), started, time.monotonic())
            short = found.short_of(stable_sec)
            found.free, found.waiting_on = short is not None and short <= 0, sorted(found.waiting_on)
            if found.free or found.now >= started + seconds:
                return found.to_dict()
            time.sleep(min(LOCAL_POLL_SEC, max(0.0, started + seconds - found.now)))
    return call


def run(backend: Any, args: argparse.Namespace, out: TextIO) -> int:
    """With --slurm-prolog every failure is one line on stdout, the drain reason."""
    try:
        if args.sweep_leftovers:
            from gpuguardd.cli.sweep import sweep_through_restarts
            from gpuguardd.records.models import SweepRequest
            report = sweep_through_restarts(backend, SweepRequest(
                unit=args.sweep_leftovers, reason=f"gate: leftovers of {args.sweep_leftovers}"), args)
            output.print_report(report, sys.stderr)  # the gate below judges what is left
        return gate(backend, args, out)
    except GpuGuardError as exc:
        if not args.slurm_prolog:
            raise
        job = os.environ.get("SLURM_JOB_ID", "?")
        line = f"gpuguard: job {job if is_digits(job) else '?'}: prolog failed: {escape_text(str(exc))}"
        log.error("%s", line)
        out.write(line[:240] + "\n")
        return error_exit(exc)


def gate(backend: Any, args: argparse.Namespace, out: TextIO) -> int:
    """0 when free, EXIT_GATE_TIMEOUT at --timeout, with what holds the GPUs (the drain reason)."""
    from gpuguardd.cli.client import DBusBackend
    from gpuguardd.engine.gate import MiB

    prefix = "gpuguard: "
    selectors: list[str] | None
    if args.slurm_prolog:
        from gpuguardd.engine import slurm
        job = slurm.epilog_job(os.environ, "--slurm-prolog")
        prefix = f"gpuguard: job {job.job_id}: "
        selectors, warnings = slurm.gpu_selectors(job.minors, backend.gpus())
        sys.stderr.writelines(f"gpuguardctl: {warning}\n" for warning in warnings)
        if not job.minors:
            selectors = []
    else:
        selectors = selectors_from(args, os.environ)
    if selectors == []:
        output.print_json({"free": True, "gpus": [], "waiting_on": []}, out) if args.json \
            else out.write(f"{prefix}no GPUs to wait for (the job or unit sees none)\n")
        return 0
    given = {"free_below_mib": args.free_below, "stable_ms": None if args.stable is None else int(args.stable * 1000),
             "allow_unverified": args.allow_unverified or None}
    options = {key: value for key, value in given.items() if value is not None}
    timeout = SLURM_PROLOG_TIMEOUT_SEC if args.timeout is None and args.slurm_prolog else args.timeout
    call: Callable[[float], dict[str, Any]]
    if isinstance(backend, DBusBackend):
        def call(seconds: float) -> dict[str, Any]:
            return backend.wait(selectors or [], {**options, "timeout_ms": int(seconds * 1000)})
    else:
        config = backend.engine.config
        call = local_call(backend, selectors, options.get("free_below_mib", config.gate_free_below_mib) * MiB,
                          args.stable if args.stable is not None else config.gate_stable_sec,
                          args.allow_unverified, config.gate_tolerance_mib * MiB)
    progress = out.isatty() and not args.json
    free, result, waited = poll(call, timeout, out, progress)
    if progress:
        out.write("\n")
    if args.json:
        output.print_json({**result, "free": free, "waited_ms": int(waited * 1000)}, out)
        return 0 if free else EXIT_GATE_TIMEOUT
    if free:
        names = ", ".join(_name(g) for g in result.get("gpus", [])) or "no GPU"
        out.write(f"{prefix}free after {waited:.1f} s: {names}\n")
        return 0
    text = f"{prefix}not free after {waited:.0f} s: " + "; ".join(describe(result))
    # A node's drain reason: one short line in sinfo.
    out.write((text[:slurm.MAX_REASON] if args.slurm_prolog else text) + "\n")
    return EXIT_GATE_TIMEOUT

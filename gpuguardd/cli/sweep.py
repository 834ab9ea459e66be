"""`gpuguardctl sweep`; with --slurm-epilog, the finished job's sweep, whose exit status is the drain decision.

If gpuguardd dies during a sweep (crash, OOM kill, upgrade), the request, safe to repeat, is sent again once
it is back: the restarted daemon finishes its predecessor's sweep (daemon/units.py) and the call joins it.
After RETRY_SEC root sweeps locally. The words also go to the journal, which an admin's terminal does not reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import TextIO

from gpuguardd.cli import output
from gpuguardd.cli.backend import Backend, LocalBackend, local
from gpuguardd.cli.exits import EXIT_ERROR, EXIT_NOT_RELEASED, EXIT_OK, error_exit, outcome_exit
from gpuguardd.errors import DaemonUnavailable, GpuGuardError
from gpuguardd.log import journal_too
from gpuguardd.records.enums import Outcome, RequesterKind
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report

log = logging.getLogger("gpuguard.cli")

# Under the drop-in's 80 s timeout even after a long sweep; systemd's Restart=on-failure
# (RestartSec=1s) brings the daemon back in a second or two.
RETRY_SEC = 30.0
RETRY_INTERVAL_SEC = 0.5


def run(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    if args.slurm_epilog:
        return run_slurm_epilog(backend, args, out)
    request = SweepRequest(gpus=args.gpu, unit=args.unit, container=args.container, grace_ms=args.grace,
                           dry_run=args.dry_run, include_management=args.include_management, reason=args.reason)
    report = sweep_through_restarts(backend, request, args)
    output.print_json(report.to_dict(), out) if args.json else output.print_report(report, out)
    return outcome_exit(report.outcome)


def _drain(line: str, out: TextIO) -> None:
    log.error("%s", line)
    out.write(line + "\n")


def run_slurm_epilog(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """Bounded by --deadline. stdout is the drain reason (one line, only when the exit status is not
    0) or, with --json, the report; the human report goes to stderr, which slurmd logs."""
    import threading

    from gpuguardd.engine import slurm
    from gpuguardd.numbers import BadNumber, parse_job_id

    try:
        job_id = parse_job_id(os.environ.get("SLURM_JOB_ID", ""))
    except BadNumber:
        job_id = "?"
    try:
        job = slurm.epilog_job(os.environ)
        job_id = job.job_id
        try:
            gpus = backend.gpus()
        except GpuGuardError as exc:
            log.warning("no GPU list (%s): device minors taken to be NVML indices", exc)
            gpus = []
        selectors, warnings = slurm.gpu_selectors(job.minors, gpus)
        for warning in warnings:
            log.warning("%s", warning)
        reason = job.reason + (f" {args.reason}" if args.reason else "")
        request = SweepRequest(gpus=selectors, grace_ms=slurm.EPILOG_GRACE_MS if args.grace is None else args.grace,
                               dry_run=args.dry_run, include_management=args.include_management, reason=reason,
                               slurm_job=job.job_id, slurm_uid=job.uid, requester_kind=RequesterKind.SLURM)
        deadline = (args.deadline if args.deadline is not None else slurm.EPILOG_DEADLINE_MS) / 1000
        result: list[Report | BaseException] = []

        def work() -> None:
            try:
                result.append(sweep_through_restarts(backend, request, args))
            except BaseException as exc:  # handed to the main thread
                result.append(exc)
        worker = threading.Thread(target=work, name="gpuguard-epilog", daemon=True)
        worker.start()
        worker.join(deadline)
        if not result:
            _drain(f"gpuguard: job {job_id}: no result within the {deadline:g} s deadline", out)
            return EXIT_ERROR
        if isinstance(result[0], BaseException):
            raise result[0]
        report = result[0]
    except GpuGuardError as exc:
        _drain(slurm.summary(job_id, Report(outcome=Outcome.ERROR, error=str(exc))), out)
        return error_exit(exc)
    output.print_report(report, sys.stderr)
    code = outcome_exit(report.outcome)
    if code == EXIT_NOT_RELEASED and args.reset_leaked and reset_leaks(backend, report, job_id):
        code = EXIT_OK
    if args.json:
        output.print_json(report.to_dict(), out)
    elif code != EXIT_OK:
        out.write(slurm.summary(job_id, report) + "\n")
    return code


def reset_leaks(backend: Backend, report: Report, job_id: str) -> bool:
    """Reset each GPU the sweep left leaked, when leaks alone kept its memory (no survivor, no MIG
    instance: a reset takes every tenant's instance). True when every reset was done and verified."""
    unreleased = {g.index for g in report.gpus if not g.released}
    leaked = {leak.gpu for leak in report.leaks if not leak.mig_uuid}
    if report.survived or not leaked or unreleased - leaked or any(leak.mig_uuid for leak in report.leaks):
        return False
    for gpu in sorted(leaked):
        try:
            reset = backend.reset(str(gpu), f"slurm epilog of job {job_id}: leaked memory")
        except GpuGuardError as exc:
            log.error("GPU %d: reset failed: %s", gpu, exc)
            return False
        output.print_report(reset, sys.stderr)
        if reset.outcome != Outcome.RESET:
            return False
    return True


def _warn(message: str) -> None:
    log.warning("%s", message)
    journal_too("gpuguardctl", logging.WARNING, message)


def sweep_through_restarts(backend: Backend, request: SweepRequest, args: argparse.Namespace) -> Report:
    """If the daemon vanishes during the sweep, again on a new connection until it answers or
    RETRY_SEC pass, then locally as root."""
    if isinstance(backend, LocalBackend):
        return backend.sweep(request)
    from gpuguardd.cli.client import DBusBackend

    try:
        return backend.sweep(request)
    except DaemonUnavailable as exc:
        what = f"the sweep of {request.unit or 'its scope'}"
        _warn(f"gpuguardd stopped during {what} ({exc}); retrying")
    deadline = time.monotonic() + RETRY_SEC
    last: Exception | None = None
    while time.monotonic() < deadline:
        time.sleep(RETRY_INTERVAL_SEC)
        try:
            report = DBusBackend(bus_address=args.bus_address).sweep(dataclasses.replace(request))
        except DaemonUnavailable as exc:
            last = exc
            continue
        _warn(f"gpuguardd stopped during {what}; the restarted gpuguardd finished it: "
              f"sweep {report.id[:8]}, {report.outcome}")
        return report
    gone = f"gpuguardd stopped during {what} and did not come back within {RETRY_SEC:.0f} s ({last})"
    if os.geteuid() != 0:
        raise DaemonUnavailable(f"{gone}; as root, sweep again with --local")
    _warn(f"{gone}; sweeping with the local engine")
    report = local(args).sweep(dataclasses.replace(request))
    _warn(f"gpuguardd stopped during {what}; finished locally: {report.outcome}")
    return report

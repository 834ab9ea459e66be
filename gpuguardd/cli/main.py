"""gpuguardctl: the admin's command line, over D-Bus or (with --local) the engine in-process.

Start-up matters (a hook runs it at every unit stop, an admin at a prompt, a script in a loop):
a verb imports only what it uses. The engine (NVML, /proc scanning) is imported by --local only,
dbus-fast by the verbs that ask the daemon, asyncio by the verbs that need an event loop.
bench/bench_startup.py measures it; tests/unit/test_cli_imports.py keeps it so.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

from gpuguardd import __version__
from gpuguardd.cli import hook
from gpuguardd.errors import ConfigError, DaemonUnavailable, GpuGuardError, InvalidArgument, NotAuthorized
from gpuguardd.log import setup_logging
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import GpuSummary, Holder, SweepRequest
from gpuguardd.records.report import Report
from gpuguardd.safetext import user_name
from gpuguardd.systemd import dropins

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SURVIVORS = 3
EXIT_NOT_RELEASED = 4
EXIT_NOT_AUTHORIZED = 5
EXIT_UNVERIFIED = 6
EXIT_NOT_FREE = 7
EXIT_GATE_TIMEOUT = 8  # `wait`: the GPUs were not free by --timeout

OUTCOME_EXIT = {
    Outcome.FREED: EXIT_OK,
    Outcome.NOTHING: EXIT_OK,
    Outcome.DRY_RUN: EXIT_OK,
    Outcome.SURVIVORS: EXIT_SURVIVORS,
    Outcome.NOT_RELEASED: EXIT_NOT_RELEASED,
    Outcome.UNVERIFIED: EXIT_UNVERIFIED,
    Outcome.ERROR: EXIT_ERROR,
    Outcome.RESET: EXIT_OK,
    Outcome.RESET_REFUSED: EXIT_NOT_FREE,  # something holds the GPU
    Outcome.RESET_FAILED: EXIT_ERROR,
}



def error_exit(exc: GpuGuardError) -> int:
    """The exit status of a failure, for every verb: the one table beside OUTCOME_EXIT."""
    if isinstance(exc, (ConfigError, InvalidArgument)):
        return EXIT_USAGE
    if isinstance(exc, NotAuthorized):
        return EXIT_NOT_AUTHORIZED
    return EXIT_ERROR


log = logging.getLogger("gpuguard.cli")
# How many of the newest reports `check` reads for GPUs a reset recovered.
RECENT_REPORTS = 20


class Backend(Protocol):
    def status(self) -> dict[str, Any]: ...

    def gpus(self) -> list[GpuSummary]: ...

    def holders(self, gpus: list[str], unit: str, container: str,
                include_protected: bool) -> list[Holder]: ...

    def sweep(self, request: SweepRequest) -> Report: ...

    def history(self, count: int) -> list[Report]: ...

    def reset(self, gpu: int, reason: str) -> Report: ...


def requester_description() -> str:
    uid = os.getuid()
    return f"uid {uid} ({user_name(uid)}) via gpuguardctl --local"


class LocalBackend:
    """The engine in this process: for root, when no daemon runs (or --local is given)."""

    def __init__(self, config_files: Sequence[str] | None, bus_address: str | None = None) -> None:
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
                "config_files": list(config.sources)}

    def gpus(self) -> list[GpuSummary]:
        from gpuguardd.engine.gpustate import all_summaries

        scan = self.engine.scan()
        return all_summaries(scan, self.engine.config.released_below_mib * 1024 * 1024, self.engine.device_map())

    def holders(self, gpus: list[str], unit: str, container: str,
                include_protected: bool) -> list[Holder]:
        from gpuguardd.engine.engine import HolderFilter

        scope, _, _ = self.engine.resolve_request(SweepRequest(gpus=gpus, unit=unit,
                                                               container=container))
        found, scan = self.engine.list_holders(HolderFilter(
            gpus=scope.gpus, unit=scope.unit, container=scope.container, mig=scope.mig,
            include_protected=include_protected))
        for warning in scan.warnings:
            log.warning("%s", warning)
        return found

    def sweep(self, request: SweepRequest) -> Report:
        # The ExecStopPost drop-in says who it is in --reason "hook:<unit> ..."; the daemon
        # records such a sweep as requested by "hook:<unit>", and so does the local fallback.
        request.requested_by = (request.requested_by or dropins.requested_by_for_reason(request.reason)
                                or requester_description())
        if request.unit:
            self.engine.resolve_request(request)  # a bad unit name is refused before anything
            import asyncio

            return asyncio.run(self._sweep_unit(request))
        return self.engine.sweep(request)

    def reset(self, gpu: int, reason: str) -> Report:
        return self.engine.reset_gpu(gpu, requester_description(), reason)

    async def _sweep_unit(self, request: SweepRequest) -> Report:
        """The daemon's code path (unitsweep.py): escaped leftovers, one sweep per stop."""
        from gpuguardd.records.models import ScanResult
        from gpuguardd.systemd.client import local_systemd  # dbus-fast only where a unit is swept
        from gpuguardd.systemd.unitsweep import UnitSweeps

        async def scan() -> ScanResult:
            return self.engine.scan()

        async def run(wanted: SweepRequest) -> Report:
            return self.engine.sweep(wanted)

        systemd, bus = await local_systemd(self.bus_address)
        try:
            sweeps = UnitSweeps(systemd, scan, run, lambda: self.engine.config.dry_run)
            report = await sweeps.sweep_unit(request)
        finally:
            if bus is not None:
                bus.disconnect()
        assert report is not None  # None only for the daemon's watcher's own requests
        return report

    def history(self, count: int) -> list[Report]:
        raise InvalidArgument("history is kept by the daemon; it is not available with --local")


def connect(args: argparse.Namespace) -> Backend:
    """The daemon if it answers; the local engine when asked, or for root's sweep as fallback."""
    if args.local:
        if args.verb == "watch":
            raise InvalidArgument("watch shows the daemon's signals; it is not available with --local")
        return _local(args)
    try:
        from gpuguardd.cli.client import DBusBackend
        # bus_address None: $GPUGUARD_BUS_ADDRESS, else the system bus (decided in the client).
        return DBusBackend(bus_address=getattr(args, "bus_address", None))
    except (ImportError, DaemonUnavailable) as exc:
        if args.verb == "sweep" and os.geteuid() == 0:
            log.warning("no gpuguardd answers (%s); sweeping with the local engine", exc or "not installed")
            return _local(args)
        raise DaemonUnavailable(
            f"no gpuguardd answers ({exc or 'not installed'}); as root, use --local") from None


def sweep_through_restarts(backend: Backend, request: SweepRequest,
                           args: argparse.Namespace) -> Report:
    """backend.sweep, finished even when gpuguardd dies during it (retry.py)."""
    if isinstance(backend, LocalBackend):
        return backend.sweep(request)
    import dataclasses

    from gpuguardd.cli import retry
    from gpuguardd.cli.client import DBusBackend

    def again() -> Report:
        return DBusBackend(bus_address=args.bus_address).sweep(dataclasses.replace(request))

    def local() -> Report:
        return _local(args).sweep(dataclasses.replace(request))

    return retry.sweep(lambda: backend.sweep(request), again, local, request)


def _local(args: argparse.Namespace) -> Backend:
    if os.geteuid() != 0:
        log.warning("running --local as a non-root user: processes of other users are invisible")
    from gpuguardd.bus.names import default_address
    return LocalBackend(args.config, default_address(args.bus_address))


def _grace(text: str) -> int:
    from gpuguardd.config import MAX_GRACE_SEC, parse_timespan

    try:
        seconds = parse_timespan(text, MAX_GRACE_SEC)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return int(seconds * 1000)


def _positive(text: str) -> int:
    from gpuguardd.numbers import parse_uint

    try:
        return parse_uint(text, "count", minimum=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mib(text: str) -> int:
    from gpuguardd.config import MAX_RELEASED_BELOW_MIB
    from gpuguardd.numbers import parse_uint

    try:
        return parse_uint(text, "MiB", MAX_RELEASED_BELOW_MIB, 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _span(text: str, maximum: float) -> float:
    from gpuguardd.config import parse_timespan

    try:
        return parse_timespan(text, maximum)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _stable(text: str) -> float:
    from gpuguardd.config import MAX_GATE_STABLE_SEC

    return _span(text, MAX_GATE_STABLE_SEC)


def _timeout(text: str) -> float:
    return _span(text, 24 * 3600.0)


def _gpu(text: str) -> str:
    """A --gpu as typed (the backend resolves it), once it names a GPU at all: an index in
    ASCII digits within range, or a GPU-/MIG- UUID (selectors.py)."""
    from gpuguardd.records.selectors import selector

    try:
        selector(text).check()
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _gpu_index(text: str) -> int:
    from gpuguardd.numbers import parse_gpu_index

    try:
        return parse_gpu_index(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    common.add_argument("--local", action="store_true", default=argparse.SUPPRESS,
                        help="run the engine in this process instead of asking gpuguardd (root)")
    common.add_argument("--config", action="append", metavar="FILE", default=argparse.SUPPRESS,
                        help="with --local: read FILE instead of /etc/gpuguard (repeatable)")
    common.add_argument("--bus-address", metavar="ADDRESS", default=argparse.SUPPRESS,
                        help="talk to gpuguardd on this D-Bus address instead of the system bus")

    parser = argparse.ArgumentParser(
        prog="gpuguardctl", parents=[common],
        description="Find and safely end processes that keep NVIDIA GPUs busy.")
    parser.add_argument("--version", action="version", version=f"gpuguardctl {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    verbs.add_parser("status", parents=[common], help="daemon and NVML state")
    verbs.add_parser("gpus", parents=[common], help="GPUs, memory and holder counts")

    def scope_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gpu", action="append", default=[], type=_gpu, metavar="N|UUID",
                       help="only this GPU (repeatable)")
        p.add_argument("--unit", default="", metavar="UNIT", help="only this systemd unit")
        p.add_argument("--container", default="", metavar="ID",
                       help="only this container (lxc/129, docker/3f2a...)")

    holders = verbs.add_parser("holders", parents=[common], help="processes holding GPUs")
    scope_args(holders)
    holders.add_argument("--hide-protected", action="store_true",
                         help="leave out processes a sweep would never touch")

    sweep = verbs.add_parser("sweep", parents=[common],
                             help="end the holders in a scope and verify the memory came back")
    scope_args(sweep)
    sweep.add_argument("--grace", type=_grace, default=None, metavar="SEC",
                       help="time between SIGTERM and SIGKILL (default: GraceSec)")
    sweep.add_argument("--dry-run", action="store_true", default=None,
                       help="report what would be done, signal nothing")
    sweep.add_argument("--include-management", action="store_true",
                       help="also end management clients (nvidia-smi, exporters)")
    sweep.add_argument("--reason", default="", help="recorded in the report and the journal")
    sweep.add_argument("--slurm-epilog", action="store_true",
                       help="as Slurm's Epilog=: the finished job's leftovers (SLURM_JOB_ID, "
                            "SLURM_JOB_UID, SLURM_JOB_GPUS); the exit status is the drain decision")
    sweep.add_argument("--reset-leaked", action="store_true",
                       help="with --slurm-epilog: when only leaked memory (nothing holding it) "
                            "would drain the node, reset those GPUs first; drain if that fails")
    sweep.add_argument("--deadline", type=_grace, default=None, metavar="SEC",
                       help="with --slurm-epilog: give up (exit 1) after this long (default 60s)")

    check = verbs.add_parser("check", parents=[common],
                             help="exit 0 when the GPUs have no compute holder and no leaked memory")
    check.add_argument("--gpu", action="append", default=[], type=_gpu, metavar="N|UUID",
                       help="only this GPU or MIG instance (repeatable; default: all)")

    wait = verbs.add_parser("wait", parents=[common],
                            help="wait until the GPUs are free for the next job (the start gate)")
    wait.add_argument("--gpu", action="append", default=[], type=_gpu, metavar="N|UUID",
                      help="this GPU or MIG instance (repeatable; default: CUDA_VISIBLE_DEVICES "
                           "or NVIDIA_VISIBLE_DEVICES from the environment, else all)")
    wait.add_argument("--cuda-visible-devices", default=None, metavar="LIST",
                      help="the GPUs as a CUDA_VISIBLE_DEVICES value")
    wait.add_argument("--free-below", type=_mib, default=None, metavar="MIB",
                      help="memory in use must be below this (default: [Gate] FreeBelowMiB)")
    wait.add_argument("--stable", type=_stable, default=None, metavar="SEC",
                      help="free and steady this long (default: [Gate] StableSec)")
    wait.add_argument("--timeout", type=_timeout, default=None, metavar="SEC",
                      help=f"give up after this long with exit status {EXIT_GATE_TIMEOUT} "
                           "(default: wait for ever; 60s with --slurm-prolog)")
    wait.add_argument("--sweep-leftovers", default="", metavar="UNIT",
                      help="first sweep what the unit that ran there before left behind")
    wait.add_argument("--allow-unverified", action="store_true",
                      help="let GPUs whose memory cannot be read (no NVML) pass on holders alone")
    wait.add_argument("--slurm-prolog", action="store_true",
                      help="as Slurm's Prolog=: the job's GPUs (SLURM_JOB_GPUS); stdout is the "
                           "drain reason when the exit status is not 0")

    reset = verbs.add_parser("reset", parents=[common],
                             help="reset a GPU that nothing holds (frees leaked memory)")
    reset.add_argument("--gpu", required=True, type=_gpu_index, metavar="N",
                       help="the GPU's NVML index")
    reset.add_argument("--reason", default="", help="recorded in the report and the journal")

    history = verbs.add_parser("history", parents=[common], help="past sweep reports")
    history.add_argument("-n", "--count", type=_positive, default=10, help="how many (newest first)")

    verbs.add_parser("watch", parents=[common],
                     help="print the daemon's signals (sweeps, terminations, leaks) as they come")

    # `hook install|remove|list`: ExecStopPost drop-ins (systemd/dropins.py, cli/hook.py); needs no daemon.
    hook.add_parser(verbs, common)
    return parser


def _defaults(args: argparse.Namespace) -> None:
    for name, value in (("json", False), ("local", False), ("config", None), ("bus_address", None)):
        if not hasattr(args, name):
            setattr(args, name, value)


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _defaults(args)
    setup_logging("gpuguardctl")
    if args.config and not args.local:
        parser.error("--config only applies with --local (the daemon reads its own files)")
    out = sys.stdout
    from gpuguardd.cli import output

    if args.verb == "hook":
        return hook.run_command(args, out)
    if args.verb == "sweep" and (args.gpu or args.unit or args.container) and args.slurm_epilog:
        parser.error("--slurm-epilog takes the job's GPUs from Slurm: no --gpu, --unit or --container")
    if args.verb == "wait" and args.slurm_prolog and (args.gpu or args.cuda_visible_devices):
        parser.error("--slurm-prolog takes the job's GPUs from Slurm: no --gpu or --cuda-visible-devices")
    if args.verb == "sweep" and args.deadline is not None and not args.slurm_epilog:
        parser.error("--deadline only applies with --slurm-epilog")
    if args.verb == "sweep" and args.reset_leaked and not args.slurm_epilog:
        parser.error("--reset-leaked only applies with --slurm-epilog")
    try:
        backend = connect(args)
        if args.verb == "status":
            status = backend.status()
            output.print_json(status, out) if args.json else output.print_status(status, out)
            return EXIT_OK
        if args.verb == "gpus":
            gpus = backend.gpus()
            output.print_json([g.to_dict() for g in gpus], out) if args.json \
                else output.print_gpus(gpus, out)
            return EXIT_OK
        if args.verb == "holders":
            found = backend.holders(args.gpu, args.unit, args.container, not args.hide_protected)
            output.print_json([h.to_dict() for h in found], out) if args.json \
                else output.print_holders(found, out)
            return EXIT_OK
        if args.verb == "sweep" and args.slurm_epilog:
            return run_slurm_epilog(backend, args, out)
        if args.verb == "sweep":
            request = SweepRequest(gpus=args.gpu, unit=args.unit, container=args.container,
                                   grace_ms=args.grace, dry_run=args.dry_run,
                                   include_management=args.include_management,
                                   reason=args.reason)
            report = sweep_through_restarts(backend, request, args)
            output.print_json(report.to_dict(), out) if args.json else output.print_report(report, out)
            return OUTCOME_EXIT.get(report.outcome, EXIT_ERROR)
        if args.verb == "check":
            return run_check(backend, args.gpu, args.json, out)
        if args.verb == "reset":
            report = backend.reset(args.gpu, args.reason)
            output.print_json(report.to_dict(), out) if args.json else output.print_report(report, out)
            return OUTCOME_EXIT.get(report.outcome, EXIT_ERROR)
        if args.verb == "wait":
            return run_gate(backend, args, out)
        if args.verb == "history":
            reports = backend.history(args.count)
            if args.json:
                output.print_json([report.to_dict() for report in reports], out)
            else:
                for report in reports:
                    output.print_report(report, out)
                output.print_omitted(reports, "reports", out)
            return EXIT_OK
        if args.verb == "watch":
            from gpuguardd.cli.client import DBusBackend
            from gpuguardd.cli.watch import run_watch
            if not isinstance(backend, DBusBackend):
                raise InvalidArgument("watch needs gpuguardd")
            return run_watch(backend, args.json, out)
    except GpuGuardError as exc:
        log.error("%s%s", "not authorized: " if isinstance(exc, NotAuthorized) else "", exc)
        return error_exit(exc)
    parser.error(f"unknown verb {args.verb!r}")
    return EXIT_USAGE


def run_check(backend: Backend, selectors: list[str], as_json: bool, out: TextIO) -> int:
    """`gpuguardctl check`: read-only; one line per problem, EXIT_NOT_FREE when there is one."""
    from gpuguardd.cli import output
    from gpuguardd.cli.check import check, recovered_by_reset

    result = check(backend.status(), backend.gpus(), backend.holders(selectors, "", "", True),
                   selectors)
    try:
        notes = recovered_by_reset(result, backend.history(RECENT_REPORTS))
    except (GpuGuardError, DaemonUnavailable) as exc:  # the answer stands without them
        log.debug("no history for the check's notes: %s", exc)
        notes = []
    if as_json:
        output.print_json(result.to_dict(), out)
    else:
        for problem in result.problems:
            out.write(problem.message + "\n")
        for note in notes:  # stderr: stdout stays one line per problem
            sys.stderr.write(note + "\n")
    return EXIT_OK if result.ok else EXIT_NOT_FREE


def run_gate(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """`gpuguardctl wait` (wait.py), after --sweep-leftovers' sweep. With --slurm-prolog every
    failure is one line on stdout, the drain reason."""
    from gpuguardd.cli import output
    from gpuguardd.cli.wait import run_wait

    try:
        if args.sweep_leftovers:
            request = SweepRequest(unit=args.sweep_leftovers,
                                   reason=f"gate: leftovers of {args.sweep_leftovers}")
            report = sweep_through_restarts(backend, request, args)
            output.print_report(report, sys.stderr)  # the gate below judges what is left
        return run_wait(backend, args, out, EXIT_GATE_TIMEOUT)
    except (GpuGuardError, DaemonUnavailable) as exc:
        if not args.slurm_prolog:
            raise
        job = os.environ.get("SLURM_JOB_ID", "?")
        from gpuguardd.escaping import escape_text
        from gpuguardd.numbers import is_digits
        line = f"gpuguard: job {job if is_digits(job) else '?'}: prolog failed: {escape_text(str(exc))}"
        log.error("%s", line)
        out.write(line[:240] + "\n")
        return error_exit(exc)


def run_slurm_epilog(backend: Backend, args: argparse.Namespace, out: TextIO) -> int:
    """`sweep --slurm-epilog`: the finished job's sweep, bounded by --deadline. stdout is the
    drain reason (one line, only when the exit status is not 0) or, with --json, the report;
    the human report goes to stderr, which slurmd logs."""
    import threading

    from gpuguardd.cli import output
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
        request = SweepRequest(gpus=selectors, grace_ms=slurm.EPILOG_GRACE_MS if args.grace is None
                               else args.grace, dry_run=args.dry_run,
                               include_management=args.include_management, reason=reason,
                               slurm_job=job.job_id, slurm_uid=job.uid)
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
            line = f"gpuguard: job {job_id}: no result within the {deadline:g} s deadline"
            log.error("%s", line)
            out.write(line + "\n")
            return EXIT_ERROR
        if isinstance(result[0], BaseException):
            raise result[0]
        report = result[0]
    except (GpuGuardError, DaemonUnavailable) as exc:
        code = error_exit(exc)
        line = slurm.summary(job_id, Report(outcome=Outcome.ERROR, error=str(exc)))
        log.error("%s", line)
        out.write(line + "\n")
        return code
    output.print_report(report, sys.stderr)
    code = OUTCOME_EXIT.get(report.outcome, EXIT_ERROR)
    if code == EXIT_NOT_RELEASED and args.reset_leaked and reset_leaks(backend, report, job_id):
        code = EXIT_OK
    if args.json:
        output.print_json(report.to_dict(), out)
    elif code != EXIT_OK:
        out.write(slurm.summary(job_id, report) + "\n")
    return code


def reset_leaks(backend: Backend, report: Report, job_id: str) -> bool:
    """The epilog's recovery: reset each whole GPU the sweep left leaked, when leaks alone kept
    its memory (no survivor, no MIG instance: a reset would take every tenant's instance).
    True when every reset was done and verified."""
    unreleased = {g.index for g in report.gpus if not g.released}
    leaked = {leak.gpu for leak in report.leaks if not leak.mig_uuid}
    if report.survived or not leaked or unreleased - leaked or any(leak.mig_uuid for leak in report.leaks):
        return False
    from gpuguardd.cli import output

    for gpu in sorted(leaked):
        try:
            reset = backend.reset(gpu, f"slurm epilog of job {job_id}: leaked memory")
        except (GpuGuardError, DaemonUnavailable) as exc:
            log.error("GPU %d: reset failed: %s", gpu, exc)
            return False
        output.print_report(reset, sys.stderr)
        if reset.outcome != Outcome.RESET:
            return False
    return True


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()

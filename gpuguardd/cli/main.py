"""gpuguardctl's parser and which code runs each verb (cli/backend.py says whom a verb asks).

Start-up matters (a hook runs it at every unit stop): a verb imports only what it uses. The engine
comes with --local only, dbus-fast with the verbs that ask the daemon, asyncio with those that need
a loop. bench/bench_startup.py measures it; tests/unit/test_cli_imports.py keeps it so.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from gpuguardd import __version__
from gpuguardd.cli.backend import connect
from gpuguardd.cli.exits import EXIT_GATE_TIMEOUT, EXIT_OK, error_exit, outcome_exit
from gpuguardd.errors import GpuGuardError, InvalidArgument, NotAuthorized
from gpuguardd.log import setup_logging
from gpuguardd.numbers import parse_uint
from gpuguardd.records.selectors import selector

log = logging.getLogger("gpuguard.cli")
T = TypeVar("T")


# The options' types: config's parsers are imported only when their option is given.
def _refusing(parse: Callable[[str], T]) -> Callable[[str], T]:
    @functools.wraps(parse)
    def convert(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, InvalidArgument) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


@_refusing
def grace_ms(text: str) -> int:
    from gpuguardd.config import MAX_GRACE_SEC, parse_timespan

    return int(parse_timespan(text, MAX_GRACE_SEC) * 1000)


@_refusing
def positive(text: str) -> int:
    return parse_uint(text, "count", minimum=1)


@_refusing
def mib(text: str) -> int:
    from gpuguardd.config import MAX_RELEASED_BELOW_MIB

    return parse_uint(text, "MiB", MAX_RELEASED_BELOW_MIB, 1)


@_refusing
def stable_sec(text: str) -> float:
    from gpuguardd.config import MAX_GATE_STABLE_SEC, parse_timespan

    return parse_timespan(text, MAX_GATE_STABLE_SEC)


@_refusing
def timeout_sec(text: str) -> float:
    from gpuguardd.config import parse_timespan

    return parse_timespan(text, 24 * 3600.0)


@_refusing
def gpu(text: str) -> str:
    """A --gpu as typed, once it names a GPU at all; the backend resolves it."""
    selector(text).check()
    return text


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    common.add_argument("--local", action="store_true", default=argparse.SUPPRESS,
                        help="run the engine in this process instead of asking gpuguardd (root)")
    common.add_argument("--config", action="append", metavar="FILE", default=argparse.SUPPRESS,
                        help="with --local: read FILE instead of /etc/gpuguard (repeatable)")
    common.add_argument("--bus-address", metavar="ADDRESS", default=argparse.SUPPRESS,
                        help="talk to gpuguardd on this D-Bus address instead of the system bus")

    parser = argparse.ArgumentParser(prog="gpuguardctl", parents=[common],
                                     description="Find and safely end processes that keep NVIDIA GPUs busy.")
    parser.add_argument("--version", action="version", version=f"gpuguardctl {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, text: str, into: argparse._SubParsersAction[argparse.ArgumentParser] = verbs
             ) -> argparse.ArgumentParser:
        return into.add_parser(name, parents=[common], help=text)

    verb("status", "daemon and NVML state")
    verb("gpus", "GPUs, memory and holder counts")

    def gpu_arg(p: argparse.ArgumentParser, text: str) -> None:
        p.add_argument("--gpu", action="append", default=[], type=gpu, metavar="N|UUID", help=text)

    def scope_args(p: argparse.ArgumentParser) -> None:
        gpu_arg(p, "only this GPU (repeatable)")
        p.add_argument("--unit", default="", metavar="UNIT", help="only this systemd unit")
        p.add_argument("--container", default="", metavar="ID", help="only this container (lxc/129, docker/3f2a...)")

    holders = verb("holders", "processes holding GPUs")
    scope_args(holders)
    holders.add_argument("--hide-protected", action="store_true",
                         help="leave out processes a sweep would never touch")

    sweep = verb("sweep", "end the holders in a scope and verify the memory came back")
    scope_args(sweep)
    sweep.add_argument("--grace", type=grace_ms, default=None, metavar="SEC",
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
    sweep.add_argument("--deadline", type=grace_ms, default=None, metavar="SEC",
                       help="with --slurm-epilog: give up (exit 1) after this long (default 60s)")

    check = verb("check", "exit 0 when the GPUs have no compute holder and no leaked memory")
    gpu_arg(check, "only this GPU or MIG instance (repeatable; default: all)")

    wait = verb("wait", "wait until the GPUs are free for the next job (the start gate)")
    gpu_arg(wait, "this GPU or MIG instance (repeatable; default: CUDA_VISIBLE_DEVICES "
                  "or NVIDIA_VISIBLE_DEVICES from the environment, else all)")
    wait.add_argument("--cuda-visible-devices", metavar="LIST", help="the GPUs as a CUDA_VISIBLE_DEVICES value")
    wait.add_argument("--free-below", type=mib, default=None, metavar="MIB",
                      help="memory in use must be below this (default: [Gate] FreeBelowMiB)")
    wait.add_argument("--stable", type=stable_sec, default=None, metavar="SEC",
                      help="free and steady this long (default: [Gate] StableSec)")
    wait.add_argument("--timeout", type=timeout_sec, default=None, metavar="SEC",
                      help=f"give up after this long with exit status {EXIT_GATE_TIMEOUT} "
                           "(default: wait for ever; 60s with --slurm-prolog)")
    wait.add_argument("--sweep-leftovers", default="", metavar="UNIT",
                      help="first sweep what the unit that ran there before left behind")
    wait.add_argument("--allow-unverified", action="store_true",
                      help="let GPUs whose memory cannot be read (no NVML) pass on holders alone")
    wait.add_argument("--slurm-prolog", action="store_true",
                      help="as Slurm's Prolog=: the job's GPUs (SLURM_JOB_GPUS); stdout is the "
                           "drain reason when the exit status is not 0")

    reset = verb("reset", "reset a GPU that nothing holds (frees leaked memory)")
    reset.add_argument("--gpu", required=True, type=gpu, metavar="N", help="the GPU: its index, UUID or PCI bus id")
    reset.add_argument("--reason", default="", help="recorded in the report and the journal")

    verb("history", "past sweep reports").add_argument("-n", "--count", type=positive, default=10,
                                                       help="how many (newest first)")
    verb("watch", "print the daemon's signals (sweeps, terminations, leaks) as they come")

    hook = verb("hook", "install, remove or list ExecStopPost drop-ins that sweep a unit after it stops")
    actions = hook.add_subparsers(dest="hook_action", metavar="ACTION", required=True)
    for action, text in (("install", "write the drop-in and reload systemd (idempotent)"),
                         ("remove", "delete the drop-in and reload systemd"),
                         ("list", "show installed hooks and the units they apply to")):
        sub = verb(action, text, actions)
        sub.add_argument("pattern", nargs="?" if action == "list" else None, default="", metavar="PATTERN",
                         help="a unit (vllm-qwen.service), a prefix ending in '-' (sglang-) "
                              "or a template (foo@.service)")
        sub.add_argument("--root", default="/", metavar="DIR",
                         help="operate on the tree under DIR (packaging, tests); no daemon-reload")
        if action != "list":
            sub.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
            sub.add_argument("--start", action="store_true",
                             help="the start gate's ExecStartPre drop-in (gpuguard-start.conf: "
                                  "`gpuguardctl wait` on the unit's GPUs) instead of the stop hook")
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv, argparse.Namespace(json=False, local=False, config=None, bus_address=None))
    # What argparse cannot refuse on its own: options that only apply together, or never do.
    if args.config and not args.local:
        parser.error("--config only applies with --local (the daemon reads its own files)")
    if args.verb == "sweep" and (args.gpu or args.unit or args.container) and args.slurm_epilog:
        parser.error("--slurm-epilog takes the job's GPUs from Slurm: no --gpu, --unit or --container")
    if args.verb == "wait" and args.slurm_prolog and (args.gpu or args.cuda_visible_devices):
        parser.error("--slurm-prolog takes the job's GPUs from Slurm: no --gpu or --cuda-visible-devices")
    if args.verb == "sweep" and args.deadline is not None and not args.slurm_epilog:
        parser.error("--deadline only applies with --slurm-epilog")
    if args.verb == "sweep" and args.reset_leaked and not args.slurm_epilog:
        parser.error("--reset-leaked only applies with --slurm-epilog")
    setup_logging("gpuguardctl")
    out = sys.stdout
    if args.verb == "hook":
        from gpuguardd.cli.hook import run_command

        return run_command(args, out)
    from gpuguardd.cli import output

    try:
        backend = connect(args)
        if args.verb in ("sweep", "check", "wait", "watch"):
            verb = importlib.import_module(f"gpuguardd.cli.{args.verb}")
            return int(verb.run(backend, args, out))
        if args.verb == "reset":
            report = backend.reset(args.gpu, args.reason)
            output.print_json(report.to_dict(), out) if args.json else output.print_report(report, out)
            return outcome_exit(report.outcome)
        if args.verb == "status":
            status = backend.status()
            output.print_json(status, out) if args.json else output.print_status(status, out)
        elif args.verb == "gpus":
            gpus = backend.gpus()
            output.print_json([g.to_dict() for g in gpus], out) if args.json else output.print_gpus(gpus, out)
        elif args.verb == "holders":
            found = backend.holders(args.gpu, args.unit, args.container, not args.hide_protected)
            output.print_json([h.to_dict() for h in found], out) if args.json else output.print_holders(found, out)
        else:  # history
            reports = backend.history(args.count)
            if args.json:
                output.print_json([report.to_dict() for report in reports], out)
            else:
                for report in reports:
                    output.print_report(report, out)
                output.print_omitted(reports, "reports", out)
        return EXIT_OK
    except GpuGuardError as exc:
        log.error("%s%s", "not authorized: " if isinstance(exc, NotAuthorized) else "", exc)
        return error_exit(exc)


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()

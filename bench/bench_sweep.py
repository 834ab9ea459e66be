#!/usr/bin/env python3
"""Sweep: time from "sweep requested" to "verified free", gpuguard against the manual pipeline.

    sudo .venv/bin/python bench/bench_sweep.py [--holders 50] [--files 50] [--repeat 5]
                                              [--background 0] [--poll-ms 10] [--no-nvml]

Each run gets a fresh population of `--holders` processes (`sleep` with nvidiaN, nvidiactl and
nvidia-uvm fds inherited, plus `--files` ordinary files; they exit at once on SIGTERM), and the
runs of the sides are interleaved:

  * own exit: SIGTERM straight through pidfds, until every pidfd polls readable (exited) and
    until every holder is reaped (what NVML's "is it gone" sees). The floor for both others;
  * gpuguard: Engine(config).sweep(SweepRequest(gpus=[0, 1])), with the fake NVML of
    tests/fakenvml listing every holder with memory (release_delay_ms=0), so "verified" means
    the memory was seen to come back (outcome "freed"). Without gcc, or with --no-nvml, NVML
    is absent and the expected outcome is "unverified";
  * manual: `pkill -e -f <the holders' command line>`, `fuser -k <nodes>`, then `fuser -s
    <nodes>` every --poll-ms until nothing holds them;
  * by device: the same without pkill: `fuser -k`, then `fuser -s`, which finds the holders by
    the nodes they hold, as gpuguard does;
  * evidence: the holders' fd tables read cold, the way the scan reads them, signalling nothing:
    what a safe sweep must read before its first signal (a process NVML lists is ended only
    if it holds a device here). Added to their own exit, the floor of a verified sweep;
  * skeleton: the least a verified sweep can do, built from gpuguard's own readers: one NVML
    reading, the pinned /proc scan, the checks no sweep may skip (engine/protection.py's rule:
    PID 1, kernel threads, its own chain, protected executables and units), SIGTERM through the
    pidfds, then NVML until it charges nothing to them. No description, report, lock, log or
    later round: what Python and the safety rules cost before gpuguard adds anything of its own.

The fake NVML library is found through LD_LIBRARY_PATH, which the loader reads only at start,
so the benchmark re-executes itself once with the environment of tests.fakenvml.env_for().
It prints the medians, the ratios, the floor, gpuguard's overhead over the processes' own exit,
and the budget's verdict (bench/README.md: no slower than the manual pipeline).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import secrets
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import common
from common import BenchError, Population

from gpuguardd.config import Config
from gpuguardd.engine import procfs
from gpuguardd.engine.attribution import attribute
from gpuguardd.engine.devices import driver_majors
from gpuguardd.engine.engine import Engine
from gpuguardd.engine.holders import scan_raw
from gpuguardd.engine.protection import ProtectedFiles, protection
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import Holder, SweepRequest
from gpuguardd.records.report import Report
from tests.fakenvml import (
    STATE_ENV,
    FakeNvmlBuildError,
    FakeNvmlState,
    build_library,
    env_for,
)

WORKDIR_ENV = "GPUGUARD_BENCH_SWEEP_WORKDIR"
GiB = 1 << 30

EXIT = "processes' own exit (SIGTERM via pidfd)"
REAPED = "processes reaped (gone for NVML)"
GPUGUARD = "gpuguard Engine.sweep(): requested -> verified"
MANUAL = "manual: pkill -f; fuser -k; poll fuser -s"
BY_DEVICE = "by device: fuser -k; poll fuser -s"
EVIDENCE = "evidence: the holders' fd tables, read cold"
SKELETON = "skeleton: scan, safety checks, SIGTERM, NVML"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--holders", type=int, default=50, help="holder processes per run")
    parser.add_argument("--files", type=int, default=50, help="ordinary open files per holder")
    parser.add_argument("--repeat", type=int, default=5, help="runs per side (median)")
    parser.add_argument("--background", type=int, default=0,
                        help="idle processes (with --files files each) alive through every run")
    parser.add_argument("--poll-ms", type=float, default=10.0,
                        help="manual pipeline: pause between `fuser -s` checks")
    parser.add_argument("--no-nvml", action="store_true", help="run without the fake NVML")
    parser.add_argument("--profile", action="store_true", help="cProfile one more gpuguard sweep")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.holders < 1 or args.repeat < 1 or args.files < 0 or args.background < 0 or args.poll_ms < 0:
        parser.error("--holders and --repeat must be >= 1; --files, --background, --poll-ms >= 0")
    return args


def reexec_with_fake_nvml(argv: list[str]) -> str:
    """Build the fake NVML and exec this script again with it on LD_LIBRARY_PATH.

    Returns (instead of exec'ing) only when the library cannot be built: why, for the output.
    """
    workdir = Path(tempfile.mkdtemp(prefix="gpuguard-bench-sweep-"))
    try:
        libdir = build_library(workdir / "lib")
    except (FakeNvmlBuildError, OSError) as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        return f"fake NVML not built ({exc})"
    env = dict(os.environ)
    env.update(env_for(libdir, workdir / "nvml.state"))
    env[WORKDIR_ENV] = str(workdir)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)
    raise AssertionError("unreachable")


# -- the sides ---------------------------------------------------------------------------------------


def terminate(pidfds: Iterable[int], deadline: float) -> None:
    """SIGTERM through each pidfd; return once every one polls readable (its process exited)."""
    poller = select.poll()
    pending = set(pidfds)
    for fd in pending:
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        poller.register(fd, select.POLLIN)
    while pending:
        for fd, _ in poller.poll(max(0.0, deadline - time.perf_counter()) * 1000):
            pending.discard(fd)
            poller.unregister(fd)
        if pending and time.perf_counter() > deadline:
            raise BenchError(f"{len(pending)} holders did not exit on SIGTERM")


def own_exit(population: Population, timeout: float = 30.0) -> tuple[float, float, set[int]]:
    """SIGTERM every holder through its pidfd; seconds until all exited and until all reaped."""
    pidfds = {pid: os.pidfd_open(pid) for pid in sorted(population.holder_pids)}
    try:
        started = time.perf_counter()
        deadline = started + timeout
        terminate(pidfds.values(), deadline)
        exited = time.perf_counter() - started
        unreaped = set(pidfds.values())
        while unreaped:
            for fd in list(unreaped):
                try:
                    signal.pidfd_send_signal(fd, 0)  # succeeds on a zombie, fails once reaped
                except ProcessLookupError:
                    unreaped.discard(fd)
            if unreaped:
                if time.perf_counter() > deadline:
                    raise BenchError(f"{len(unreaped)} holders exited but were never reaped")
                time.sleep(0.0002)
        return exited, time.perf_counter() - started, set(pidfds)
    finally:
        for fd in pidfds.values():
            os.close(fd)


def publish_nvml(population: Population, state_path: Path) -> None:
    state = FakeNvmlState()
    state.add_gpu()
    state.add_gpu()
    for pid, kind in sorted(population.members.items()):
        gpu = 0 if kind == common.KIND_COMPUTE_GPU0 else 1
        state.add_proc(gpu, pid, 2 * GiB, release_delay_ms=0)
    state.write(state_path)


def gpuguard_sweep(population: Population, engine: Engine, nvml: bool,
                   profiler: cProfile.Profile | None = None) -> tuple[float, set[int], Report]:
    request = SweepRequest(gpus=["0", "1"], requested_by="bench_sweep", reason="benchmark")
    if profiler is not None:
        profiler.enable()
    started = time.perf_counter()
    report = engine.sweep(request)
    seconds = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
    expected = Outcome.FREED if nvml else Outcome.UNVERIFIED
    if report.outcome != expected:
        raise BenchError(f"gpuguard's sweep ended {report.outcome!r}, expected {expected!r}: "
                         f"survived={report.survived} spared={report.spared} gpus={report.gpus} "
                         f"warnings={report.warnings}")
    terminated = {entry.pid for entry in report.terminated}
    return seconds, terminated, report


def evidence(population: Population, paths: list[str]) -> float:
    """Seconds to read every holder's fd table as the scan does, on processes nothing has
    read yet (the kernel builds a /proc/<pid>/fd entry at its first listing)."""
    nodes = {(st.st_dev, st.st_ino) for st in map(os.stat, paths)}
    started = time.perf_counter()
    held = [procfs.char_device_fds(pid) for pid in sorted(population.holder_pids)]
    seconds = time.perf_counter() - started
    if any(sum((dev, ino) in nodes for dev, ino, _, _ in fds) != 3 for fds in held):
        raise BenchError("a holder's fd table did not show its three device nodes")
    return seconds


def skeleton_sweep(engine: Engine, nvml: bool, timeout: float = 30.0) -> tuple[float, set[int]]:
    """Seconds from the first NVML reading to the last (see the module docstring), and the PIDs
    signalled. Without NVML it stops at the holders' exit."""
    config = engine.config
    started = time.perf_counter()
    engine.snapshot()
    found = scan_raw(engine.device_map(), use_pidfd=True)[0]  # each pinned before it is read
    own_chain = procfs.ancestors(os.getpid())
    protected = ProtectedFiles.resolve(config)
    pidfds: dict[int, int] = {}
    try:
        for pid, raw in found.items():
            stat = procfs.read_stat(pid)
            if raw.pidfd is None or stat is None:
                continue
            # Only what gpuguard's never-signal rule reads, for that rule itself.
            where = attribute(procfs.read_cgroup(pid))
            holder = Holder(pid=pid, comm=stat.comm, state=stat.state, exe=procfs.read_exe(pid) or "",
                            unit=where.unit, container=where.container)
            if protection(holder, config, own_chain, protected) is None:
                pidfds[pid], raw.pidfd = raw.pidfd, None
        deadline = started + timeout
        terminate(pidfds.values(), deadline)
        while nvml and any(pid in gpu.processes for gpu in engine.snapshot().gpus for pid in pidfds):
            if time.perf_counter() > deadline:
                raise BenchError("skeleton: NVML still charges memory to the ended holders")
            time.sleep(0.001)
        return time.perf_counter() - started, set(pidfds)
    finally:
        for raw in found.values():
            raw.close()
        for fd in pidfds.values():
            os.close(fd)


def manual_pipeline(pattern: str | None, paths: list[str], poll_sec: float,
                    timeout: float = 30.0) -> tuple[float, set[int], int]:
    """`pattern`: pkill -f it first; None: find the holders by device only (fuser -k)."""
    started = time.perf_counter()
    pkilled = common.run_pkill(pattern).pids if pattern is not None else set()
    fuser_kill = common.run_fuser(paths, "-k")
    checks = 0
    while True:
        checks += 1
        if common.run_fuser(paths, "-s").returncode == 1:
            break  # nothing holds the nodes any more
        if time.perf_counter() - started > timeout:
            raise BenchError(f"the manual pipeline left the devices held after {timeout:.0f} s")
        time.sleep(poll_sec)
    return time.perf_counter() - started, pkilled | fuser_kill.pids, checks


# -- driver --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, workdir: Path, nvml: bool, note: str) -> int:
    common.require_environment(("fuser", "pkill", "sleep"))
    if driver_majors():
        raise BenchError("an NVIDIA driver is registered in /proc/devices: gpuguard would take its "
                         "devices for the benchmark's GPUs 0 and 1 and end real GPU processes. "
                         "Run this benchmark on a machine without the driver.")
    state_path = Path(os.environ[STATE_ENV]) if nvml else workdir / "nvml.state"
    background: Population | None = None
    try:
        nodes = common.make_nodes(workdir / "dev")
        paths = sorted(nodes.values())
        if nvml:
            publish_nvml_empty(state_path)
        config = Config(device_paths=(str(workdir / "dev" / "nvidia*"),), grace_sec=5.0,
                        allow_majors=common.ALLOW_MAJORS,
                        kill_timeout_sec=5.0, verify_timeout_sec=10.0, released_below_mib=64,
                        runtime_directory=str(workdir / "run"), state_directory=str(workdir / "state"))
        engine = Engine(config)
        snapshot = engine.snapshot()
        if nvml and not snapshot.available:
            raise BenchError(f"the fake NVML did not load: {snapshot.error} (--no-nvml runs without)")
        if args.background:
            background = Population(workdir / "background", nodes, args.background, args.files, 0,
                                    orphan_cleanup=(workdir / "dev", workdir))
            background.start()
        host = sum(name.isdigit() for name in os.listdir("/proc"))
        print(f"bench_sweep: {args.holders} holders x {args.files} open files, {args.background} idle "
              f"processes besides ({host} on the host), {args.repeat} runs per side, each on a fresh "
              "population")
        print("NVML: " + ("fake NVML lists every holder with 2 GiB; verification is real" if nvml
                          else f"absent ({note or '--no-nvml'}); gpuguard's outcome is 'unverified'"))
        times: dict[str, list[float]] = {EXIT: [], REAPED: [], EVIDENCE: [], SKELETON: [],
                                         GPUGUARD: [], MANUAL: [], BY_DEVICE: []}
        durations: list[int] = []
        checks: dict[str, list[int]] = {MANUAL: [], BY_DEVICE: []}
        sides = ["exit", "evidence", "skeleton", "gpuguard", "manual", "device"]
        for round_number in range(args.repeat):
            shift = round_number % len(sides)
            for side in sides[shift:] + sides[:shift]:
                token = f"86400.{secrets.randbelow(10**6):06d}"
                population = Population(workdir / "holders", nodes, args.holders, args.files,
                                        args.holders, workers=2, exec_argv=["sleep", token],
                                        orphan_cleanup=(workdir / "dev", workdir))
                try:
                    population.start()
                    expected = population.holder_pids
                    if side == "exit":
                        exited, reaped, signalled = own_exit(population)
                        times[EXIT].append(exited)
                        times[REAPED].append(reaped)
                        common.check_same({"direct SIGTERM": signalled}, expected, population.members)
                    elif side == "gpuguard":
                        if nvml:
                            publish_nvml(population, state_path)
                        seconds, terminated, report = gpuguard_sweep(population, engine, nvml)
                        times[GPUGUARD].append(seconds)
                        durations.append(report.duration_ms)
                        try:
                            common.check_same({"gpuguard terminated": terminated}, expected,
                                              population.members)
                        except BenchError as exc:
                            raise BenchError(f"{exc}\n  gpuguard's targets: {report.targets}") from None
                    elif side == "evidence":
                        times[EVIDENCE].append(evidence(population, paths))
                    elif side == "skeleton":
                        if nvml:
                            publish_nvml(population, state_path)
                        seconds, signalled = skeleton_sweep(engine, nvml)
                        times[SKELETON].append(seconds)
                        common.check_same({"skeleton signalled": signalled}, expected, population.members)
                    else:
                        row = MANUAL if side == "manual" else BY_DEVICE
                        pattern = "sleep " + token.replace(".", "\\.") if row == MANUAL else None
                        seconds, killed, polls = manual_pipeline(pattern, paths, args.poll_ms / 1000)
                        times[row].append(seconds)
                        checks[row].append(polls)
                        common.check_same({"pkill/fuser -k killed": killed}, expected, population.members)
                finally:
                    population.stop()
        print(common.table([(name, values) for name, values in times.items()],
                           {GPUGUARD: f"(report duration_ms, Sweep.run only: {common.median(durations):.0f})",
                            **{row: f"({common.median(polls):.0f} fuser -s checks, {args.poll_ms:g} ms apart)"
                               for row, polls in checks.items()}}))
        outcome = "freed (memory seen released by NVML)" if nvml else "unverified (no NVML)"
        print(f"same holders: {args.holders} pids in every run (direct SIGTERM = skeleton signalled = "
              f"gpuguard terminated = pkill/fuser -k killed = the population's holders); gpuguard outcome {outcome} in "
              f"{len(times[GPUGUARD])}/{len(times[GPUGUARD])} runs")
        gpuguard, manual = common.median(times[GPUGUARD]), common.median(times[MANUAL])
        exited, reaped = common.median(times[EXIT]), common.median(times[REAPED])
        skeleton = common.median(times[SKELETON])
        print(f"ratio gpuguard/manual: {gpuguard / manual:.2f}; gpuguard/by device: "
              f"{gpuguard / common.median(times[BY_DEVICE]):.2f}; skeleton/manual: "
              f"{skeleton / manual:.2f}; gpuguard over the skeleton: {(gpuguard - skeleton) * 1000:+.1f} ms")
        floor = common.median(times[EVIDENCE]) + exited
        print(f"floor of a verified sweep (evidence + own exit): {floor * 1000:.1f} ms; "
              f"manual/floor {manual / floor:.2f}; gpuguard over the floor: "
              f"{(gpuguard - floor) * 1000:+.1f} ms")
        overhead_ms = (gpuguard - exited) * 1000
        print(f"overhead gpuguard over the processes' own exit: {overhead_ms:+.1f} ms "
              f"({(gpuguard - reaped) * 1000:+.1f} ms over reaped)")
        verdict = "met" if gpuguard <= manual else "MISSED"
        print(f"budget (bench/README.md), no slower than the manual pipeline: {verdict}")
        if args.profile:
            print("\nprofile of one more gpuguard sweep:\n" + profile_sweep(args, workdir, nodes, engine,
                                                                           nvml, state_path))
        common.write_json(args.json, {
            "benchmark": "sweep", "holders": args.holders, "files": args.files,
            "background": args.background, "repeat": args.repeat, "nvml": nvml,
            "median_sec": {name: common.median(values) for name, values in times.items()},
            "runs_sec": times, "ratio_gpuguard_manual": gpuguard / manual, "floor_sec": floor,
            "skeleton_sec": skeleton,
            "overhead_ms": overhead_ms, "report_duration_ms": durations,
            "load_average": os.getloadavg(),
        })
        return 0
    finally:
        if background is not None:
            background.stop()
        common.unmount_nodes(workdir / "dev")


def publish_nvml_empty(state_path: Path) -> None:
    state = FakeNvmlState()
    state.add_gpu()
    state.add_gpu()
    state.write(state_path)


def profile_sweep(args: argparse.Namespace, workdir: Path, nodes: dict[str, str], engine: Engine,
                  nvml: bool, state_path: Path) -> str:
    token = f"86400.{secrets.randbelow(10**6):06d}"
    population = Population(workdir / "holders", nodes, args.holders, args.files, args.holders,
                            workers=2, exec_argv=["sleep", token])
    profiler = cProfile.Profile()
    try:
        population.start()
        if nvml:
            publish_nvml(population, state_path)
        gpuguard_sweep(population, engine, nvml, profiler)
    finally:
        population.stop()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(12)
    stats.sort_stats("cumulative").print_stats(r"gpuguardd", 15)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    note = ""
    if WORKDIR_ENV not in os.environ and not args.no_nvml:
        note = reexec_with_fake_nvml(argv)  # returns only if the library could not be built
    inherited = os.environ.pop(WORKDIR_ENV, "")
    nvml = bool(inherited) and not args.no_nvml and STATE_ENV in os.environ
    workdir = Path(inherited) if inherited else Path(tempfile.mkdtemp(prefix="gpuguard-bench-sweep-"))
    common.exit_on_signals()
    # The engine logs every sweep (a warning when unverified); the table says it all.
    logging.getLogger("gpuguard").setLevel(logging.ERROR)
    try:
        return run(args, workdir, nvml, note)
    except BenchError as exc:
        print(f"bench_sweep: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_sweep: interrupted; populations torn down", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Holder scan: gpuguard against `fuser -v` and `lsof` on the same synthetic population.

    sudo .venv/bin/python bench/bench_scan.py [--procs 2000] [--files 50] [--holders 200] [--repeat 5]

Builds `--procs` idle processes with `--files` open files each; `--holders` of them hold the
fake device nodes (fds opened O_PATH or O_RDWR, mappings without an fd, management and modeset
nodes). Then times, interleaved, after one untimed warm-up round each:

  * gpuguard find_holders(build_device_map(...), NvmlSnapshot(available=False)), in process;
  * gpuguard Engine.scan() (adds the NVML attempt and protection marking), in process: the
    daemon's scan;
  * `gpuguardctl holders --local --json` as a whole process (interpreter start, imports,
    configuration, the scan, the output): what an admin runs instead of fuser;
  * fuser -v <nodes> and lsof -w -n -P -- <nodes>, as the commands an admin would run;
  * the floor: gpuguard's pass over /proc and nothing else (holders.scan_raw: no pinning,
    no details, no NVML). The daemon's scan cannot be quicker.

For a host of two AMD GPUs (the same population on /dev/kfd, renderD and card nodes, a fake
KFD and DRM sysfs tree for gpuguard's attribution): --amd.

For a host of ten thousand processes:

    sudo .venv/bin/python bench/bench_scan.py --procs 10000 --fds 100 --light --repeat 3

--light makes the population cheap enough for that: its plain processes exec `sleep` with
their files kept (about 0.2 MiB each instead of a forked Python's 0.7 MiB; shorter maps too:
37 lines). The kernel's pid_max and threads-max, and RLIMIT_NOFILE, are raised for the run
where the population would not fit, and put back.

Every run's set of holder PIDs must equal the population's holders, or the benchmark fails.
It prints the median per tool and the ratios gpuguard/fuser and gpuguard/lsof (below 1 means
gpuguard is faster), and the issue's targets: the whole `gpuguardctl holders --local` no slower
than fuser, the daemon's scan (Engine.scan) in half fuser's time. --profile adds a cProfile of
one find_holders run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import common
from common import BenchError, Population

from gpuguardd.config import Config
from gpuguardd.engine import holders
from gpuguardd.engine.devices import build_device_map, driver_majors
from gpuguardd.engine.engine import Engine
from gpuguardd.engine.holders import find_holders
from gpuguardd.records.models import NvmlSnapshot

FIND = "gpuguard find_holders"
SCAN = "gpuguard Engine.scan()"
CLI = "gpuguardctl holders --local"
FUSER = "fuser -v"
LSOF = "lsof -w -n -P"
FLOOR = "floor: the bare pass"
# --light: what the plain processes of the population exec.
LIGHT = ("sleep", "infinity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--procs", type=int, default=2000, help="processes in the population")
    parser.add_argument("--files", "--fds", type=int, default=50, help="open files per process")
    parser.add_argument("--holders", type=int, default=200, help="processes holding device nodes")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per tool (median)")
    parser.add_argument("--workers", type=int, default=4, help="processes forking the population")
    parser.add_argument("--profile", action="store_true", help="cProfile one find_holders run")
    parser.add_argument("--light", action="store_true",
                        help="plain processes exec sleep: a tenth of the memory, for big populations")
    parser.add_argument("--amd", action="store_true", help="a host of two AMD GPUs instead of NVIDIA's")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.procs < 1 or args.files < 0 or args.holders < 0 or args.repeat < 1 or args.workers < 1:
        parser.error("--procs, --repeat and --workers must be >= 1; --files and --holders >= 0")
    if args.holders > args.procs:
        parser.error("--holders cannot exceed --procs")
    return args


Measured = tuple[float, float, set[int]]  # wall seconds, CPU seconds, holder pids


def gpuguardctl_argv() -> list[str]:
    """The installed console script beside this interpreter (what an admin runs), else the
    module through this interpreter."""
    script = Path(sys.executable).with_name("gpuguardctl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuguardd.cli.main"]


def make_tools(patterns: tuple[str, ...], paths: list[str], engine: Engine, config_file: Path
               ) -> dict[str, Callable[[], Measured]]:
    def gpuguard_find() -> Measured:
        cpu, started = time.process_time(), time.perf_counter()
        pinned, _ = find_holders(build_device_map(patterns, allow_majors=common.ALLOW_MAJORS),
                                 NvmlSnapshot(available=False))
        for _, handle in pinned:
            handle.close()
        wall = time.perf_counter() - started
        return wall, time.process_time() - cpu, {holder.pid for holder, _ in pinned}

    def gpuguard_scan() -> Measured:
        cpu, started = time.process_time(), time.perf_counter()
        result = engine.scan()
        wall = time.perf_counter() - started
        return wall, time.process_time() - cpu, {holder.pid for holder in result.holders}

    cli_argv = [*gpuguardctl_argv(), "holders", "--local", "--json", "--config", str(config_file)]

    def gpuguardctl() -> Measured:
        cpu = common.children_cpu()
        started = time.perf_counter()
        proc = subprocess.run(cli_argv, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise BenchError(f"{' '.join(cli_argv)} exited {proc.returncode}: {proc.stderr[-500:]}")
        return wall, common.children_cpu() - cpu, {int(h["pid"]) for h in json.loads(proc.stdout)}

    def fuser() -> Measured:
        run = common.run_fuser(paths, "-v")
        return run.seconds, run.cpu, run.pids

    def lsof() -> Measured:
        run = common.run_lsof(paths)
        return run.seconds, run.cpu, run.pids

    def floor() -> Measured:
        cpu, started = time.process_time(), time.perf_counter()
        found, _ = holders.scan_raw(build_device_map(patterns, allow_majors=common.ALLOW_MAJORS))
        wall = time.perf_counter() - started
        return wall, time.process_time() - cpu, set(found)

    return {FIND: gpuguard_find, SCAN: gpuguard_scan,
            CLI: gpuguardctl, FUSER: fuser, LSOF: lsof, FLOOR: floor}


@contextmanager
def room_for(procs: int, files: int) -> Iterator[list[str]]:
    """kernel.pid_max and kernel.threads-max raised where `procs` more processes (and the
    host's own, twice over) would not fit, and RLIMIT_NOFILE where a worker of the population
    could not open `files`; put back afterwards. Yields what was raised."""
    host = sum(name.isdigit() for name in os.listdir("/proc"))
    need = procs + 2 * host + 1000
    saved: list[tuple[Path, str]] = []
    raised = []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        for name in ("pid_max", "threads-max"):
            path = Path("/proc/sys/kernel") / name
            old = path.read_text().strip()
            if int(old) < need:
                try:
                    path.write_text(f"{need}\n")
                except OSError as exc:
                    raise BenchError(f"kernel.{name} {old} is too small for {procs} processes: {exc}") from exc
                saved.append((path, old))
                raised.append(f"kernel.{name} {old} -> {need}")
        if files + 64 > nofile[0]:
            if files + 64 > nofile[1]:
                raise BenchError(f"--files {files} needs RLIMIT_NOFILE {files + 64}; the hard limit is {nofile[1]}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (files + 64, nofile[1]))
            raised.append(f"RLIMIT_NOFILE {nofile[0]} -> {files + 64}")
        yield raised
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        for path, old in reversed(saved):
            path.write_text(f"{old}\n")


def profile_find(patterns: tuple[str, ...]) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    pinned, _ = find_holders(build_device_map(patterns, allow_majors=common.ALLOW_MAJORS),
                             NvmlSnapshot(available=False))
    profiler.disable()
    for _, handle in pinned:
        handle.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(15)
    stats.sort_stats("cumulative").print_stats(r"gpuguardd", 12)
    return out.getvalue()


def run(args: argparse.Namespace) -> int:
    common.require_environment(("fuser", "lsof"))
    workdir = Path(tempfile.mkdtemp(prefix="gpuguard-bench-scan-"))
    population: Population | None = None
    try:
        with room_for(args.procs, args.files) as raised:
            # nvidia-uvm with /dev/zero's numbers, so that holders can map it (gpuguard refuses
            # regular files as devices): every /dev/zero holder on the host is then seen as well.
            nodes = common.make_nodes(workdir / "dev", uvm=common.UVM_ZERO,
                                      names=common.AMD_NAMES if args.amd else None)
            patterns = tuple(str(workdir / "dev" / glob) for glob in
                             (("kfd", "renderD*", "card*") if args.amd else ("nvidia*",)))
            paths = sorted(nodes.values())
            population = Population(workdir, nodes, args.procs, args.files, args.holders,
                                    workers=args.workers, orphan_cleanup=(workdir / "dev", workdir),
                                    plain_exec=LIGHT if args.light else None,
                                    start_timeout=max(120.0, args.procs / 50))
            population.start()
            expected = population.holder_pids
            if args.light:
                check_light(population, args.files)
            host = sum(name.isdigit() for name in os.listdir("/proc"))
            light = f"; the plain ones exec {' '.join(LIGHT)}" if args.light else ""
            print(f"bench_scan: {args.procs} processes x {args.files} open files, {len(expected)} holding "
                  f"device nodes{light} ({host} processes on the host); population ready in "
                  f"{population.startup_sec:.1f} s; nvidia-uvm is 1,5"
                  + (f"; raised for the run: {', '.join(raised)}" if raised else ""))
            sysfs = amd_tree(workdir / "sys", nodes) if args.amd else "/sys"
            measure(args, workdir, population, nodes, patterns, paths, sysfs)
        return 0
    finally:
        if population is not None:
            population.stop()
        common.unmount_nodes(workdir / "dev")
        shutil.rmtree(workdir, ignore_errors=True)


def check_light(population: Population, files: int) -> None:
    """A plain process exec'd sleep with its files: else there would be nothing to scan."""
    plain = sorted(set(population.members) - population.holder_pids)
    for pid in plain[:1] + plain[-1:]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:-1]
        held = len(os.listdir(f"/proc/{pid}/fd"))
        if argv != [word.encode() for word in LIGHT] or held < files:
            raise BenchError(f"plain process {pid} runs {argv} with {held} fds: expected {' '.join(LIGHT)} "
                             f"with its {files} files")


def amd_tree(root: Path, nodes: dict[str, str]) -> str:
    """Two MI300X in a fake KFD and DRM sysfs tree (tests/amd_sysfs.py), their render minors
    those of the population's render nodes: what Engine.scan() places holders by."""
    from tests.amd_sysfs import AmdSysfs

    tree = AmdSysfs(root)
    for number, role in enumerate(("nvidia0", "nvidia1")):
        minor = os.minor(os.stat(nodes[role]).st_rdev)
        tree.mi300x(f"0000:c{3 + number}:00.0", gpu_id=41234 + number, render_minor=minor,
                    card_minor=number + 1, unique_id=0x1122334455667700 + number)
    return tree.sysfs


def measure(args: argparse.Namespace, workdir: Path, population: Population, nodes: dict[str, str],
            patterns: tuple[str, ...], paths: list[str], sysfs: str) -> None:
    expected = population.holder_pids
    config = Config(device_paths=patterns, allow_majors=common.ALLOW_MAJORS, runtime_directory=str(workdir / "run"),
                    state_directory=str(workdir / "state"), sysfs_path=sysfs)
    engine = Engine(config)
    config_file = workdir / "gpuguard.conf"
    config_file.write_text(
        f"[Devices]\nPaths=\nPaths={' '.join(patterns)}\nSysfsPath={sysfs}\n"
        f"AllowMajors={' '.join(map(str, common.ALLOW_MAJORS))}\n"
        f"[Daemon]\nRuntimeDirectory={workdir / 'run'}\nStateDirectory={workdir / 'state'}\n")
    tools = make_tools(patterns, paths, engine, config_file)
    names = list(tools)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    aliases: dict[int, str] = {}
    majors = driver_majors()

    def check(name: str, pids: set[int]) -> None:
        extra = pids - expected
        if extra and name not in (FUSER, LSOF):
            found = common.alias_holders(extra, nodes, majors)
            aliases.update(found)
            pids = pids - set(found)
        common.check_same({name: pids}, expected, population.members)

    for name in names:  # warm-up: dentry caches, imports; checked, not timed
        check(name, tools[name]()[2])
    if args.amd:
        # The daemon's scan must also tell which AMD GPU each render node's holder is on.
        scanned = [h for h in engine.scan().holders if h.pid in expected]
        unplaced = [h.pid for h in scanned if any("renderD" in d for d in h.devices) and not h.gpus]
        if unplaced or not scanned:
            raise BenchError(f"holders of a render node on no AMD GPU: {unplaced[:5]}")
        print(f"every one of {len(scanned)} holders of a render node placed on its AMD GPU")
    for round_number in range(args.repeat):
        # Rotate the order so no tool always runs first (or right after another).
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, cpu_seconds, pids = tools[name]()
            check(name, pids)
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
    agreed = " = ".join(names)
    print(common.table([(name, times[name]) for name in names], cpu=cpu))
    print(f"same holders: {len(expected)} pids in every run ({agreed} = the population's holders)")
    print(f"load average while measuring: {' '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"({os.cpu_count()} CPUs)")
    if aliases:
        print(f"note: gpuguard also reported {len(aliases)} process(es) outside the population, not "
              "counted: they hold a device with the same number at another path, which gpuguard "
              "matches by design (fuser and lsof match the node's inode): "
              + "; ".join(f"{pid}: {why}" for pid, why in sorted(aliases.items())[:5]))
    ratios = peer_ratios(times, cpu)
    if args.amd:
        print(f"target (2 AMD GPUs) the scan within 1.0x of fuser over the same nodes: "
              f"{'met' if ratios[f'{SCAN}/{FUSER}'] <= 1.0 else 'MISSED'} "
              f"(Engine.scan() {ratios[f'{SCAN}/{FUSER}']:.2f}x fuser)")
    if args.profile:
        print("\nprofile of one find_holders run:\n" + profile_find(patterns))
    common.write_json(args.json, {
        "benchmark": "scan", "procs": args.procs, "files": args.files, "amd": args.amd,
        "holders": len(expected), "repeat": args.repeat, "light": args.light,
        "median_sec": {name: common.median(times[name]) for name in names},
        "median_cpu_sec": {name: common.median(cpu[name]) for name in names},
        "runs_sec": times, "runs_cpu_sec": cpu, "ratios": ratios,
        "load_average": os.getloadavg(),
    })


def ratio(values: dict[str, list[float]], ours: str, peer: str) -> float:
    return common.median(values[ours]) / common.median(values[peer])


def peer_ratios(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """gpuguard against fuser and lsof, and the issue's targets."""
    ratios: dict[str, float] = {}
    for peer in (FUSER, LSOF):
        parts = []
        for ours in (FIND, SCAN):
            ratios[f"{ours}/{peer}"] = ratio(times, ours, peer)
            ratios[f"{ours}/{peer} cpu"] = ratio(cpu, ours, peer)
            parts.append(f"{ratios[f'{ours}/{peer}']:.2f} ({ours.split(' ', 1)[1]})")
        print(f"ratio gpuguard/{peer.split()[0]}: " + ", ".join(parts) + " [wall clock; CPU time: "
              f"{ratios[f'{FIND}/{peer} cpu']:.2f}, {ratios[f'{SCAN}/{peer} cpu']:.2f}]")
    cli_ratio = ratios[f"{CLI}/{FUSER}"] = ratio(times, CLI, FUSER)
    scan_ratio = ratios[f"{SCAN}/{FUSER}"]
    print(f"target gpuguardctl holders --local (whole process) no slower than fuser -v: "
          f"{'met' if cli_ratio <= 1.0 else 'MISSED'} ({cli_ratio:.2f}x fuser)")
    floor_ratio = ratios[f"{FLOOR}/{FUSER}"] = ratio(times, FLOOR, FUSER)
    print(f"target the daemon's scan in half fuser's time: "
          f"{'met' if scan_ratio <= 0.5 else 'MISSED'} (Engine.scan() {scan_ratio:.2f}x fuser; "
          f"the floor here, the bare pass: {floor_ratio:.2f}x)")
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.exit_on_signals()
    try:
        return run(args)
    except BenchError as exc:
        print(f"bench_scan: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_scan: interrupted; population torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

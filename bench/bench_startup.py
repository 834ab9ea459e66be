#!/usr/bin/env python3
"""gpuguardctl start-up: the whole process for verbs that do little, beside the interpreter
alone, and (with --peer DIR) beside another checkout's gpuguardctl, e.g. the one before lazy
imports.

    sudo .venv/bin/python bench/bench_startup.py [--repeat 20] [--peer DIR]

Times, interleaved round by round (medians, the load average printed):
  * `python -c pass`: the interpreter's own start, the floor for any Python command;
  * `gpuguardctl --version`: argument parsing only;
  * `gpuguardctl status`: one D-Bus round trip to a gpuguardd (on the fake NVML, its own bus);
  * `gpuguardctl holders --local --json` with no device nodes: the engine's imports and a /proc
    pass that finds nothing (bench_scan.py times a real one);
and for each command the modules it imported and their cumulative import time
(`python -X importtime`). Every checkout runs as `python -m gpuguardd.cli.main` from its own
directory, with the same interpreter and packages.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import bench_dbus
import common

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per command (median)")
    parser.add_argument("--peer", type=Path, help="another gpuguard checkout to compare with")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def run_once(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run: a loaded machine stretches the first, hardly
    the second."""
    cpu = common.children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    cpu = common.children_cpu() - cpu
    if proc.returncode != 0:
        raise common.BenchError(f"{' '.join(argv)} (in {cwd}) exited {proc.returncode}: "
                                f"{proc.stderr[-400:]}")
    return seconds, cpu


def import_profile(argv: list[str], cwd: Path, env: dict[str, str], runs: int = 5
                   ) -> tuple[int, float]:
    """(modules imported, the median of their cumulative import time in seconds over `runs`),
    from -X importtime."""
    results = [_import_profile(argv, cwd, env) for _ in range(runs)]
    return results[0][0], statistics.median(seconds for _, seconds in results)


def _import_profile(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, float]:
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)
    modules = 0
    total_us = 0
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cumulative, name = line.split("|", 2)
        modules += 1
        if not name[1:].startswith(" "):  # top level: its cumulative time includes the rest
            total_us += int(cumulative)
    return modules, total_us / 1e6


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_startup.py needs root (device nodes, --local)", file=sys.stderr)
        return 2
    common.require_environment(["dbus-daemon", "gcc", "setpriv"])
    common.exit_on_signals()
    checkouts = [("now", ROOT)] + ([("peer", args.peer.resolve())] if args.peer else [])
    root = Path(tempfile.mkdtemp(prefix="gpuguard-bench-startup-"))
    bus = bench_dbus.BenchBus()
    host = bench_dbus.Host(root, 0)
    try:
        empty = root / "empty.conf"
        empty.write_text(f"[Devices]\nPaths=\nPaths={root}/no-such-dir/nvidia*\n"
                         f"[Daemon]\nRuntimeDirectory={root}/run\nStateDirectory={root}/state\n")
        verbs = {"--version": ["--version"], "status": ["status", "--bus-address", bus.address],
                 "holders --local": ["holders", "--local", "--json", "--config", str(empty)]}
        commands: list[tuple[str, list[str], Path, dict[str, str]]] = [
            ("python -c pass", [sys.executable, "-c", "pass"], ROOT, dict(os.environ))]
        for label, checkout in checkouts:
            env = {**os.environ, "PYTHONPATH": str(checkout)}
            env.pop("GPUGUARD_BUS_ADDRESS", None)
            for verb, verb_args in verbs.items():
                commands.append((f"gpuguardctl {verb} ({label})",
                                 [sys.executable, "-m", "gpuguardd.cli.main", *verb_args],
                                 checkout, env))
        with bench_dbus.daemon(host, bus.address):
            times: dict[str, list[float]] = {name: [] for name, *_ in commands}
            cpu: dict[str, list[float]] = {name: [] for name, *_ in commands}
            for _name, argv_, cwd, env in commands:  # warm-up: page cache, .pyc files
                run_once(argv_, cwd, env)
            for round_number in range(args.repeat):
                shift = round_number % len(commands)
                for name, argv_, cwd, env in commands[shift:] + commands[:shift]:
                    wall, used = run_once(argv_, cwd, env)
                    times[name].append(wall)
                    cpu[name].append(used)
            profiles = {name: import_profile(argv_, cwd, env) for name, argv_, cwd, env in commands}
        load = os.getloadavg()
        print(f"gpuguardctl start-up, {args.repeat} interleaved runs each, medians "
              f"({os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
        floor = statistics.median(times["python -c pass"])
        print(f"{'command':<40} {'median':>9} {'min':>9} {'over python':>12} {'cpu':>9} "
              f"{'modules':>8} {'imports':>9}")
        for name, *_ in commands:
            values = times[name]
            modules, imports = profiles[name]
            print(f"{name:<40} {statistics.median(values) * 1000:>6.0f} ms {min(values) * 1000:>6.0f} ms "
                  f"{(statistics.median(values) - floor) * 1000:>9.0f} ms "
                  f"{statistics.median(cpu[name]) * 1000:>6.0f} ms {modules:>8} {imports * 1000:>6.0f} ms")
        if args.peer:
            for verb in verbs:
                now, peer = f"gpuguardctl {verb} (now)", f"gpuguardctl {verb} (peer)"
                print(f"ratio now/peer, gpuguardctl {verb}: "
                      f"{statistics.median(times[now]) / statistics.median(times[peer]):.2f} wall, "
                      f"{statistics.median(cpu[now]) / statistics.median(cpu[peer]):.2f} CPU")
        return 0
    except common.BenchError as exc:
        print(f"bench_startup: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        host.close()
        bus.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The start gate (`gpuguardctl wait`, Manager.Wait): how soon it passes, and what waiting costs.

Runs the real daemon on the fake NVML against its own dbus-daemon (bench_dbus.py's bus and host)
and measures:

* latency: a holder on GPU 0 whose memory the fake NVML releases `--release-ms` after the
  process dies (release_delay_ms); a Wait call is in flight when the holder is killed. The
  figure is the time from the memory actually being back, on the fake NVML's own clock (it
  logs when it found the pid gone: FAKE_NVML_EVENTS, plus the delay), to the Wait reply
  arriving, minus `--stable`. Target: at most 50 ms. The same for `gpuguardctl wait` as a
  whole process (its exit), for information: an interpreter's exit is on top;
* cost: `--waiters` clients (default 20) each in a Wait call on a held GPU for `--cpu-sec`
  seconds (the daemon polls NVML fast meanwhile); the daemon's CPU over that window, in % of
  one core. Target: under 1 %.

Prints the figures and the verdicts; `--json PATH` writes them too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import bench_dbus
import common
from dbus_fast import Message, MessageType, Variant

from tests.dbus_harness import BUS_NAME, MANAGER, MANAGER_PATH, BusDaemon
from tests.fakenvml import EVENTS_ENV, GIB

HOLDER = bench_dbus.HOLDER
LATENCY_TARGET_MS = 50.0
CPU_TARGET_PERCENT = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="latency rounds (default 10)")
    parser.add_argument("--stable", type=float, default=1.0, help="--stable of each wait, s")
    parser.add_argument("--release-ms", type=int, default=300,
                        help="how long the fake NVML keeps a dead holder's memory")
    parser.add_argument("--waiters", type=int, default=20)
    parser.add_argument("--cpu-sec", type=float, default=20.0, help="the cost window, s")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if min(args.rounds, args.waiters, args.cpu_sec, args.release_ms + 1) <= 0 or args.stable < 0:
        parser.error("--rounds, --waiters and --cpu-sec must be positive")
    return args


class GateHost(bench_dbus.Host):
    """bench_dbus's host (no holders of its own), with the fake NVML's death log."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 0)
        self.events = root / "nvml-events"

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, EVENTS_ENV: str(self.events)}

    def hold(self, gpu: int, release_ms: int = 0) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(HOLDER), "--hold", self.nodes[f"nvidia{gpu}"],
                                 "--comm", f"gate-bench-{gpu}"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        pid = int(proc.stdout.readline().split()[1])
        self.state.add_proc(gpu, pid, 8 * GIB, release_delay_ms=release_ms)
        self.state.write(self.state_path)
        self.procs.append(proc)
        return proc

    def forget(self, proc: subprocess.Popen[str]) -> None:
        self.state.remove_proc(proc.pid)
        self.state.write(self.state_path)

    def dead_ns(self, pid: int) -> int:
        for line in self.events.read_text().splitlines():
            _, found, ns = line.split()
            if int(found) == pid:
                return int(ns)
        raise common.BenchError(f"the fake NVML never saw pid {pid} die")


def wait_message(gpu: int, stable_ms: int, timeout_ms: int) -> Message:
    options = {"gpus": Variant("au", [gpu]), "stable_ms": Variant("u", stable_ms),
               "timeout_ms": Variant("u", timeout_ms)}
    return Message(destination=BUS_NAME, path=MANAGER_PATH, interface=MANAGER, member="Wait",
                   signature="a{sv}", body=[options])


async def one_latency(address: str, host: GateHost, args: argparse.Namespace) -> float:
    """Kill a holder while a Wait is in flight; ms from the memory's release to the reply,
    minus --stable."""
    holder = host.hold(0, args.release_ms)
    bus = await bench_dbus.connect(address)
    try:
        # The daemon must have seen the holder before the Wait starts, or it could pass at once.
        while True:
            reply = await bus.call(wait_message(0, 0, 1))
            if not reply.body[0]["free"].value:
                break
            await asyncio.sleep(0.05)
        call = asyncio.ensure_future(bus.call(wait_message(0, int(args.stable * 1000), 20000)))
        await asyncio.sleep(0.5)
        holder.kill()
        holder.wait()
        reply = await call
        answered = time.monotonic_ns()
    finally:
        bus.disconnect()
    if reply.message_type != MessageType.METHOD_RETURN or not reply.body[0]["free"].value:
        raise common.BenchError(f"Wait did not pass: {reply.error_name} {reply.body}")
    released = host.dead_ns(holder.pid) + args.release_ms * 1_000_000
    host.forget(holder)
    return float((answered - released) / 1e6 - args.stable * 1000)


def cli_latency(address: str, host: GateHost, args: argparse.Namespace) -> float:
    """The same through `gpuguardctl wait`, to its exit."""
    holder = host.hold(0, args.release_ms)
    env = {**host.env, "GPUGUARD_BUS_ADDRESS": address}
    seen = subprocess.run([sys.executable, "-m", "gpuguardd.cli.main", "wait", "--gpu", "0",
                           "--stable", "0", "--timeout", "0.5"], env=env, cwd=host.checkout,
                          capture_output=True, text=True, timeout=60, check=False)
    if seen.returncode == 0:
        raise common.BenchError("the gate passed with the holder alive")
    proc = subprocess.Popen([sys.executable, "-m", "gpuguardd.cli.main", "wait", "--gpu", "0",
                             "--stable", str(args.stable), "--timeout", "30"], env=env,
                            cwd=host.checkout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(1.0)
    holder.kill()
    holder.wait()
    out, err = proc.communicate(timeout=60)
    exited = time.monotonic_ns()
    if proc.returncode != 0:
        raise common.BenchError(f"gpuguardctl wait exited {proc.returncode}: {out}{err}")
    released = host.dead_ns(holder.pid) + args.release_ms * 1_000_000
    host.forget(holder)
    return float((exited - released) / 1e6 - args.stable * 1000)


async def waiters_cost(address: str, daemon_pid: int, args: argparse.Namespace) -> float:
    """% of one core the daemon uses while --waiters clients wait on a held GPU."""
    buses = [await bench_dbus.connect(address) for _ in range(args.waiters)]
    stop = time.monotonic() + args.cpu_sec + 1.0

    async def waiter(bus: Any) -> None:
        while time.monotonic() < stop:
            left = int(max(1.0, (stop - time.monotonic()) * 1000))
            reply = await bus.call(wait_message(1, 1000, min(left, 20000)))
            if reply.message_type != MessageType.METHOD_RETURN or reply.body[0]["free"].value:
                raise common.BenchError(f"a waiter passed or failed: {reply.body}")

    tasks = [asyncio.ensure_future(waiter(bus)) for bus in buses]
    try:
        await asyncio.sleep(0.5)  # every waiter in its call, the daemon polling fast
        window = bench_dbus.CpuWindow(daemon_pid)
        await asyncio.sleep(args.cpu_sec)
        _, [percent] = window.close()
        await asyncio.gather(*tasks)
    finally:
        for bus in buses:
            bus.disconnect()
    return percent


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gpuguard-bench-gate-"))
    bus = BusDaemon()
    host = GateHost(root)
    try:
        with bench_dbus.daemon(host, bus.address) as (proc, _):
            latencies = [asyncio.run(one_latency(bus.address, host, args)) for _ in range(args.rounds)]
            cli = [cli_latency(bus.address, host, args) for _ in range(max(1, args.rounds // 3))]
            held = host.hold(1)
            # The peer: the same daemon over the same time with the GPU held and nobody
            # waiting, so that the row measures what the waiters cost and not the machine.
            time.sleep(0.5)
            window = bench_dbus.CpuWindow(proc.pid)
            time.sleep(args.cpu_sec)
            _, [alone] = window.close()
            cost = asyncio.run(waiters_cost(bus.address, proc.pid, args))
            host.forget(held)
    finally:
        host.close()
        bus.close()
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return {"latency_ms": latencies, "cli_latency_ms": cli, "waiters": args.waiters,
            "cpu_percent": cost, "alone_cpu_percent": alone, "stable_s": args.stable, "release_ms": args.release_ms}


def print_results(results: dict[str, Any]) -> None:
    lat, cli = results["latency_ms"], results["cli_latency_ms"]
    print(f"gate latency (memory back on the fake NVML's clock -> Wait reply, minus --stable "
          f"{results['stable_s']:g} s), {len(lat)} rounds: median {statistics.median(lat):.1f} ms, "
          f"max {max(lat):.1f} ms")
    print(f"gpuguardctl wait to its exit, {len(cli)} rounds: median {statistics.median(cli):.1f} ms, "
          f"max {max(cli):.1f} ms")
    added = results["cpu_percent"] - results["alone_cpu_percent"]
    print(f"gpuguardd CPU with {results['waiters']} waiters: {results['cpu_percent']:.2f} % of one core; "
          f"the same daemon with nobody waiting: {results['alone_cpu_percent']:.2f} %; "
          f"the waiters' cost: {added:+.2f} %")
    ok = max(lat) <= LATENCY_TARGET_MS
    print(f"target gate latency at most {LATENCY_TARGET_MS:g} ms: {'met' if ok else 'MISSED'}")
    ok = added < CPU_TARGET_PERCENT
    print(f"target {results['waiters']} waiters cost the daemon under {CPU_TARGET_PERCENT:g} % of a core: "
          f"{'met' if ok else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_gate.py needs root (device nodes of its own numbers)", file=sys.stderr)
        return 2
    results = run(args)
    print_results(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

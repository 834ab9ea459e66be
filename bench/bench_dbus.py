"""gpuguardd over D-Bus: call latency under concurrency, startup time, idle cost.

Runs the real daemon on the fake NVML against its own dbus-daemon (with the project's system
bus policy), with a few real holder processes on fake device nodes of this run's own numbers
(bench/common.py), and measures:

* latency (p50, p99) of ListHolders and GetHistory with 1, 10 and 100 concurrent clients, each
  on its own connection calling back to back;
* the time from starting gpuguardd to READY=1 (sd_notify);
* idle RSS and CPU over --idle-sec seconds (default 60) at the default PollIntervalSec.

    sudo .venv/bin/python bench/bench_dbus.py [--idle-sec 60] [--json bench/results/dbus.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import common
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.dbus_harness import BUS_NAME, MANAGER, MANAGER_PATH, BusDaemon
from tests.fakenvml import GIB, FakeNvmlState, build_library, process_env

ROOT = Path(__file__).resolve().parent.parent
HOLDER = ROOT / "tests" / "holder.py"
CONCURRENCY = (1, 10, 100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--idle-sec", type=float, default=60.0, help="idle measurement (seconds)")
    parser.add_argument("--calls", type=int, default=1000,
                        help="calls per method and concurrency level (split among the clients)")
    parser.add_argument("--holders", type=int, default=20, help="holder processes on the fake GPUs")
    parser.add_argument("--history", type=int, default=200, help="reports in the history")
    parser.add_argument("--starts", type=int, default=5, help="daemon starts timed (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


class Host:
    """Fake GPUs: device nodes of this run's own numbers, the fake NVML, a configuration."""

    def __init__(self, root: Path, holders: int) -> None:
        self.root = root
        self.nodes = common.make_nodes(root / "dev")
        self.libdir = build_library(root / "lib")
        self.state_path = root / "nvml.state"
        self.state = FakeNvmlState()
        for gpu in range(2):
            self.state.add_gpu(minor=int(os.minor(os.stat(self.nodes[f"nvidia{gpu}"]).st_rdev)))
        self.config = root / "gpuguard.conf"
        self.config.write_text(
            f"[Devices]\nPaths=\nPaths={root}/dev/nvidia*\n"
            f"AllowMajors={' '.join(map(str, common.ALLOW_MAJORS))}\n[Sweep]\nGraceSec=2\n"
            f"[Daemon]\nRuntimeDirectory={root}/run\nStateDirectory={root}/state\n")
        self.procs: list[subprocess.Popen[str]] = []
        for n in range(holders):
            gpu = n % 2
            proc = subprocess.Popen([sys.executable, str(HOLDER), "--hold", self.nodes[f"nvidia{gpu}"],
                                     "--hold", self.nodes["nvidia-uvm"], "--comm", f"bench-{n}"],
                                    stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            pid = int(proc.stdout.readline().split()[1])
            self.state.add_proc(gpu, pid, GIB)
            self.procs.append(proc)
        self.state.write(self.state_path)

    @property
    def env(self) -> dict[str, str]:
        return process_env(self.libdir, self.state_path, ROOT)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        common.unmount_nodes(self.root / "dev")


@contextmanager
def daemon(host: Host, address: str) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """gpuguardd, and the seconds it took from exec to READY=1."""
    sock_dir = Path(tempfile.mkdtemp(prefix="gg-bench-"))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(30)
    env = host.env
    env["NOTIFY_SOCKET"] = str(sock_dir / "notify")
    log = open(host.root / "gpuguardd.log", "ab")  # noqa: SIM115
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gpuguardd.daemon.main", "--bus-address", address,
                             "--config", str(host.config)], env=env, stderr=log,
                            stdout=subprocess.DEVNULL)
    try:
        while b"READY=1" not in notify.recv(4096).split(b"\n"):
            pass
        yield proc, time.perf_counter() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
        notify.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


async def call(bus: MessageBus, member: str, signature: str, body: list[Any]) -> None:
    reply = await bus.call(Message(destination=BUS_NAME, path=MANAGER_PATH, interface=MANAGER,
                                   member=member, signature=signature, body=body))
    if reply.message_type != MessageType.METHOD_RETURN:
        raise common.BenchError(f"{member}: {reply.error_name} {reply.body}")


async def latency(address: str, member: str, signature: str, body: list[Any], clients: int,
                  calls: int) -> list[float]:
    buses = [await MessageBus(bus_address=address).connect() for _ in range(clients)]
    per_client = max(1, calls // clients)
    samples: list[float] = []

    async def client(bus: MessageBus) -> None:
        for _ in range(per_client):
            start = time.perf_counter()
            await call(bus, member, signature, body)
            samples.append(time.perf_counter() - start)

    await call(buses[0], member, signature, body)  # warm
    await asyncio.gather(*(client(bus) for bus in buses))
    for bus in buses:
        bus.disconnect()
    return samples


async def fill_history(address: str, count: int) -> None:
    from dbus_fast import Variant
    bus = await MessageBus(bus_address=address).connect()
    for n in range(count):
        await call(bus, "Sweep", "a{sv}", [{"dry_run": Variant("b", True),
                                            "reason": Variant("s", f"bench {n}")}])
    bus.disconnect()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"latency": [], "startup_s": [], "idle": {}}
    root = Path(tempfile.mkdtemp(prefix="gpuguard-bench-dbus-"))
    bus = BusDaemon()
    host = Host(root, args.holders)
    try:
        for _ in range(args.starts):
            with daemon(host, bus.address) as (_, ready):
                results["startup_s"].append(ready)
        with daemon(host, bus.address) as (proc, _):
            asyncio.run(fill_history(bus.address, args.history))
            for member, signature, body in (("ListHolders", "a{sv}", [{}]), ("GetHistory", "u", [10])):
                for clients in CONCURRENCY:
                    samples = asyncio.run(latency(bus.address, member, signature, body, clients,
                                                  args.calls))
                    results["latency"].append({
                        "method": member, "clients": clients, "calls": len(samples),
                        "p50_ms": percentile(samples, 50) * 1000,
                        "p99_ms": percentile(samples, 99) * 1000})
            time.sleep(2)  # let the last rescans settle
            cpu0, wall0 = proc_cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.idle_sec)
            cpu = proc_cpu_seconds(proc.pid) - cpu0
            wall = time.monotonic() - wall0
            results["idle"] = {"seconds": wall, "cpu_s": cpu, "cpu_percent": 100 * cpu / wall,
                               "rss_mib": proc_rss_mib(proc.pid)}
    finally:
        host.close()
        bus.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"gpuguardd over D-Bus ({args.holders} holders, {args.history} reports in the history, "
          f"{os.cpu_count()} CPUs)")
    print(f"{'method':<12} {'clients':>7} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for row in results["latency"]:
        print(f"{row['method']:<12} {row['clients']:>7} {row['calls']:>6} {row['p50_ms']:>8.2f} "
              f"{row['p99_ms']:>8.2f}")
    starts = results["startup_s"]
    print(f"startup to READY=1: median {statistics.median(starts) * 1000:.0f} ms "
          f"(min {min(starts) * 1000:.0f}, max {max(starts) * 1000:.0f}, {len(starts)} starts)")
    idle = results["idle"]
    print(f"idle over {idle['seconds']:.0f} s: CPU {idle['cpu_s']:.2f} s ({idle['cpu_percent']:.3f} %), "
          f"RSS {idle['rss_mib']:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_dbus.py needs root (device nodes, reading other processes' fds)", file=sys.stderr)
        return 2
    common.require_environment(["dbus-daemon", "gcc"])
    results = run(args)
    print_table(results, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

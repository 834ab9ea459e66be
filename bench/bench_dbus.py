"""gpuguardd over D-Bus: latency as dashboards load it, throughput beside a minimal dbus-fast
service on the same bus, startup time, idle cost.

Runs the real daemon on the fake NVML against its own dbus-daemon (with the project's system
bus policy), with a few real holder processes on fake device nodes of this run's own numbers
(bench/common.py) and `--history` dry-run reports in its history, and measures:

* open loop (how dashboards load it): `--clients` connections together making `--rate` calls
  a second, arrivals a Poisson process, each call ListHolders or GetHistory(10) at random, for
  `--seconds`; latency from each call's scheduled time (so a stalled daemon cannot hide the
  calls it delayed), p50/p99/max per method, for gpuguardd and the peer (below). The target:
  p99 under 10 ms for both methods;
* closed loop: the same clients calling back to back; calls/s and p99, for gpuguardd and for
  the peer, a minimal dbus-fast service on the same bus that answers each method with the very
  reply gpuguardd gave (same size, same types), and does nothing else: the ceiling of a Python
  D-Bus service on this machine. The ratio gpuguardd/peer is printed;
* the time from starting gpuguardd to READY=1 (sd_notify);
* idle RSS and CPU over --idle-sec seconds (default 60) at the default PollIntervalSec.

The clients run in `--client-procs` processes of their own (asyncio, dbus-fast), so neither
side shares an interpreter with them, with Python's cyclic garbage collector off while they
measure (its pauses in a client were the p99 of both services). Rounds alternate gpuguardd and the peer, and the
medians are reported with the load average: the machine is shared.

    sudo .venv/bin/python bench/bench_dbus.py [--seconds 10] [--rounds 3] [--idle-sec 60]
                                              [--json bench/results/dbus.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import select
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
from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from gpuguardd.bus.compat import repair_writer
from tests.dbus_harness import BUS_NAME, MANAGER, MANAGER_PATH, BusDaemon
from tests.fakenvml import GIB, FakeNvmlState, build_library, process_env

ROOT = Path(__file__).resolve().parent.parent
HOLDER = ROOT / "tests" / "holder.py"
PEER_NAME = "org.gpuguard.BenchPeer"
# (name shown, member, signature, body): what a dashboard asks for.
METHODS: tuple[tuple[str, str, str, list[Any]], ...] = (
    ("ListHolders", "ListHolders", "a{sv}", [{}]),
    ("GetHistory(10)", "GetHistory", "u", [10]),
)
P99_TARGET_MS = 10.0

PEER_POLICY = """<?xml version="1.0"?>
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <include>{project_policy}</include>
  <policy user="root">
    <allow own="{peer}"/>
  </policy>
  <policy context="default">
    <allow send_destination="{peer}"/>
  </policy>
</busconfig>
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds (gpuguardd and the peer alternate; medians reported)")
    parser.add_argument("--clients", type=int, default=100, help="client connections")
    parser.add_argument("--rate", type=float, default=200.0, help="open loop: calls a second, all clients")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the clients run in")
    parser.add_argument("--idle-sec", type=float, default=60.0, help="idle measurement (0: skip)")
    parser.add_argument("--nvml-poller", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--holders", type=int, default=20, help="holder processes on the fake GPUs")
    parser.add_argument("--history", type=int, default=200, help="reports in the history")
    parser.add_argument("--starts", type=int, default=5, help="daemon starts timed (median)")
    parser.add_argument("--daemon-checkout", type=Path, default=ROOT, metavar="DIR",
                        help="run gpuguardd from this checkout (e.g. an older one, for before/after)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    # Internal: the client and peer processes are this file too.
    parser.add_argument("--client", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--peer-service", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.seconds, args.rounds, args.clients, args.rate, args.client_procs) <= 0:
        parser.error("--seconds, --rounds, --clients, --rate and --client-procs must be positive")
    return args


# -- the bus, the host, the daemon -------------------------------------------------------------


class BenchBus(BusDaemon):
    """tests/dbus_harness.py's system-like bus, the project's policy file included as installed,
    and the peer's name allowed beside it."""

    def __init__(self) -> None:
        self.policy_dir = Path(tempfile.mkdtemp(prefix="gpuguard-bench-policy-"))
        policy = self.policy_dir / "policy.conf"
        policy.write_text(PEER_POLICY.format(
            project_policy=ROOT / "dbus" / "org.gpuguard.GpuGuard1.conf", peer=PEER_NAME))
        super().__init__(policy)

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.policy_dir, ignore_errors=True)


class Host:
    """Fake GPUs: device nodes of this run's own numbers, the fake NVML, a configuration."""

    def __init__(self, root: Path, holders: int, checkout: Path = ROOT) -> None:
        self.root = root
        self.checkout = checkout.resolve()
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
        return process_env(self.libdir, self.state_path, self.checkout)

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
                            stdout=subprocess.DEVNULL, cwd=host.checkout)
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


@contextmanager
def peer_service(address: str) -> Iterator[subprocess.Popen[str]]:
    """The peer (this file with --peer-service), ready once it printed "ready"."""
    proc = subprocess.Popen([sys.executable, __file__, "--peer-service", address],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise common.BenchError(f"the peer service did not start: {line!r}")
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the peer exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def connect(address: str) -> MessageBus:
    """A connection with dbus-fast's writer repaired where the installed version needs it
    (gpuguardd/bus/compat.py: a full socket must not drop the connection); the peer and the
    clients need that as much as gpuguardd does under this load."""
    bus = await MessageBus(bus_address=address).connect()
    repair_writer(bus)
    return bus


async def call(bus: MessageBus, destination: str, member: str, signature: str,
               body: list[Any]) -> Message:
    reply = await bus.call(Message(destination=destination, path=MANAGER_PATH, interface=MANAGER,
                                   member=member, signature=signature, body=body))
    if reply.message_type != MessageType.METHOD_RETURN:
        raise common.BenchError(f"{member}: {reply.error_name} {reply.body}")
    return reply


async def fill_history(address: str, count: int) -> None:
    bus = await connect(address)
    for n in range(count):
        await call(bus, BUS_NAME, "Sweep", "a{sv}", [{"dry_run": Variant("b", True),
                                                      "reason": Variant("s", f"bench {n}")}])
    bus.disconnect()


async def reply_sizes(address: str) -> dict[str, int]:
    """Each method's reply as marshalled on the wire, in bytes."""
    bus = await connect(address)
    sizes = {}
    for name, member, signature, body in METHODS:
        reply = await call(bus, BUS_NAME, member, signature, body)
        sizes[name] = len(reply._marshall(False))
    bus.disconnect()
    return sizes


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# -- the peer: a minimal dbus-fast service -----------------------------------------------------


def peer_main(address: str) -> None:
    """Own PEER_NAME and answer ListHolders and GetHistory with gpuguardd's own replies, fetched
    once: a service that does nothing but answer (no authorization, no filter, no cache), on a
    connection with the one dbus-fast repair no service under load can do without."""
    from dbus_fast.service import ServiceInterface, method

    async def run() -> None:
        bus = await connect(address)
        replies = {member: (await call(bus, BUS_NAME, member, signature, body)).body[0]
                   for _, member, signature, body in METHODS}

        class Peer(ServiceInterface):
            def ListHolders(self, options: Any) -> Any:
                return replies["ListHolders"]

            def GetHistory(self, count: Any) -> Any:
                return replies["GetHistory"]

        # dbus-fast takes the signatures from the annotations.
        Peer.ListHolders.__annotations__ = {"options": "a{sv}", "return": "aa{sv}"}
        Peer.GetHistory.__annotations__ = {"count": "u", "return": "aa{sv}"}
        Peer.ListHolders = method()(Peer.ListHolders)  # type: ignore[method-assign]
        Peer.GetHistory = method()(Peer.GetHistory)  # type: ignore[method-assign]
        bus.export(MANAGER_PATH, Peer(MANAGER))
        await bus.request_name(PEER_NAME)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        loop.add_reader(sys.stdin.fileno(), _resolve, done)
        await done  # stdin readable: EOF, the benchmark is done with us
        bus.disconnect()

    asyncio.run(run())


# -- the clients -------------------------------------------------------------------------------


def client_main(spec_text: str) -> None:
    """One client process: connect, say "connected", wait for "go", measure, print JSON.
    Each call is one of spec["methods"] (chosen at random in the open loop, in turn for the
    closed loop's clients); latencies are kept per method."""
    spec = json.loads(spec_text)

    async def run() -> dict[str, Any]:
        buses = [await connect(spec["address"]) for _ in range(spec["clients"])]
        methods = [tuple(m) for m in spec["methods"]]
        for bus in buses:
            for member, signature, body in methods:
                await call(bus, spec["destination"], member, signature, body)  # warm: caches
        print("connected", flush=True)
        loop = asyncio.get_running_loop()
        go = loop.create_future()
        loop.add_reader(sys.stdin.fileno(), _resolve, go)
        await go
        loop.remove_reader(sys.stdin.fileno())
        # The clients' own pauses are not the service's latency: a full collection in a client
        # took ~70 ms every ~1.3 s here and was the p99 of gpuguardd and the peer alike. For
        # the measurement's few seconds the collector is off (reference counting still frees).
        gc.collect()
        gc.freeze()
        gc.disable()
        latencies: dict[str, list[float]] = {member: [] for member, _, _ in methods}
        errors = 0
        start = loop.time()
        deadline = start + spec["seconds"]

        async def timed(bus: MessageBus, method: tuple[Any, ...], scheduled: float) -> None:
            nonlocal errors
            member, signature, body = method
            try:
                await call(bus, spec["destination"], member, signature, body)
            except Exception:
                errors += 1
                return
            latencies[member].append(loop.time() - scheduled)

        if spec["mode"] == "closed":
            async def back_to_back(n: int, bus: MessageBus) -> None:
                while loop.time() < deadline:
                    await timed(bus, methods[n % len(methods)], loop.time())
            await asyncio.gather(*(back_to_back(n, bus) for n, bus in enumerate(buses)))
        else:
            rng = random.Random(spec["seed"])
            tasks: list[asyncio.Task[None]] = []
            at = start
            while True:
                at += rng.expovariate(spec["rate"])  # Poisson arrivals
                if at >= deadline:
                    break
                await asyncio.sleep(max(0.0, at - loop.time()))
                tasks.append(asyncio.ensure_future(timed(rng.choice(buses), rng.choice(methods), at)))
            await asyncio.gather(*tasks)
        elapsed = loop.time() - start
        for bus in buses:
            bus.disconnect()
        return {"latencies": latencies, "errors": errors, "elapsed": elapsed}

    print(json.dumps(asyncio.run(run())), flush=True)


def measure(address: str, destination: str, methods: list[tuple[str, str, list[Any]]],
            args: argparse.Namespace, mode: str, seed: int, cpu_of: dict[str, int]
            ) -> dict[str, dict[str, Any]]:
    """Run the clients (split over --client-procs processes), started together; with the CPU
    time each process of `cpu_of` ({"service": pid, "bus": pid}) spent per call meanwhile,
    which a loaded machine stretches far less than it does latency. A row per method."""
    procs = []
    per_proc = [args.clients // args.client_procs + (1 if i < args.clients % args.client_procs else 0)
                for i in range(args.client_procs)]
    try:
        for i, clients in enumerate(c for c in per_proc if c):
            spec = {"address": address, "destination": destination, "methods": methods,
                    "clients": clients, "mode": mode,
                    "seconds": args.seconds, "rate": args.rate * clients / args.clients,
                    "seed": seed * 1000 + i}
            procs.append(subprocess.Popen([sys.executable, __file__, "--client", json.dumps(spec)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for proc in procs:
            assert proc.stdout is not None
            if not _readline(proc, 120).startswith("connected"):
                raise common.BenchError(f"a client process failed to connect (exit {proc.poll()})")
        load = os.getloadavg()[0]
        cpu_before = {name: proc_cpu_seconds(pid) for name, pid in cpu_of.items()}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(_readline(proc, args.seconds * 10 + 120)) for proc in procs]
        cpu = {name: proc_cpu_seconds(pid) - cpu_before[name] for name, pid in cpu_of.items()}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    elapsed = max(r["elapsed"] for r in results)
    calls = sum(len(x) for r in results for x in r["latencies"].values())
    if not calls:
        raise common.BenchError(f"{destination}: no call succeeded")
    rows = {}
    for member, _, _ in methods:
        latencies = [x for r in results for x in r["latencies"][member]]
        if not latencies:
            raise common.BenchError(f"{member}: no call succeeded")
        rows[member] = {
            "calls": len(latencies), "errors": sum(r["errors"] for r in results),
            "calls_per_s": len(latencies) / elapsed, "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000, "max_ms": max(latencies) * 1000,
            "load": load,
            # CPU shared by all methods of the run: per call of any.
            **{f"{name}_cpu_ms_per_call": 1000 * seconds / calls for name, seconds in cpu.items()}}
    return rows


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise common.BenchError(f"a client process said nothing for {timeout:.0f} s")
    return proc.stdout.readline()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """The CPU each of `pids` uses from now until close()."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self.started = time.monotonic()
        self.cpu = [proc_cpu_seconds(pid) for pid in pids]

    def close(self) -> tuple[float, list[float]]:
        """The window's length in seconds, and each pid's CPU over it in % of one core."""
        wall = time.monotonic() - self.started
        return wall, [100 * (proc_cpu_seconds(pid) - cpu) / wall for pid, cpu in zip(self.pids, self.cpu)]


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("calls_per_s", "p50_ms", "p99_ms", "max_ms", "load", "service_cpu_ms_per_call",
            "bus_cpu_ms_per_call")
    return {**{k: statistics.median(r[k] for r in rows) for k in keys},
            "calls": sum(r["calls"] for r in rows), "errors": sum(r["errors"] for r in rows),
            "rounds": len(rows)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"startup_s": [], "idle": {}, "open": {}, "closed": {},
                               "reply_bytes": {}, "cpus": os.cpu_count()}
    root = Path(tempfile.mkdtemp(prefix="gpuguard-bench-dbus-"))
    bus = BenchBus()
    host = Host(root, args.holders, args.daemon_checkout)
    try:
        for _ in range(args.starts):
            with daemon(host, bus.address) as (_, ready):
                results["startup_s"].append(ready)
        with daemon(host, bus.address) as (proc, _):
            asyncio.run(fill_history(bus.address, args.history))
            results["reply_bytes"] = asyncio.run(reply_sizes(bus.address))
            with peer_service(bus.address) as peer:
                open_rows: dict[str, dict[str, list[dict[str, Any]]]] = {
                    name: {"gpuguardd": [], "peer": []} for name, *_ in METHODS}
                closed_rows: dict[str, dict[str, list[dict[str, Any]]]] = {
                    name: {"gpuguardd": [], "peer": []} for name, *_ in METHODS}
                everything = [(member, signature, body) for _, member, signature, body in METHODS]
                for round_number in range(args.rounds):
                    sides = [("gpuguardd", BUS_NAME, proc.pid), ("peer", PEER_NAME, peer.pid)]
                    if round_number % 2:
                        sides.reverse()  # neither side always first
                    # Open loop: the dashboards' mix, each arrival one of the methods.
                    for side, destination, pid in sides:
                        mixed = measure(bus.address, destination, everything, args, "open",
                                        round_number, {"service": pid, "bus": bus.proc.pid})
                        for name, member, _, _ in METHODS:
                            open_rows[name][side].append(mixed[member])
                    for name, member, signature, body in METHODS:
                        for side, destination, pid in sides:
                            closed_rows[name][side].append(measure(
                                bus.address, destination, [(member, signature, body)], args,
                                "closed", round_number, {"service": pid, "bus": bus.proc.pid})[member])
                results["open"] = {name: {side: _median_row(rows) for side, rows in by_side.items()}
                                   for name, by_side in open_rows.items()}
                results["closed"] = {name: {side: _median_row(rows) for side, rows in by_side.items()}
                                     for name, by_side in closed_rows.items()}
                results["runs"] = {"open": open_rows, "closed": closed_rows}
            if args.idle_sec > 0:
                # The peer polls NVML at the default PollIntervalSec (2 s) over the same window.
                poller = subprocess.Popen([sys.executable, __file__, "--nvml-poller", "2"],
                                          env=host.env, stdout=subprocess.PIPE, text=True)
                try:
                    _readline(poller, 30)
                    time.sleep(2)  # let the last rescans settle
                    window = CpuWindow(proc.pid, poller.pid)
                    time.sleep(args.idle_sec)
                    wall, (percent, peer_percent) = window.close()
                    results["idle"] = {"seconds": wall, "cpu_s": percent * wall / 100,
                                       "cpu_percent": percent, "rss_mib": proc_rss_mib(proc.pid),
                                       "peer_cpu_percent": peer_percent,
                                       "peer_rss_mib": proc_rss_mib(poller.pid)}
                finally:
                    poller.kill()
                    poller.wait()
    finally:
        host.close()
        bus.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    if args.daemon_checkout.resolve() != ROOT:
        print(f"gpuguardd from {args.daemon_checkout}")
    print(f"gpuguardd over D-Bus ({args.holders} holders, {args.history} reports in the history, "
          f"{results['cpus']} CPUs, {args.clients} clients in {args.client_procs} processes, "
          f"{args.rounds} rounds of {args.seconds:g} s, medians)")
    sizes = ", ".join(f"{name} {size / 1024:.1f} KiB" for name, size in results["reply_bytes"].items())
    print(f"reply sizes on the wire: {sizes}")
    print(f"\nopen loop, {args.rate:g} calls/s (Poisson) from {args.clients} clients, "
          f"each call one of the methods at random:")
    print(f"{'method':<15} {'service':<10} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'cpu/call':>9} {'load':>6}  target p99 < 10 ms")
    for name, sides in results["open"].items():
        for side, row in sides.items():
            verdict = ("met" if row["p99_ms"] < P99_TARGET_MS else "MISSED") if side == "gpuguardd" else ""
            print(f"{name:<15} {side:<10} {row['calls']:>6} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
                  f"{row['max_ms']:>8.1f} {row['service_cpu_ms_per_call']:>6.2f} ms {row['load']:>6.1f}  "
                  f"{verdict}")
    print(f"\nclosed loop, {args.clients} clients back to back:")
    print(f"{'method':<15} {'service':<10} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'cpu/call':>9} {'bus cpu':>9} {'load':>6}")
    for name, sides in results["closed"].items():
        for side, row in sides.items():
            print(f"{name:<15} {side:<10} {row['calls_per_s']:>8.0f} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f} {row['service_cpu_ms_per_call']:>6.2f} ms "
                  f"{row['bus_cpu_ms_per_call']:>6.2f} ms {row['load']:>6.1f}")
        ratio = sides["gpuguardd"]["calls_per_s"] / sides["peer"]["calls_per_s"]
        cpu_ratio = (sides["gpuguardd"]["service_cpu_ms_per_call"]
                     / max(sides["peer"]["service_cpu_ms_per_call"], 1e-9))
        print(f"ratio gpuguardd/peer ({name}): {ratio:.2f} x the calls/s, {cpu_ratio:.2f} x the CPU "
              f"a call")
    errors = sum(r["errors"] for loop in ("open", "closed") for sides in results[loop].values()
                 for r in sides.values())
    if errors:
        print(f"calls that failed: {errors}")
    starts = results["startup_s"]
    print(f"\nstartup to READY=1: median {statistics.median(starts) * 1000:.0f} ms "
          f"(min {min(starts) * 1000:.0f}, max {max(starts) * 1000:.0f}, {len(starts)} starts)")
    idle = results["idle"]
    if idle:
        print(f"idle over {idle['seconds']:.0f} s: CPU {idle['cpu_s']:.2f} s ({idle['cpu_percent']:.3f} %), "
              f"RSS {idle['rss_mib']:.1f} MiB; a bare NVML poller (pynvml, every 2 s): "
              f"{idle['peer_cpu_percent']:.3f} % CPU, RSS {idle['peer_rss_mib']:.1f} MiB; ratio "
              f"{idle['cpu_percent'] / max(idle['peer_cpu_percent'], 1e-9):.2f} x")
    print(f"load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


def nvml_poller_main(interval: float) -> None:
    """The idle peer: what any NVML poller does at gpuguardd's PollIntervalSec, and nothing
    else: each GPU's memory and compute processes through pynvml, one thread, no bus."""
    import pynvml

    pynvml.nvmlInit()
    print("ready", flush=True)
    while True:
        time.sleep(interval)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
            pynvml.nvmlDeviceGetComputeRunningProcesses(handle)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nvml_poller:
        nvml_poller_main(args.nvml_poller)
        return 0
    if args.client:
        client_main(args.client)
        return 0
    if args.peer_service:
        peer_main(args.peer_service)
        return 0
    if os.geteuid() != 0:
        print("bench_dbus.py needs root (device nodes, reading other processes' fds)", file=sys.stderr)
        return 2
    common.require_environment(["dbus-daemon", "gcc", "setpriv"])
    common.exit_on_signals()
    try:
        results = run(args)
    except common.BenchError as exc:
        print(f"bench_dbus: FAILED: {exc}", file=sys.stderr)
        return 1
    print_table(results, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

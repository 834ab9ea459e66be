"""Real D-Bus plumbing for the service tests: a system-like bus, gpuguardd, clients, a polkit.

* BusDaemon: a dbus-daemon of the tests' own with a system-bus policy (deny own, deny method
  calls by default) that includes the project's dbus/org.gpuguard.GpuGuard1.conf, so the
  policy file is exercised as installed. Its socket lives in a world-readable directory so a
  caller of another uid (setpriv) can connect.
* GuardDaemon: gpuguardd as a subprocess on the fake NVML, with NOTIFY_SOCKET pointing at a
  socket the tests read (READY=1, STATUS=, WATCHDOG=1, STOPPING=1).
* SignalRecorder: a dbus-fast subscriber in a thread that records every signal the daemon
  sends (Manager signals, PropertiesChanged, InterfacesAdded/Removed).
* Fake polkit: `python -m tests.dbus_harness polkit ...` owns org.freedesktop.PolicyKit1 and
  answers CheckAuthorization from a rules file, logging each request for the tests.

Loaded as a pytest plugin by the test modules (pytest_plugins) after they import it, so its
asserts are plain: PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import helpers
from tests.conftest import GiB, GpuHost

# The bus tests import these with the rest of the harness.
wait_until = helpers.wait_until
unwrap_busctl = helpers.unwrap_busctl
ROOT = Path(__file__).resolve().parent.parent
# The interpreter gpuguardd and gpuguardctl run on; point it at /usr/bin/python3 (with
# PYTHONPATH for pynvml) to test against the distribution's dbus-fast.
PYTHON = os.environ.get("GPUGUARD_TEST_PYTHON", sys.executable)
EXTRA_PYTHONPATH = os.environ.get("GPUGUARD_TEST_PYTHONPATH", "")
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
BUS_NAME = "org.gpuguard.GpuGuard1"
MANAGER_PATH = "/org/gpuguard/GpuGuard1"
MANAGER = BUS_NAME + ".Manager"
GPU = BUS_NAME + ".Gpu"

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <deny send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"
          send_member="UpdateActivationEnvironment"/>
  </policy>
  <policy user="root">
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Monitoring"/>
  </policy>
  <include>{project_policy}</include>
  <!-- the tests' stand-ins for polkitd and systemd's manager (tests/adversarial) -->
  <policy user="root">
    <allow own="org.freedesktop.PolicyKit1"/>
    <allow own="org.freedesktop.systemd1"/>
  </policy>
  <policy context="default">
    <allow send_destination="org.freedesktop.PolicyKit1"/>
    <allow send_destination="org.freedesktop.systemd1"/>
  </policy>
  <limit name="max_connections_per_user">1024</limit>
  <limit name="max_completed_connections">2048</limit>
  <limit name="max_incomplete_connections">256</limit>
</busconfig>
"""


# The private GPU's node is named nvidia173 (the engine takes a GPU's minor from the name when
# the major is no NVIDIA driver's). Its number is major 122 (local use; tests/conftest.py takes
# 120, the benchmarks 121) with a random minor, so concurrent runs never share it either.
PRIVATE_MINOR = 173
PRIVATE_MAJOR = 122
COMM = "gg-holder"


def private_gpu(host: GpuHost, minor: int = PRIVATE_MINOR) -> int:
    """A GPU (the first one made: NVML index 2) whose device node number no other process on
    the machine uses; another `minor` (174, 175...) makes another."""
    node = host.dev / f"nvidia{minor}"
    if not node.exists():
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(PRIVATE_MAJOR, random.randrange(1 << 20)))
        host.state.add_gpu(minor=minor)
        host.publish()
    return next(index for index, gpu in enumerate(host.state.gpus) if gpu.minor == minor)


def private_holder(host: GpuHost, used: int = 2 * GiB, *extra: str,
                   minor: int = PRIVATE_MINOR) -> int:
    """A compute process (NVML lists it) on a private GPU, started and owned by the test."""
    index = private_gpu(host, minor)
    proc = host.spawn("--hold", str(host.dev / f"nvidia{minor}"), "--comm", COMM, *extra,
                      nvml=(index, used))
    return proc.pid



class BusDaemon:
    """A system-like dbus-daemon for the whole test session. `policy`: a file included in place
    of the project's policy (bench/bench_dbus.py's includes it and adds its peer's name)."""

    def __init__(self, policy: Path | None = None) -> None:
        # mkdtemp is 0700; others (the setpriv caller) must reach the socket.
        self.dir = Path(tempfile.mkdtemp(prefix="gpuguard-bus-"))
        os.chmod(self.dir, 0o755)
        self.socket = self.dir / "system_bus_socket"
        self.address = f"unix:path={self.socket}"
        self.config = self.dir / "bus.conf"
        self.config.write_text(BUS_CONFIG.format(
            socket=self.socket, project_policy=policy or ROOT / "dbus" / "org.gpuguard.GpuGuard1.conf"))
        self.log = open(self.dir / "dbus-daemon.log", "w")  # noqa: SIM115
        # --pdeathsig: a killed test run does not leave its bus behind (and its gpuguardd
        # exits when the bus goes).
        self.proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "dbus-daemon", f"--config-file={self.config}",
             "--nofork", "--nopidfile"], stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self.socket.exists, 10, "dbus-daemon's socket")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket collecting what the daemon says."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode("latin-1")))

    def lines(self) -> list[str]:
        with self._lock:
            return [line for _, text in self.messages for line in text.splitlines()]

    def wait_for(self, line: str, timeout: float = 20) -> None:
        wait_until(lambda: line in self.lines(), timeout, f"sd_notify {line!r}")

    def pause(self) -> None:
        """Stop reading but keep the socket: the daemon's datagrams pile up, as with a stuck systemd."""
        self._stop = True
        self._thread.join(timeout=2)

    def close(self) -> None:
        self.pause()
        self.sock.close()
        # The socket's directory is GuardDaemon.start's mkdtemp: a test run leaves nothing in /tmp.
        shutil.rmtree(self.path.parent, ignore_errors=True)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60,
        as_nobody: bool = False) -> Result:
    full = [*NOBODY, *argv] if as_nobody else argv
    done = subprocess.run(full, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    return Result(done.returncode, done.stdout, done.stderr)



@dataclass
class GuardDaemon:
    """A running gpuguardd and the ways an admin talks to it."""

    address: str
    host: GpuHost
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    notify: NotifyListener | None = None
    stderr_path: Path = field(default_factory=Path)
    extra_env: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    logs: list[str] = field(default_factory=list)
    # Every start's listener, closed (and its directory removed) by close(): a test may restart
    # the daemon, or end it itself (kill -9), without stop().
    listeners: list[NotifyListener] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = dict(self.host.env)
        env.update(self.extra_env)
        env["GPUGUARD_BUS_ADDRESS"] = self.address
        if EXTRA_PYTHONPATH:
            env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{EXTRA_PYTHONPATH}"
        return env

    def start(self, *extra_args: str, wait: bool = True, env: dict[str, str] | None = None) -> None:
        self.starts += 1
        self.stderr_path = self.workdir / f"gpuguardd-{self.starts}.log"
        # sun_path holds 108 bytes; pytest's tmp_path for a long test name does not fit.
        notify_path = Path(tempfile.mkdtemp(prefix="gg-notify-")) / "n.sock"
        self.notify = NotifyListener(notify_path)
        self.listeners.append(self.notify)
        run_env = dict(self.env)
        run_env.update(env or {})
        run_env["NOTIFY_SOCKET"] = str(notify_path)
        run_env.pop("GPUGUARD_BUS_ADDRESS", None)
        argv = [PYTHON, "-m", "gpuguardd.daemon.main", "--bus-address", self.address,
                "--config", str(self.host.config_path), *extra_args]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=run_env,
                                         cwd=str(ROOT))
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        assert self.proc is not None and self.notify is not None
        proc, notify = self.proc, self.notify

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gpuguardd exited with {proc.returncode}:\n{self.stderr()}")
            return "READY=1" in notify.lines()
        wait_until(ready, timeout, "gpuguardd READY=1")

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        self.logs.append(self.stderr())
        if self.notify is not None:
            self.notify.close()
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """After the daemon is gone: every start's notify socket and its directory."""
        for listener in self.listeners:
            listener.close()

    # -- admin tools ---------------------------------------------------------------------

    def busctl(self, *args: str, as_nobody: bool = False, timeout: float = 60) -> Result:
        return run(["busctl", f"--address={self.address}", *args], timeout=timeout,
                   as_nobody=as_nobody)

    def busctl_call(self, path: str, interface: str, member: str, *args: str,
                    as_nobody: bool = False, timeout: float = 60) -> Any:
        """The unwrapped reply body (a list); raises AssertionError with busctl's stderr."""
        result = self.busctl("call", "--json=short", BUS_NAME, path, interface, member, *args,
                             as_nobody=as_nobody, timeout=timeout)
        if result.returncode != 0:
            raise BusctlError(result.stderr.strip())
        if not result.stdout.strip():
            return []  # a method without out arguments
        return unwrap_busctl(result.json["data"])

    def manager(self, member: str, *args: str, as_nobody: bool = False, timeout: float = 60) -> Any:
        return self.busctl_call(MANAGER_PATH, MANAGER, member, *args, as_nobody=as_nobody,
                                timeout=timeout)

    def get_property(self, path: str, interface: str, name: str) -> Any:
        result = self.busctl("get-property", "--json=short", BUS_NAME, path, interface, name)
        if result.returncode != 0:
            raise BusctlError(result.stderr.strip())
        return unwrap_busctl(result.json["data"])

    def property_is(self, path: str, interface: str, name: str, expected: Any) -> bool:
        """For wait_until: False while the object does not exist (yet)."""
        try:
            return bool(self.get_property(path, interface, name) == expected)
        except BusctlError:
            return False

    def gdbus(self, *args: str, as_nobody: bool = False, timeout: float = 60) -> Result:
        return run(["gdbus", "call", "--address", self.address, "--dest", BUS_NAME, *args],
                   timeout=timeout, as_nobody=as_nobody)

    def ctl(self, *args: str, as_nobody: bool = False, timeout: float = 60) -> Result:
        return run([PYTHON, "-m", "gpuguardd.cli.main", *args], env=self.env,
                   timeout=timeout, as_nobody=as_nobody)


def dry_sweep(guard: GuardDaemon, reason: str) -> str:
    """A dry run of the whole host with `reason`; its report id."""
    report_id: str = guard.manager("Sweep", "a{sv}", "2", "dry_run", "b", "true", "reason", "s",
                                   reason)[0]["id"]
    return report_id


class BusctlError(AssertionError):
    pass


# -- signal recorder -------------------------------------------------------------------------

@dataclass
class Signal:
    path: str
    interface: str
    member: str
    body: list[Any]
    at: float


class SignalRecorder:
    """Every signal from gpuguardd, with variants unwrapped, collected in a thread."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.signals: list[Signal] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise AssertionError(f"signal recorder did not start: {self._error}")

    def _main(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _listen(self) -> None:
        from dbus_fast import Message, MessageType
        from dbus_fast.aio import MessageBus

        from gpuguardd.bus.marshal import unwrap

        bus = await MessageBus(bus_address=self.address).connect()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()

        def handler(msg: Message) -> None:
            if msg.message_type == MessageType.SIGNAL and (msg.path or "").startswith(MANAGER_PATH):
                with self._lock:
                    self.signals.append(Signal(msg.path or "", msg.interface or "", msg.member or "",
                                               unwrap(list(msg.body)), time.monotonic()))

        bus.add_message_handler(handler)
        reply = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s",
            body=[f"type='signal',sender='{BUS_NAME}'"]))
        assert reply.message_type == MessageType.METHOD_RETURN
        self._ready.set()
        await self._stop.wait()
        bus.disconnect()

    def of(self, member: str, interface: str | None = None) -> list[Signal]:
        with self._lock:
            return [s for s in self.signals
                    if s.member == member and (interface is None or s.interface == interface)]

    def wait_for(self, member: str, predicate: Callable[[Signal], bool] = lambda s: True,
                 timeout: float = 20) -> Signal:
        def find() -> Signal | None:
            return next((s for s in self.of(member) if predicate(s)), None)
        found: Signal = wait_until(find, timeout, f"signal {member}")
        return found

    def property_changes(self, path: str, name: str) -> list[Any]:
        return [s.body[1][name] for s in self.of("PropertiesChanged")
                if s.path == path and name in s.body[1]]

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)


@contextmanager
def recording(address: str) -> Iterator[SignalRecorder]:
    recorder = SignalRecorder(address)
    try:
        yield recorder
    finally:
        recorder.close()


def leak_on(daemon: GuardDaemon, recorder: SignalRecorder, gpu: int, used: int = 5 * GiB) -> None:
    """Memory used on idle `gpu` with no process listed: waits for LeakSuspected (and checks its
    arguments) and for the GPU object's State "leaked"."""
    path = f"{MANAGER_PATH}/gpu/{gpu}"
    wait_until(lambda: daemon.property_is(path, GPU, "State", "idle"), 10, f"GPU {gpu} idle")
    daemon.host.state.gpus[gpu].base_used = used
    daemon.host.publish()
    leak = recorder.wait_for("LeakSuspected", lambda s: s.body[0] == gpu)
    assert leak.body == [gpu, daemon.host.state.gpus[gpu].uuid, used]
    wait_until(lambda: daemon.get_property(path, GPU, "State") == "leaked", 5, "State leaked")


# -- fake polkit -----------------------------------------------------------------------------

class FakePolkit:
    """Starts `python -m tests.dbus_harness polkit`; rules: uid -> allowed action ids.

    Not python-dbusmock's polkitd template, which answers every caller alike from one list of
    allowed actions (SetAllowed, AllowUnknown), always with is_challenge false, and keeps no
    record of who asked. The tests need what it cannot say: an answer per caller's uid (looked
    up from the subject's bus name, as polkitd does), a denial that is a challenge (what polkitd
    answers a user who could authenticate; the daemon logs it apart), and a log of each request with
    the subject, its uid, the flags (AllowUserInteraction) and the answer, which
    test_polkit_decides_for_other_users and test_polkit_is_asked_once_per_connection_and_action
    assert on. It would also bring dbus-python and PyGObject into the test dependencies.
    """

    def __init__(self, address: str, workdir: Path, rules: dict[int, list[str]],
                 challenge: bool = False) -> None:
        self.rules_path = workdir / "polkit-rules.json"
        self.log_path = workdir / "polkit-log.jsonl"
        self.rules_path.write_text(json.dumps({"rules": {str(k): v for k, v in rules.items()},
                                               "challenge": challenge}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.dbus_harness", "polkit", "--address", address,
             "--rules", str(self.rules_path), "--log", str(self.log_path)],
            stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"fake polkit did not start: {line!r}"

    def requests(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


async def _polkit_main(address: str, rules_path: str, log_path: str) -> None:
    from dbus_fast import Message, MessageType
    from dbus_fast.aio import MessageBus

    config = json.loads(Path(rules_path).read_text())
    bus = await MessageBus(bus_address=address).connect()

    async def answer(msg: Message) -> None:
        subject, action, _details, flags, _cancel = msg.body
        name = subject[1].get("name").value if "name" in subject[1] else ""
        creds = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionCredentials", signature="s",
            body=[name]))
        uid = creds.body[0]["UnixUserID"].value if creds.message_type == MessageType.METHOD_RETURN else -1
        granted = action in config["rules"].get(str(uid), [])
        with open(log_path, "a") as log:
            log.write(json.dumps({"kind": subject[0], "name": name, "uid": uid, "action": action,
                                  "flags": flags, "granted": granted}) + "\n")
        challenge = bool(config.get("challenge")) and not granted
        bus.send(Message.new_method_return(msg, "(bba{ss})", [[granted, challenge, {}]]))

    pending: set[asyncio.Task[None]] = set()

    def handler(msg: Message) -> bool:
        if msg.message_type == MessageType.METHOD_CALL and msg.member == "CheckAuthorization":
            task = asyncio.ensure_future(answer(msg))
            pending.add(task)
            task.add_done_callback(pending.discard)
            return True
        if msg.message_type == MessageType.METHOD_CALL:
            bus.send(Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", "no"))
            return True
        return False

    bus.add_message_handler(handler)
    await bus.request_name("org.freedesktop.PolicyKit1")
    print("ready", flush=True)
    await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    polkit = sub.add_parser("polkit")
    polkit.add_argument("--address", required=True)
    polkit.add_argument("--rules", required=True)
    polkit.add_argument("--log", required=True)
    args = parser.parse_args()
    asyncio.run(_polkit_main(args.address, args.rules, args.log))


if __name__ == "__main__":
    main()


# -- pytest fixtures (tests load this module with pytest_plugins) ------------------------------

import pytest  # noqa: E402

FAST_POLL = "PollIntervalSec=0.25\n"


@pytest.fixture(scope="session")
def system_bus() -> Iterator[BusDaemon]:
    if shutil.which("dbus-daemon") is None:
        pytest.fail("dbus-daemon is required (make deps installs it)")
    bus = BusDaemon()
    try:
        yield bus
    finally:
        bus.close()


@pytest.fixture
def daemon(gpu_host: Any, system_bus: BusDaemon, tmp_path: Path) -> Iterator[GuardDaemon]:
    """gpuguardd, not started yet (the test may change the configuration first)."""
    guard = GuardDaemon(address=system_bus.address, host=gpu_host, workdir=tmp_path)
    try:
        yield guard
    finally:
        try:
            if guard.proc is not None and guard.alive():
                code = guard.stop()
                assert code == 0, f"gpuguardd exited with {code} on SIGTERM:\n{guard.stderr()}"
        finally:
            guard.close()
        logs = "\n".join(guard.logs)
        assert "Traceback" not in logs, f"gpuguardd logged a traceback:\n{logs}"


@pytest.fixture
def guard(daemon: GuardDaemon) -> GuardDaemon:
    """gpuguardd running on the test bus, polling every 0.25 s."""
    daemon.host.write_config(FAST_POLL)
    daemon.start()
    return daemon


@pytest.fixture
def recorder(system_bus: BusDaemon) -> Iterator[SignalRecorder]:
    with recording(system_bus.address) as rec:
        yield rec

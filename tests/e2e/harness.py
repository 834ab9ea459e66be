"""A throwaway machine running the real systemd as PID 1, and gpuguard installed in it.

Used by the end-to-end tests (tests/e2e) and by `make demo` (demo/demo.py). The recipe is the
one in docs/testing.md, checked on Debian 12 hosts:

* `/` is bind-mounted (not recursively) to a scratch directory, and `systemd-nspawn
  --volatile=overlay` boots it: every write inside lands in a tmpfs overlay and is gone when
  the container stops. Never boot systemd on the host's own root: its tmpfiles setup empties
  the host's /tmp.
* `--register=no --keep-unit` because the host has no systemd (no machined, no host bus);
  `--link-journal=no` because host and container share a machine id.
* Commands run inside through `nsenter --all` into the container's PID 1 namespaces. They stay
  in the host's cgroup (the container shows it as "/.."), so nothing they start belongs to a
  unit unless it is started through systemd (systemctl, systemd-run).
* Files are written through /proc/<leader>/root, which resolves paths in the container's
  mount namespace: they land in the overlay, never on the host.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers import unwrap_busctl, wait_until
from tests.shipped import shipped

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FAKE_NVML_DIR = "/opt/fake-nvml"
FAKE_NVML_STATE = "/run/fake-nvml/state"
MiB = 1024 * 1024
GiB = 1024 * MiB

T = TypeVar("T")


class HarnessError(RuntimeError):
    """The throwaway machine could not be booted, reached or stopped."""


def require_tools() -> list[str]:
    """What is missing for a boot here (empty when everything is there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("systemd-nspawn", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not Path("/lib/systemd/systemd").exists():
        missing.append("/lib/systemd/systemd")
    if not VENV_PYTHON.exists():
        missing.append(str(VENV_PYTHON) + " (make venv)")
    return missing


BOOT_MASKED = ("prometheus.service", "prometheus-node-exporter.service", "slurmctld.service",
               "slurmd.service")

# The v1 freezer too (where the host has one): each machine's cgroup namespace is then rooted
# in a freezer cgroup of its own, so the job cgroups the real Slurm makes there
# (tests/e2e/test_slurm.py, proctrack/cgroup) belong to the machine and go with it.
CGROUP_ROOTS = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup",
                "/sys/fs/cgroup/freezer")


def make_cgroups(name: str) -> list[Path]:
    """A fresh cgroup called `name` in each mounted hierarchy that systemd uses."""
    made = []
    for root in CGROUP_ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue  # hybrid: /sys/fs/cgroup itself is a tmpfs holding the hierarchies
        path = Path(root) / name
        path.mkdir()
        made.append(path)
    return made


def remove_cgroups(paths: Sequence[Path]) -> None:
    """Remove the cgroups (and what the container's systemd left in them), deepest first."""
    for top in paths:
        if not top.exists():
            continue
        dirs = sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts),
                      reverse=True)
        for directory in dirs:
            for _ in range(50):  # the last processes may still be exiting
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def wait_for(what: str, check: Callable[[], T | None], timeout: float,
             interval: float = 0.1) -> T:
    """Poll `check` until it returns something other than None/False (0 and "" count: a
    PID, a text); HarnessError on timeout."""
    seen: list[T] = []

    def done() -> bool:
        value = check()
        if value is None or value is False:
            return False
        seen.append(value)
        return True
    wait_until(done, timeout, what, interval, error=HarnessError)
    return seen[-1]


@dataclass
class Machine:
    """systemd as PID 1 in an nspawn container over a volatile overlay of the host's /."""

    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpuguard-e2e.")))
    nspawn: subprocess.Popen[bytes] | None = None
    leader: int = 0
    mounted: bool = False
    cgroups: list[Path] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def console_log(self) -> Path:
        return self.base / "console.log"

    # -- life cycle ----------------------------------------------------------------------

    def boot(self, timeout: float = 90) -> None:
        self.root.mkdir()
        subprocess.run(["mount", "--bind", "/", str(self.root)], check=True)
        self.mounted = True
        cmd = ["systemd-nspawn", "-D", str(self.root), "--volatile=overlay", "--register=no",
               "--keep-unit", "--link-journal=no", "--boot", "--console=pipe",
               # Its own network namespace: services that boot inside (a database, sshd)
               # must not bind the host's ports.
               "--private-network",
               f"--machine=gpuguard-e2e-{os.getpid()}"]
        # The repository must be visible inside: a non-recursive bind of / misses it when it
        # lives on another file system (a CI workspace volume), and the container's own tmpfs
        # on /tmp hides a checkout under /tmp.
        cmd.append(f"--bind-ro={REPO}")
        # bpf(2), which nspawn's seccomp filter refuses by default: systemd's IPAddressAllow=/
        # IPAddressDeny= are BPF programs on a unit's cgroup, and without them systemd runs the
        # unit unfiltered, saying nothing (gpuguard-exporter.socket's allow-list served every
        # address). CAP_SYS_ADMIN, which nspawn keeps, is enough to load them.
        cmd.append("--system-call-filter=bpf")
        # Servers that `make deps` installs for tests/e2e/test_fleet.py enable themselves at
        # boot (Debian's packages do): kept from starting in every machine, where they would
        # take the CPU and the ports; the fleet tests run them with configurations of their
        # own. systemd in a container reads these from its own command line.
        cmd += [f"systemd.mask={unit}" for unit in BOOT_MASKED]
        # nspawn keeps its own cgroup (--keep-unit) and puts the container in "payload" below
        # it. Without a cgroup of its own that is the host's root cgroup, shared by every
        # container booted at the same time: their systemds would manage each other's
        # system.slice. So each machine gets a fresh one, entered by a shell that then
        # becomes nspawn.
        self.cgroups = make_cgroups(self.base.name)
        enter = ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; '
                 'shift; exec "$@"', "sh", *(str(c / "cgroup.procs") for c in self.cgroups), "--"]
        with open(self.console_log, "wb") as log:
            self.nspawn = subprocess.Popen(enter + cmd, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.leader = wait_for("the container's PID 1", self._find_leader, 30)
            state = wait_for("systemctl is-system-running", self._booted, timeout, 0.2)
        except HarnessError as exc:
            raise HarnessError(f"{exc}\n--- console ---\n{self.console_tail()}") from None
        if state == "degraded":
            failed = self.run(["systemctl", "--failed", "--no-legend", "--plain"], check=False)
            print(f"container booted degraded; failed units:\n{failed.stdout}")

    def _find_leader(self) -> int | None:
        assert self.nspawn is not None
        if self.nspawn.poll() is not None:
            raise HarnessError(f"systemd-nspawn exited with {self.nspawn.returncode}:\n"
                               f"{self.console_tail()}")
        try:
            children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text()
        except OSError:
            return None
        # nspawn's first child is a short-lived helper that sets up the mounts; the container's
        # init is the child that is PID 1 in its own PID namespace.
        for pid in children.split():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == "1" and len(line.split()) > 2:
                    return int(pid)
        return None

    def _booted(self) -> str | None:
        done = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
        state = done.stdout.strip()
        return state if state in ("running", "degraded") else None

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console_log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def shutdown(self) -> None:
        """Stop the container, unmount, remove the scratch directory. Safe to call twice."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)  # an orderly poweroff of the container
            try:
                self.nspawn.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.nspawn.send_signal(signal.SIGTERM)  # nspawn: the second one is immediate
                try:
                    self.nspawn.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.nspawn.kill()
                    self.nspawn.wait(timeout=10)
        self.nspawn = None
        remove_cgroups(self.cgroups)
        self.cgroups = []
        if self.mounted:
            done = subprocess.run(["umount", str(self.root)], check=False, capture_output=True)
            if done.returncode != 0:
                subprocess.run(["umount", "--lazy", str(self.root)], check=False)
            self.mounted = False
        if self.base.exists():
            # Only the empty mount point and our log are left; never recurse into a mount.
            if self.root.exists() and not os.path.ismount(self.root):
                self.root.rmdir()
            self.console_log.unlink(missing_ok=True)
            self.base.rmdir()


    # -- inside ----------------------------------------------------------------------------

    def run(self, cmd: Sequence[str] | str, *, check: bool = True, timeout: float = 60,
            user: str | None = None, input: str | None = None,
            env: Mapping[str, str] | None = None, cwd: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` (argv, or a shell script as one string) inside, as root or `user`."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if cwd:
            argv = ["/bin/sh", "-c", f"cd {shlex.quote(cwd)} && exec \"$@\"", "sh", *argv]
        if user is not None:
            # setpriv keeps no capability, sets the user's groups: an ordinary login-less user.
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups",
                    "--reset-env", *argv]
        inner_env = {"PATH": INNER_PATH, "LANG": "C.UTF-8", "HOME": "/root", "TERM": "dumb",
                     "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
        inner_env.update(env or {})
        full = ["nsenter", "-t", str(self.leader), "--all", "--", "env", "-i",
                *(f"{k}={v}" for k, v in inner_env.items()), *argv]
        done = subprocess.run(full, input=input, capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=None if input else subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise HarnessError(f"inside the container: {shlex.join(argv)} exited with "
                               f"{done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}")
        return done

    def popen(self, cmd: Sequence[str]) -> subprocess.Popen[str]:
        """A long-running command inside (e.g. a bus monitor); the caller ends it."""
        env = [f"PATH={INNER_PATH}", "LANG=C.UTF-8", "HOME=/root", "TERM=dumb"]
        return subprocess.Popen(["nsenter", "-t", str(self.leader), "--all", "--", "env", "-i",
                                 *env, *cmd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def path(self, inner: str) -> Path:
        """The host-side name of a path inside the container (its mount namespace)."""
        return Path(f"/proc/{self.leader}/root") / inner.lstrip("/")

    def write(self, inner: str, text: str, mode: int = 0o644) -> None:
        target = self.path(inner)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def read(self, inner: str) -> str:
        return self.path(inner).read_text()

    def copy(self, source: Path, inner: str, mode: int = 0o644) -> None:
        self.write(inner, source.read_text(), mode)

    def install_shipped(self, relative: str, inner: str, mode: int = 0o644) -> None:
        """A templated file of the tree (e.g. "systemd/gpuguardd.service") as the packages
        install it: filled in with the default paths (tests/shipped.py)."""
        self.write(inner, shipped(relative), mode)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 120
                  ) -> subprocess.CompletedProcess[str]:
        done = self.run(["systemctl", "--no-pager", *args], check=False, timeout=timeout)
        if check and done.returncode != 0:
            units = [a for a in args[1:] if not a.startswith("-")]
            logs = self.journal("-n", "30", *(f"--unit={u}" for u in units)) if units else ""
            if os.environ.get("GPUGUARD_E2E_DEBUG"):
                logs += "\n--- full ---\n" + self.journal("-n", "80", "-o", "short-monotonic")
            raise HarnessError(f"systemctl {' '.join(args)} exited with {done.returncode}: "
                               f"{done.stderr.strip()}\n--- journal ---\n{logs}")
        return done

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.strip()

    def journal(self, *args: str) -> str:
        return self.run(["journalctl", "--no-pager", "-o", "cat", *args], check=False).stdout


# -- gpuguard inside -----------------------------------------------------------------------

SERVICE_DROPIN = """\
# e2e: the fake NVML instead of a driver, and a short watchdog so a hang is caught quickly.
[Service]
Environment=LD_LIBRARY_PATH={libdir}
Environment=FAKE_NVML_STATE={state}
WatchdogSec={watchdog}
"""

DAEMON_CONFIG = """\
# e2e / demo: short timeouts so a sweep takes seconds.
[Sweep]
GraceSec=2
KillTimeoutSec=3
VerifyTimeoutSec=5
ReleasedBelowMiB=64
[Watch]
Units={watch}
[Devices]
# The fake nodes: major 120 (local use) and nvidia-uvm with /dev/zero's numbers (1, 5).
AllowMajors=120 1
[Daemon]
PollIntervalSec=0.5
"""

# A fake inference server, as an admin would write its unit. KillMode=process leaves its
# workers running after `systemctl stop`: the leftovers gpuguard exists for.
INFERENCE_UNIT = """\
[Unit]
Description=Fake {flavor} inference server ({name})

[Service]
Type=notify
NotifyAccess=all
ExecStart={python} {server} --name {name} {args}
KillMode=process
TimeoutStopSec=60
Environment=CUDA_VISIBLE_DEVICES={cuda}
{extra}
"""


def interpreter_access() -> str:
    """Unit lines that let the sandboxed daemon run the venv's interpreter, if it needs any.

    A package runs /usr/bin/python3. A developer's venv may sit on a pyenv build under /root,
    which ProtectHome=yes hides: the daemon would not even start. Only then is /root replaced
    by an empty tmpfs with that one installation bound read-only into it.
    """
    base = subprocess.run([str(VENV_PYTHON), "-c", "import sys; print(sys.base_prefix)"],
                          check=True, capture_output=True, text=True).stdout.strip()
    real = os.path.realpath(base)
    # The checkout (and its venv) too: PrivateTmp= hides a clone under /tmp, as CI makes.
    lines = f"BindReadOnlyPaths={REPO}\n"
    if real.startswith(("/root/", "/home/", "/run/user/")):
        lines += ("# The venv's interpreter is under a home directory (pyenv): make just it visible.\n"
                  f"ProtectHome=tmpfs\nBindReadOnlyPaths={real}\n")
    return lines


@dataclass(frozen=True)
class BusSignal:
    member: str
    args: list[Any]
    usec: int  # when the bus saw it (CLOCK_REALTIME)


@dataclass
class Installed:
    """gpuguard installed inside a Machine the way a package installs it."""

    machine: Machine
    gpus: int = 2
    memory_total: int = 80 * GiB

    def install(self, watch: str = "watched-* sglang-both-*", watchdog: str = "30s") -> None:
        m = self.machine
        # Program files, where a package puts them. The wrappers run the repository's venv
        # (its editable install), so the tests exercise the working tree.
        m.write("/usr/libexec/gpuguard/gpuguardd",
                f"#!/bin/sh\nexec {VENV_PYTHON} -m gpuguardd.daemon.main \"$@\"\n", 0o755)
        m.write("/usr/bin/gpuguardctl", f"#!/bin/sh\nexec {VENV_PYTHON} -m gpuguardd.cli.main \"$@\"\n",
                0o755)
        m.install_shipped("systemd/gpuguardd.service", "/usr/lib/systemd/system/gpuguardd.service")
        # As the packages do: the drop-ins ship inactive under /usr/share/gpuguard/dropins, and
        # the admin turns them on with `gpuguardctl hook install PREFIX` (into /etc).
        prefixes = []
        for dropin in sorted((REPO / "systemd" / "dropins").glob("*.service.d/*.conf.in")):
            name = f"{dropin.parent.name}/{dropin.stem}"
            m.install_shipped(f"systemd/dropins/{name}", f"/usr/share/gpuguard/dropins/{name}")
            prefixes.append(dropin.parent.name.removesuffix(".d"))
        m.run("".join(f"gpuguardctl hook install {p} >/dev/null\n" for p in prefixes))
        m.copy(REPO / "dbus" / "org.gpuguard.GpuGuard1.conf",
               "/usr/share/dbus-1/system.d/org.gpuguard.GpuGuard1.conf")
        m.copy(REPO / "dbus" / "org.gpuguard.GpuGuard1.service",
               "/usr/share/dbus-1/system-services/org.gpuguard.GpuGuard1.service")
        m.copy(REPO / "dbus" / "org.gpuguard.GpuGuard1.policy",
               "/usr/share/polkit-1/actions/org.gpuguard.GpuGuard1.policy")
        # Test doubles: device nodes (major 120 is reserved for local use, so no driver
        # answers; /dev/nvidia-uvm takes /dev/zero's numbers so it can really be opened and
        # mapped, see tests/conftest.py) and the fake libnvidia-ml.
        nodes = {f"nvidia{i}": (120, i) for i in range(self.gpus)}
        nodes.update({"nvidiactl": (120, 255), "nvidia-modeset": (120, 254), "nvidia-uvm": (1, 5)})
        script = "".join(f"rm -f /dev/{n}; mknod -m 666 /dev/{n} c {a} {b}\n"
                         for n, (a, b) in nodes.items())
        m.run(script)
        m.run([str(VENV_PYTHON), "-c",
               "import sys; from pathlib import Path; from tests.fakenvml import build_library; "
               "build_library(Path(sys.argv[1]))", FAKE_NVML_DIR], cwd=str(REPO))
        self.write_gpus()
        # Fake servers of any User= register their workers with the fake NVML ("the driver").
        m.run(f"mkdir -p -m 1777 /run/fake-server; touch {FAKE_NVML_STATE}.lock; "
              f"chmod 0777 {os.path.dirname(FAKE_NVML_STATE)}; "
              f"chmod 0666 {FAKE_NVML_STATE} {FAKE_NVML_STATE}.lock")
        m.write("/etc/systemd/system/gpuguardd.service.d/e2e.conf",
                SERVICE_DROPIN.format(libdir=FAKE_NVML_DIR, state=FAKE_NVML_STATE,
                                      watchdog=watchdog) + interpreter_access())
        self.configure(watch)
        # The bus must read the new policy before the daemon asks for its name.
        m.run(["busctl", "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
               "org.freedesktop.DBus", "ReloadConfig"])
        m.systemctl("daemon-reload")

    def configure(self, watch: str) -> None:
        self.machine.write("/etc/gpuguard/gpuguard.conf", DAEMON_CONFIG.format(watch=watch))

    def write_gpus(self) -> None:
        """A fresh fake NVML state: the GPUs, no processes (servers register their own)."""
        lines = ["driver 550.54.15"]
        for i in range(self.gpus):
            lines.append(f"gpu {i} uuid=GPU-00000000-0000-4000-8000-{i:012x} "
                         f"name=NVIDIA_H100_80GB_HBM3 minor={i} pci=00000000:{i + 1:02X}:00.0 "
                         f"total={self.memory_total} used=0")
        self.machine.write(FAKE_NVML_STATE, "\n".join(lines) + "\n")

    def start_daemon(self) -> None:
        self.machine.systemctl("start", "gpuguardd.service")

    def add_server(self, name: str, *, workers: int = 3, gpus: Sequence[int] = (0,),
                   mib: int = 20 * 1024, stubborn: Sequence[int] = (), escaper: int | None = None,
                   escape_now: bool = False, flavor: str = "SGLang", restart: str = "",
                   cuda: str = "") -> None:
        """Write /etc/systemd/system/<name>.service running tests/e2e/fake_server.py."""
        args = [f"--workers={workers}", f"--mib={mib}"]
        args += [f"--gpu={g}" for g in gpus]
        args += [f"--stubborn={s}" for s in stubborn]
        if escaper is not None:
            args.append(f"--escaper={escaper}")
        if escape_now:
            args.append("--escape-now")
        extra = f"Restart={restart}\nRestartSec=1s" if restart else ""
        text = INFERENCE_UNIT.format(
            # The system interpreter (stdlib only): any User= can run it, unlike a venv on a
            # pyenv build under /root.
            flavor=flavor, name=name, python="/usr/bin/python3",
            server=REPO / "tests" / "e2e" / "fake_server.py", args=" ".join(args),
            cuda=cuda or ",".join(str(g) for g in gpus), extra=extra)
        self.machine.write(f"/etc/systemd/system/{name}", textwrap.dedent(text))

    def server_pids(self, name: str) -> dict[str, int]:
        """{"main": pid, "worker0": pid, ...} as the fake server recorded them (container PIDs)."""
        text = self.machine.read(f"/run/fake-server/{name}.pids")
        return {key: int(value) for key, value in
                (line.split("=", 1) for line in text.split() if "=" in line)}

    def alive(self, pid: int) -> bool:
        """Is container PID `pid` a live (non-zombie) process?"""
        done = self.machine.run(f"test -e /proc/{pid} && ! grep -q '^State:.*Z' /proc/{pid}/status",
                                check=False)
        return done.returncode == 0

    def busctl(self, *args: str, user: str | None = None, check: bool = True,
               timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return self.machine.run(["busctl", "--system", "--timeout=80", *args], user=user,
                                check=check, timeout=timeout)

    def call(self, method: str, signature: str = "", *args: str, user: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        """busctl --json=short call on the Manager."""
        return self.busctl("--json=short", "call", "org.gpuguard.GpuGuard1",
                           "/org/gpuguard/GpuGuard1", "org.gpuguard.GpuGuard1.Manager", method,
                           *([signature, *args] if signature else []), user=user, check=check)

    def result(self, method: str, signature: str = "", *args: str) -> Any:
        """The first return value of a Manager call, unwrapped to plain Python."""
        done = self.call(method, signature, *args)
        return unwrap_busctl(json.loads(done.stdout)["data"][0])

    def history(self, count: int = 50) -> list[dict[str, Any]]:
        reports = self.result("GetHistory", "u", str(count))
        assert isinstance(reports, list)
        return reports

    def holders(self) -> list[dict[str, Any]]:
        # fresh: the tests move processes between cgroups, which no event announces
        found = self.result("ListHolders", "a{sv}", "1", "fresh", "b", "true")
        assert isinstance(found, list)
        return found

    def reports_for(self, unit: str) -> list[dict[str, Any]]:
        return [r for r in self.history() if r.get("scope", {}).get("unit") == unit]

    def start_server(self, name: str, **kwargs: Any) -> dict[str, int]:
        """Write the unit, start it, wait until gpuguardd has seen its workers; their PIDs."""
        self.add_server(name, **kwargs)
        self.machine.systemctl("daemon-reload")
        self.machine.systemctl("start", name)
        pids = self.server_pids(name)
        workers = {v for k, v in pids.items() if k.startswith("worker")}
        # ListHolders makes the daemon scan now, which is also when it records the unit's GPUs.
        wait_for(f"gpuguardd to see the workers of {name}",
                 lambda: workers <= {h["pid"] for h in self.holders() if h["unit"] == name},
                 20, 0.3)
        return pids

    def cgroup(self, pid: int) -> str:
        return self.machine.read(f"/proc/{pid}/cgroup")

    @contextmanager
    def monitor(self) -> Iterator[list[BusSignal]]:
        """The Manager's signals as `busctl monitor` saw them on the system bus during the
        block (filled in when it ends)."""
        signals: list[BusSignal] = []
        # Line-buffered: busctl keeps a pipe's output in stdio buffers it may lose at SIGINT.
        # Only the Manager's signals: the daemon's own calls to systemd would flood the pipe.
        proc = self.machine.popen([
            "stdbuf", "-oL", "busctl", "--system", "--json=short", "monitor",
            "--match=type='signal',sender='org.gpuguard.GpuGuard1',"
            "interface='org.gpuguard.GpuGuard1.Manager'"])
        time.sleep(0.7)  # the monitor's match rules must be in place before anything happens
        try:
            yield signals
        finally:
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate(timeout=10)
            for line in out.splitlines():
                if line.startswith("{"):
                    message = json.loads(line)
                    args = unwrap_busctl(message.get("payload", {}).get("data", []))
                    assert isinstance(args, list)
                    signals.append(BusSignal(str(message.get("member", "")), args,
                                             int(message.get("timestamp-realtime", 0))))


@contextmanager
def booted() -> Iterator[Machine]:
    """A booted Machine for the block, always shut down and cleaned up after it."""
    machine = Machine()
    try:
        machine.boot()
        yield machine
    finally:
        machine.shutdown()


def host_fingerprint(paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `paths`: to show the host was not touched."""
    seen: dict[str, tuple[int, int]] = {}
    for top in paths:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                seen[full] = (st.st_size, st.st_mtime_ns)
    return seen


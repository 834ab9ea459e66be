"""The .deb and `make install`, each in a throwaway systemd (tests/e2e/harness.py).

Both from the release tarball, as a distribution builds (tests/packages.py: `make dist`,
unpacked, no .git). The .deb: `apt-get install ./gpuguard_<version>_all.deb` enables and starts the daemon on
Debian's own Python packages, a sweep works (first without NVML's binding, outcome
"unverified"; then with the binding where gpuguardd(8) says to put it), the man pages and the
completion work, and `apt-get purge` leaves nothing behind. `make install` / `make uninstall`
do the same for a source install.

Each scenario boots its own machine (not the session's `guard`, which has the working tree
installed): a package must meet a clean system.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd import __version__
from tests.e2e.harness import FAKE_NVML_DIR, FAKE_NVML_STATE, Machine, wait_for
from tests.e2e.harness import require_tools as harness_tools
from tests.fakenvml import FakeNvmlState, build_library
from tests.packages import build, release_tree, require_tools

DEB_INSIDE = f"/var/tmp/gpuguard_{__version__}_all.deb"
SOURCE_INSIDE = "/var/tmp/gpuguard-src"
GiB = 1024**3
# Where gpuguard may leave files; after a purge or uninstall, the gpuguard-named paths there
# must be exactly those that were there before the install.
WATCHED = "/etc /usr /lib /var /run /opt"
NODES = {"nvidia0": (120, 0), "nvidia1": (120, 1), "nvidiactl": (120, 255), "nvidia-uvm": (1, 5)}
HOLDER = ("import os, time\n"
          "fds = [os.open('/dev/nvidia-uvm', os.O_RDWR), os.open('/dev/nvidiactl', os.O_PATH),\n"
          "       os.open('/dev/nvidia0', os.O_PATH)]\n"
          "time.sleep(3600)\n")


def _require() -> None:
    missing = harness_tools()
    if missing:
        pytest.skip("the package e2e tests need " + ", ".join(missing))
    require_tools()


def gpuguard_paths(machine: Machine) -> set[str]:
    # /var/cache/man: man-db's formatted pages, from the tests' own `man` runs (its cron job
    # expires them), not the package's. /var/tmp: the .deb and the source copy.
    found = machine.run(f"find {WATCHED} -xdev -iname '*gpuguard*' -not -path '/var/tmp/*' "
                        "-not -path '/var/cache/man/*' 2>/dev/null; true").stdout
    return set(found.split())


# The fake nodes' majors are no NVIDIA driver's: the daemon refuses them unless told.
NODES_DROPIN = "/etc/gpuguard/gpuguard.conf.d/e2e-nodes.conf"


def make_nodes(machine: Machine) -> None:
    machine.run("".join(f"rm -f /dev/{n}; mknod -m 666 /dev/{n} c {a} {b}\n"
                        for n, (a, b) in NODES.items()))
    majors = " ".join(sorted({str(a) for a, _ in NODES.values()}))
    machine.write(NODES_DROPIN, f"[Devices]\nAllowMajors={majors}\n")
    machine.systemctl("reload", "gpuguardd.service")


def forget_nodes(machine: Machine) -> None:
    """Remove the drop-in again: a purge must leave /etc/gpuguard as it found it."""
    machine.path(NODES_DROPIN).unlink(missing_ok=True)
    machine.systemctl("reload", "gpuguardd.service")


def start_holder(machine: Machine, unit: str) -> int:
    """A transient unit whose process holds GPU 0 (and uvm, so it counts as compute)."""
    machine.run(["systemd-run", f"--unit={unit}", "--property=KillMode=process",
                 "/usr/bin/python3", "-c", HOLDER])
    pid = wait_for(f"{unit} to run", lambda: int(machine.show(unit, "MainPID")) or None, 20)
    # Its fds are open once the holders list shows it.
    wait_for(f"gpuguardd to see {unit}",
             lambda: pid in {h["pid"] for h in ctl_json(machine, "holders", "--unit", unit)},
             20, 0.3)
    return pid


def ctl_json(machine: Machine, *args: str) -> list[dict[str, object]]:
    done = machine.run(["gpuguardctl", *args, "--json"])
    value = json.loads(done.stdout)
    assert isinstance(value, list)
    return value


def sweep(machine: Machine, unit: str) -> tuple[int, dict[str, object]]:
    done = machine.run(["gpuguardctl", "sweep", "--unit", unit, "--grace", "2s", "--json"],
                       check=False, timeout=90)
    report = json.loads(done.stdout)
    assert isinstance(report, dict), done.stdout + done.stderr
    return done.returncode, report


def alive(machine: Machine, pid: int) -> bool:
    return machine.run(f"test -e /proc/{pid}", check=False).returncode == 0


def completions(machine: Machine, *words: str) -> set[str]:
    script = ("source /usr/share/bash-completion/completions/gpuguardctl\n"
              "COMP_WORDS=(\"$@\"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); _gpuguardctl\n"
              "printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = machine.run(["bash", "--norc", "-c", script, "bash", *words])
    return set(done.stdout.split())


def allow_service_starts(machine: Machine) -> None:
    """Container images (this host's too) often carry a policy-rc.d that forbids maintainer
    scripts to start services; a real machine has none. Removed inside only (the overlay)."""
    machine.run("rm -f /usr/sbin/policy-rc.d")


@pytest.fixture(scope="module")
def deb_machine() -> Iterator[tuple[Machine, set[str]]]:
    _require()
    deb = build("deb")
    machine = Machine()
    try:
        machine.boot()
        allow_service_starts(machine)
        before = gpuguard_paths(machine)
        shutil.copyfile(deb, machine.path(DEB_INSIDE))
        # The container has no network: every dependency must already be there (make deps
        # installs them on the host, whose / the container overlays).
        machine.run(["apt-get", "install", "-y", "--no-install-recommends", DEB_INSIDE],
                    env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)
        yield machine, before
    finally:
        machine.shutdown()


def test_deb_install_enables_and_starts_the_daemon(deb_machine: tuple[Machine, set[str]]) -> None:
    m, _ = deb_machine
    assert m.run(["dpkg-query", "-W", "-f=${Status} ${Version}", "gpuguard"]).stdout == \
        f"install ok installed {__version__}"
    assert m.systemctl("is-enabled", "gpuguardd.service").stdout.strip() == "enabled"
    wait_for("gpuguardd to be active",
             lambda: m.systemctl("is-active", "gpuguardd.service", check=False).stdout.strip() == "active",
             30, 0.3)
    pid = int(m.show("gpuguardd.service", "MainPID"))
    cmdline = m.read(f"/proc/{pid}/cmdline").split("\0")
    assert cmdline[0].startswith("/usr/bin/python3") and cmdline[1] == "/usr/libexec/gpuguard/gpuguardd"
    version = m.run(["busctl", "get-property", "org.gpuguard.GpuGuard1", "/org/gpuguard/GpuGuard1",
                     "org.gpuguard.GpuGuard1.Manager", "Version"]).stdout.strip()
    assert version == f's "{__version__}"'
    assert m.run(["gpuguardctl", "--version"]).stdout.strip() == f"gpuguardctl {__version__}"
    # Installing enabled no drop-in for other units: that is `gpuguardctl hook install`'s job.
    assert m.run("ls /lib/systemd/system/*.service.d/gpuguard.conf /etc/systemd/system/*.service.d/gpuguard.conf",
                 check=False).returncode != 0


def test_deb_man_pages_and_completion(deb_machine: tuple[Machine, set[str]]) -> None:
    m, _ = deb_machine
    for page in ("gpuguardctl", "gpuguardd", "gpuguard.conf", "gpuguard-dbus"):
        done = m.run(["man", "--warnings", page], env={"MANWIDTH": "80"})
        assert done.stderr == "" and page in done.stdout.splitlines()[0], done.stderr
    assert "gpuguardd.service" in completions(m, "gpuguardctl", "sweep", "--unit", "gpuguard")
    assert completions(m, "gpuguardctl", "hook", "install", "sgl") == {"sglang-"}
    assert completions(m, "gpuguardctl", "sw") == {"sweep"}


def test_deb_sweep_without_nvml_binding_is_unverified(deb_machine: tuple[Machine, set[str]]) -> None:
    """Debian has no nvidia-ml-py: the processes are still ended, the outcome says unverified."""
    m, _ = deb_machine
    status = json.loads(m.run(["gpuguardctl", "status", "--json"]).stdout)
    assert status["nvml_available"] is False
    make_nodes(m)
    try:
        pid = start_holder(m, "leftover-a.service")
        code, report = sweep(m, "leftover-a.service")
        assert report["outcome"] == "unverified", report
        assert code == 6
        assert pid in [t["pid"] for t in report["terminated"]]  # type: ignore[attr-defined]
        assert not alive(m, pid)
    finally:
        forget_nodes(m)


def test_deb_with_nvml_binding_where_the_man_page_says_verifies(
        deb_machine: tuple[Machine, set[str]], tmp_path: Path) -> None:
    """gpuguardd(8): `pip install --break-system-packages nvidia-ml-py` puts pynvml.py in
    /usr/local/lib/python3.X/dist-packages. Put it there (the container has no network to
    pip from), give the daemon the fake libnvidia-ml, and the sweep is verified."""
    m, _ = deb_machine
    import pynvml

    pyver = m.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    site = f"/usr/local/lib/python{pyver}/dist-packages"
    m.write(f"{site}/pynvml.py", Path(pynvml.__file__).read_text())
    libdir = build_library(tmp_path / "lib")
    m.path(FAKE_NVML_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(libdir / "libnvidia-ml.so.1", m.path(f"{FAKE_NVML_DIR}/libnvidia-ml.so.1"))
    state = FakeNvmlState()
    for minor in (0, 1):
        state.add_gpu(minor=minor, memory_total=80 * GiB)
    m.path(FAKE_NVML_STATE).parent.mkdir(parents=True, exist_ok=True)
    state.write(m.path(FAKE_NVML_STATE))
    m.write("/etc/systemd/system/gpuguardd.service.d/e2e-nvml.conf",
            f"[Service]\nEnvironment=LD_LIBRARY_PATH={FAKE_NVML_DIR}\n"
            f"Environment=FAKE_NVML_STATE={FAKE_NVML_STATE}\n")
    m.systemctl("daemon-reload")
    make_nodes(m)
    m.systemctl("restart", "gpuguardd.service")
    try:
        status = json.loads(m.run(["gpuguardctl", "status", "--json"]).stdout)
        assert status["nvml_available"] is True, status
        pid = start_holder(m, "leftover-b.service")
        state.add_proc(0, pid, 30 * GiB)
        state.write(m.path(FAKE_NVML_STATE))
        code, report = sweep(m, "leftover-b.service")
        assert (report["outcome"], code) == ("freed", 0), report
        assert not alive(m, pid)
    finally:
        m.path("/etc/systemd/system/gpuguardd.service.d/e2e-nvml.conf").unlink()
        m.path("/etc/systemd/system/gpuguardd.service.d").rmdir()
        m.path(f"{site}/pynvml.py").unlink()
        m.systemctl("daemon-reload")
        forget_nodes(m)


def test_deb_upgrade_restarts_the_daemon_and_keeps_the_admins_config(
        deb_machine: tuple[Machine, set[str]]) -> None:
    m, _ = deb_machine
    conf = m.path("/etc/gpuguard/gpuguard.conf")
    conf.write_text(conf.read_text() + "\n# local change\n")
    before = int(m.show("gpuguardd.service", "MainPID"))
    # Reinstalling the same version runs postinst as an upgrade ("configure <old version>").
    m.run(["dpkg", "--force-confold", "-i", DEB_INSIDE], timeout=300)

    def restarted() -> int | None:
        pid = int(m.show("gpuguardd.service", "MainPID"))
        return pid if pid and pid != before else None

    wait_for("gpuguardd to restart", restarted, 30, 0.3)
    assert conf.read_text().endswith("# local change\n"), "a changed conffile survives upgrades"


def test_deb_purge_leaves_nothing_behind(deb_machine: tuple[Machine, set[str]]) -> None:
    m, before = deb_machine
    m.run(["gpuguardctl", "hook", "install", "sglang-"])
    assert m.path("/etc/systemd/system/sglang-.service.d/gpuguard.conf").is_file()
    assert m.path("/var/lib/gpuguard").is_dir(), "the sweeps above left a history"
    m.run(["apt-get", "purge", "-y", "gpuguard"], env={"DEBIAN_FRONTEND": "noninteractive"},
          timeout=300)
    assert m.systemctl("is-active", "gpuguardd.service", check=False).stdout.strip() == "inactive"
    status = m.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "gpuguard"], check=False)
    assert status.returncode != 0 or status.stdout.strip() in ("un", ""), status.stdout
    left = gpuguard_paths(m) - before
    assert left == set(), f"purge left {sorted(left)}"
    activatable = m.run(["busctl", "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
                         "org.freedesktop.DBus", "ListActivatableNames"]).stdout
    assert "org.gpuguard.GpuGuard1" not in activatable


# -- make install / make uninstall -----------------------------------------------------------

def test_make_install_runs_the_service_and_uninstall_removes_it() -> None:
    _require()
    machine = Machine()
    try:
        machine.boot()
        before = gpuguard_paths(machine)
        # The unpacked release tarball (with the built Cockpit page: the container has no
        # network for npm), written from here (the host's copy may be hidden inside, e.g.
        # under the container's own /tmp).
        shutil.copytree(release_tree(), machine.path(SOURCE_INSIDE), symlinks=True)
        machine.run(["make", "install"], cwd=SOURCE_INSIDE, timeout=120)
        machine.systemctl("enable", "--now", "gpuguardd.service")
        wait_for("gpuguardd to answer",
                 lambda: machine.run(["gpuguardctl", "status", "--json"], check=False).returncode == 0,
                 30, 0.3)
        status = json.loads(machine.run(["gpuguardctl", "status", "--json"]).stdout)
        assert status["version"] == __version__
        pid = int(machine.show("gpuguardd.service", "MainPID"))
        assert machine.read(f"/proc/{pid}/cmdline").split("\0")[1] == "/usr/libexec/gpuguard/gpuguardd"
        assert machine.run(["man", "-w", "gpuguard.conf"]).stdout.strip() == \
            "/usr/share/man/man5/gpuguard.conf.5"
        assert machine.path("/var/lib/gpuguard").is_dir()
        kept = machine.run(["make", "uninstall"], cwd=SOURCE_INSIDE, timeout=120)
        assert "keeping the sweep history in /var/lib/gpuguard" in kept.stdout
        assert gpuguard_paths(machine) - before == {"/var/lib/gpuguard"}
        machine.run(["make", "uninstall", "PURGE=yes"], cwd=SOURCE_INSIDE, timeout=120)
        assert machine.systemctl("is-active", "gpuguardd.service", check=False).stdout.strip() != "active"
        # The source copy itself is under /var/tmp, which gpuguard_paths leaves out.
        left = gpuguard_paths(machine) - before
        assert left == set(), f"make uninstall left {sorted(left)}"
    finally:
        machine.shutdown()


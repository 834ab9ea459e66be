"""Who is never signalled, decided from facts the process cannot fake."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpuguardd.config import Config
from gpuguardd.engine import procfs
from gpuguardd.engine.protection import ProtectedFiles, mark_protection, protection
from gpuguardd.records.enums import SpareReason
from gpuguardd.records.models import Holder


def protection_reason(holder: Holder, config: Config, own_chain: list[int],
                      protected: ProtectedFiles | None = None) -> str | None:
    found = protection(holder, config, own_chain, protected)
    return None if found is None else found[1]


def holder_for(pid: int, exe: str = "/usr/bin/python3", unit: str = "", container: str = "",
               state: str = "S") -> Holder:
    return Holder(pid=pid, exe=exe, unit=unit, container=container, state=state)


def test_pid1_kernel_threads_self_and_ancestors() -> None:
    config = Config()
    chain = procfs.ancestors(os.getpid())
    assert chain[0] == os.getpid() and chain[-1] in (1, chain[-1])
    assert protection_reason(holder_for(1), config, chain) == "PID 1 (init)"
    kthreads = [p for p in procfs.list_pids() if (s := procfs.read_stat(p)) and s.is_kernel_thread]
    assert kthreads, "no kernel thread visible in /proc"
    assert protection_reason(holder_for(kthreads[0]), config, chain) == "kernel thread"
    assert protection_reason(holder_for(os.getpid()), config, chain) == "gpuguard itself"
    parent = os.getppid()
    if parent != 1:
        assert protection_reason(holder_for(parent), config, chain) == "an ancestor of the sweeping process"


def test_protected_executable_and_unit_but_not_a_containers_namesake() -> None:
    config = Config()
    child = subprocess.Popen(["sleep", "30"])
    try:
        # The path text a holder shows proves nothing; the file it runs does.
        assert protection_reason(holder_for(child.pid, exe="/usr/bin/nvidia-persistenced"), config, []) is None
        sleep = os.path.realpath(f"/proc/{child.pid}/exe")
        assert f"protected executable {sleep}" in (protection_reason(
            holder_for(child.pid, exe=sleep), Config(protected_executables=(sleep,)), []) or "")
        assert protection_reason(holder_for(child.pid, unit="nvidia-persistenced.service"), config, []) \
            == "protected unit nvidia-persistenced.service"
        # The unit name inside a container is the container's business, not a host daemon.
        assert protection_reason(holder_for(child.pid, unit="nvidia-persistenced.service",
                                            container="lxc/129"), config, []) is None
        assert protection_reason(holder_for(child.pid, exe=sys.executable), config, []) is None
        # No readable exe: cannot prove it is not protected, so it is spared.
        assert "executable unknown" in (protection_reason(holder_for(child.pid, exe=""), config, []) or "")
    finally:
        child.kill()
        child.wait()


def test_a_protected_daemon_stays_protected_when_its_binary_is_upgraded(tmp_path: Path) -> None:
    """A package upgrade replaces the file under a running daemon: it then runs a deleted
    inode the configured path no longer names. In the daemon's own mount namespace that path
    can only have been put there by root, so it still protects the process."""
    sleep = shutil.which("sleep")
    assert sleep
    daemon_path = tmp_path / "nv-hostengine"
    shutil.copy2(os.path.realpath(sleep), daemon_path)
    config = Config(protected_executables=(str(daemon_path),))
    child = subprocess.Popen([str(daemon_path), "30"])
    try:
        new = tmp_path / "nv-hostengine.dpkg-new"
        shutil.copy2(os.path.realpath(sleep), new)
        os.rename(new, daemon_path)  # as dpkg does
        assert os.readlink(f"/proc/{child.pid}/exe").endswith(" (deleted)")
        reason = protection_reason(holder_for(child.pid, exe=str(daemon_path)), config, [])
        assert reason is not None and "replaced on disk since the process started" in reason
        # Another file that was deleted while running is not protected by its old path.
        other = tmp_path / "other"
        shutil.copy2(os.path.realpath(sleep), other)
        victim = subprocess.Popen([str(other), "30"])
        try:
            other.unlink()
            assert protection_reason(holder_for(victim.pid, exe=str(other)), config, []) is None
        finally:
            victim.kill()
            victim.wait()
    finally:
        child.kill()
        child.wait()


def test_protection_decides_the_code_with_the_words() -> None:
    config = Config()
    chain = procfs.ancestors(os.getpid())
    assert protection(Holder(pid=1, exe="/sbin/init", state="S"), config, chain) == (
        SpareReason.INIT, "PID 1 (init)")
    kthread = next(p for p in procfs.list_pids() if (s := procfs.read_stat(p)) and s.is_kernel_thread)
    assert protection(Holder(pid=kthread, state="S"), config, chain) == (
        SpareReason.KERNEL_THREAD, "kernel thread")
    assert protection(Holder(pid=os.getpid(), state="S"), config, chain) == (
        SpareReason.SELF, "gpuguard itself")
    if os.getppid() != 1:
        assert protection(Holder(pid=os.getppid(), state="S"), config, chain) == (
            SpareReason.ANCESTOR, "an ancestor of the sweeping process")
    child = subprocess.Popen(["sleep", "30"])
    try:
        exe = os.path.realpath(f"/proc/{child.pid}/exe")
        found = protection(Holder(pid=child.pid, exe=exe, state="S"),
                           Config(protected_executables=(exe,)), [])
        assert found is not None and found[0] is SpareReason.PROTECTED_EXECUTABLE
        assert protection(Holder(pid=child.pid, exe=exe, unit="nvidia-persistenced.service", state="S"),
                          config, []) == (SpareReason.PROTECTED_UNIT,
                                          "protected unit nvidia-persistenced.service")
        unknown = Holder(pid=child.pid, exe="", state="S")
        mark_protection(unknown, config, [])
        assert unknown.protected and unknown.protected_code is SpareReason.EXECUTABLE_UNKNOWN
        assert unknown.protected_why.startswith("executable unknown")
        free = Holder(pid=child.pid, exe=exe, state="S")
        mark_protection(free, config, [])
        assert not free.protected and free.protected_code is None and free.protected_why == ""
        # Not on the holder's wire form: the holder's keys stay as they were.
        assert "protected_code" not in unknown.to_dict()
    finally:
        child.kill()
        child.wait()


def test_protected_executables_match_by_file_identity(tmp_path: Path) -> None:
    """Symlinks and globs in ProtectedExecutables name files; a process is protected when it
    runs one of those very files (device and inode), never another file at a similar path."""
    sleep = shutil.which("sleep")
    assert sleep
    nv = tmp_path / "nv"
    nv.mkdir()
    real = tmp_path / "real-persistenced"
    shutil.copy2(os.path.realpath(sleep), real)
    link = tmp_path / "nvidia-persistenced"
    link.symlink_to(real)
    shutil.copy2(os.path.realpath(sleep), nv / "nv-hostengine")
    twin = tmp_path / "twin"
    twin.mkdir()
    shutil.copy2(real, twin / "real-persistenced")  # same bytes, another file
    config = Config(protected_executables=(str(link), f"{nv}/*"))
    files = ProtectedFiles.resolve(config)
    procs = [subprocess.Popen([str(path), "30"]) for path in
             (link, nv / "nv-hostengine", twin / "real-persistenced", Path(os.path.realpath(sleep)))]
    try:
        assert files.match(procs[0].pid) == str(link)
        assert files.match(procs[1].pid) == f"{nv}/nv-hostengine"
        assert files.match(procs[2].pid) is None
        assert files.match(procs[3].pid) is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert Config().is_protected_unit("nvidia-persistenced.service")
    assert Config().is_protected_unit("sglang-demo.service") is None


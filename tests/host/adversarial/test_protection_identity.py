"""Self-protection by mount namespace. A user in `unshare -Urm` bind-mounts a
directory over /usr/bin and execs a holder as /usr/bin/nvidia-persistenced: /proc/PID/exe
reads that path, and matching by path text spared it (nothing-to-do, exit 0). Protection is
by file identity now: (st_dev, st_ino) of the file the process runs, stat()ed through the
magic link, against the host's files that ProtectedExecutables names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HOLDER, GiB, GpuHost, Proc

UNSHARE = shutil.which("unshare")
PYTHON = os.path.realpath(sys.executable)


def masquerade(host: GpuHost, fake_bin: Path, over: str, name: str) -> Proc:
    """`unshare -Urm`, bind-mount `fake_bin` over `over`, exec `over`/`name` as a GPU holder."""
    if UNSHARE is None:
        pytest.fail("unshare (util-linux) is required: make deps installs it")
    script = (f'mount --bind "$1" "$2" && exec "$2/{name}" "$3" --hold "$4" --hold "$5"')
    popen = subprocess.Popen(
        [UNSHARE, "-Urm", "sh", "-c", script, "sh", str(fake_bin), over, str(HOLDER),
         host.node("nvidia0"), host.node("nvidia-uvm")],
        stdout=subprocess.PIPE, text=True,
        # The copied interpreter finds its library by its location, which is now /usr/bin.
        env={**os.environ, "PYTHONHOME": sys.base_prefix})
    assert popen.stdout is not None
    line = popen.stdout.readline().split()
    assert line and line[0] == "ready", f"the masquerading holder did not start: {line}"
    proc = Proc(popen, int(line[1]))
    assert proc.pid == popen.pid  # sh and unshare exec'ed it: our child, reaped at once
    threading.Thread(target=popen.wait, daemon=True).start()
    host.procs.append(proc)
    host.state.add_proc(0, proc.pid, GiB)
    host.publish()
    return proc


def protected_and_impostor(host: GpuHost, tmp_path: Path) -> tuple[Path, Path, Proc]:
    """A protected file on the host (host-bin/nvidia-persistenced, configured), and a holder
    that runs a copy of it (the same bytes, not the same file) shown at the same path."""
    host_bin = tmp_path / "host-bin"
    host_bin.mkdir()
    shutil.copy2(PYTHON, host_bin / "nvidia-persistenced")
    host.write_config(f"[Sweep]\nProtectedExecutables={host_bin}/nvidia-persistenced\n")
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    shutil.copy2(PYTHON, fake_bin / "nvidia-persistenced")
    return host_bin, fake_bin, masquerade(host, fake_bin, str(host_bin), "nvidia-persistenced")


def protected_spared(report: dict[str, Any]) -> dict[int, str]:
    """pid -> why, of the processes the sweep spared as protected. (The sweeping gpuguardctl
    itself holds every GPU's node through NVML and may be listed as spared for its scope.)"""
    return {s["pid"]: s["why"] for s in report["spared"] if "protected" in s["why"]}


def sweep(host: GpuHost) -> tuple[int, dict[str, Any]]:
    result = host.cli("sweep", "--gpu", "0", "--json")
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_a_bind_mount_over_usr_bin_protects_nothing(gpu_host: GpuHost, tmp_path: Path) -> None:
    """The issue's very steps: /usr/bin/nvidia-persistenced in the holder's own namespace."""
    host = gpu_host
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    shutil.copy2(PYTHON, fake_bin / "nvidia-persistenced")
    holder = masquerade(host, fake_bin, "/usr/bin", "nvidia-persistenced")
    assert os.readlink(f"/proc/{holder.pid}/exe") == "/usr/bin/nvidia-persistenced"
    code, report = sweep(host)
    assert [t["pid"] for t in report["terminated"]] == [holder.pid], report
    assert protected_spared(report) == {} and report["outcome"] == "freed" and code == 0
    assert not holder.alive()


def test_the_real_protected_file_is_spared_its_lookalike_is_not(gpu_host: GpuHost, tmp_path: Path) -> None:
    """The protected file exists on the host; a user's file shown at the same path is not it."""
    host = gpu_host
    host_bin, _, impostor = protected_and_impostor(host, tmp_path)
    assert os.readlink(f"/proc/{impostor.pid}/exe") == f"{host_bin}/nvidia-persistenced"
    real = host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"),
                      exe=str(host_bin / "nvidia-persistenced"), nvml=(0, GiB))
    code, report = sweep(host)
    assert [t["pid"] for t in report["terminated"]] == [impostor.pid], report
    spared = protected_spared(report)
    assert list(spared) == [real.pid]
    assert impostor.pid not in {s["pid"] for s in report["spared"]}
    assert spared[real.pid] == f"protected executable {host_bin}/nvidia-persistenced"
    assert real.alive() and not impostor.alive()
    assert code == 0 and report["outcome"] == "freed"  # the spared one's memory is accounted


def test_a_deleted_lookalike_in_another_namespace_is_not_an_upgraded_daemon(
        gpu_host: GpuHost, tmp_path: Path) -> None:
    """Only in the daemon's own mount namespace does '<protected path> (deleted)' mean an
    upgraded daemon; a user's namespace can show that text for any file it deleted."""
    host = gpu_host
    host_bin, fake_bin, impostor = protected_and_impostor(host, tmp_path)
    (fake_bin / "nvidia-persistenced").unlink()
    assert os.readlink(f"/proc/{impostor.pid}/exe") == f"{host_bin}/nvidia-persistenced (deleted)"
    code, report = sweep(host)
    assert [t["pid"] for t in report["terminated"]] == [impostor.pid], report
    assert protected_spared(report) == {} and code == 0

"""`[Devices] Paths` took anything. A node with /dev/null's numbers, or a
regular file, made every process holding /dev/null (or the file) a "management" holder that
`--include-management` then killed. Now only character devices of a GPU driver's major
(/proc/devices) or of a major in `[Devices] AllowMajors=` count; the rest is refused with a
warning naming the file, the entry and why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import GpuHost, Proc
from tests.dbus_harness import GuardDaemon

pytest_plugins = ["tests.dbus_harness"]


def hold(host: GpuHost, path: str) -> Proc:
    """A process with `path` open on stdin, as `grep ... < /dev/null` would have."""
    with open(path, "rb") as handle:
        popen = subprocess.Popen(["sleep", "60"], stdin=handle, text=True)
    proc = Proc(popen, popen.pid)
    host.procs.append(proc)
    return proc


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line == text)


@pytest.fixture
def decoys(gpu_host: GpuHost) -> tuple[str, str]:
    """A node with /dev/null's numbers and a regular file, where a GPU node would be."""
    bogus = gpu_host.root / "bogus"
    bogus.mkdir()
    null_node = bogus / "nvidia7"
    os.mknod(null_node, 0o666 | 0o020000, os.makedev(1, 3))
    plain = bogus / "nvidia8"
    plain.write_text("")
    return str(null_node), str(plain)


def test_non_nvidia_nodes_and_files_are_refused(gpu_host: GpuHost, decoys: tuple[str, str]) -> None:
    host = gpu_host
    null_node, plain = decoys
    host.write_config(f"[Devices]\nPaths={null_node}\nPaths={os.path.dirname(plain)}/nvidia8\n")
    victims = [hold(host, "/dev/null"), hold(host, null_node), hold(host, plain)]
    result = host.cli("holders", "--json")
    assert result.returncode == 0, result.stderr
    pids = {h["pid"] for h in json.loads(result.stdout)}
    assert not pids & {v.pid for v in victims}
    config_path = host.config_path
    null_line = line_of(config_path, f"Paths={null_node}")
    plain_line = line_of(config_path, f"Paths={os.path.dirname(plain)}/nvidia8")
    assert (f"[Devices] Paths ({config_path}:{null_line}): ignored {null_node}: character device 1:3, "
            "and major 1 is no GPU driver's") in result.stderr
    assert (f"[Devices] Paths ({config_path}:{plain_line}): ignored {plain}: not a character device "
            "(a regular file)") in result.stderr
    # The sweep that would have ended them: nothing in scope, everyone alive, and it says why.
    result = host.cli("sweep", "--include-management", "--json")
    report = json.loads(result.stdout)
    assert not {t["pid"] for t in report["terminated"]} & {v.pid for v in victims}
    assert all(v.alive() for v in victims)
    assert any(f"ignored {null_node}" in w for w in report["warnings"]), report["warnings"]


def test_allow_majors_admits_a_driver_gpuguard_does_not_know(gpu_host: GpuHost,
                                                             decoys: tuple[str, str]) -> None:
    host = gpu_host
    null_node, _ = decoys
    host.write_config(f"[Devices]\nPaths={null_node}\nAllowMajors=1\n")
    victim = hold(host, null_node)
    result = host.cli("holders", "--json")
    assert victim.pid in {h["pid"] for h in json.loads(result.stdout)}, result.stderr
    assert "ignored" not in result.stderr


def test_the_test_nodes_need_their_major_allowed(gpu_host: GpuHost) -> None:
    """The suite's own major-120 nodes are refused like any other without AllowMajors=120."""
    host = gpu_host
    host.config_path.write_text(host.config_path.read_text().replace("AllowMajors=120 122\n", ""))
    proc = host.spawn("--hold", host.node("nvidia0"))
    result = host.cli("holders", "--json")
    assert proc.pid not in {h["pid"] for h in json.loads(result.stdout)}
    assert f"ignored {host.node('nvidia0')}" in result.stderr


def test_the_daemon_logs_refused_entries_at_start_and_reload(daemon: GuardDaemon,
                                                             decoys: tuple[str, str]) -> None:
    null_node, plain = decoys
    host = daemon.host
    host.write_config(f"[Devices]\nPaths={null_node}\n")
    daemon.start()
    line = line_of(host.config_path, f"Paths={null_node}")
    assert f"[Devices] Paths ({host.config_path}:{line}): ignored {null_node}: character device 1:3" \
        in daemon.stderr()
    host.write_config(f"[Devices]\nPaths={plain}\n")
    daemon.manager("Reload")
    line = line_of(host.config_path, f"Paths={plain}")
    expected = f"[Devices] Paths ({host.config_path}:{line}): ignored {plain}: not a character device"
    assert expected in daemon.stderr()

"""Containers that Docker or Podman run as host scopes (docker-<id>.scope, libpod-<id>.scope):
the scope is the unit of the container's processes, so `--unit docker-<id>.scope` and
[Watch] Units=docker-*.scope name exactly that container. Real processes in real cgroups of
those names; the watch on the real systemd is in tests/e2e/test_fleet.py.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from tests.conftest import CgroupDir, GiB, GpuHost


def test_unit_sweep_of_a_container_scope_ends_that_container_only(
        gpu_host: GpuHost, systemd_cgroup: Callable[[str], CgroupDir]) -> None:
    host = gpu_host
    cid, neighbour_id = secrets.token_hex(32), secrets.token_hex(32)
    nodes = ("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"))
    inside = host.spawn(*nodes, nvml=(0, 3 * GiB))
    systemd_cgroup(f"system.slice/docker-{cid}.scope").add(inside.pid)
    neighbour = host.spawn(*nodes, nvml=(0, GiB))
    systemd_cgroup(f"system.slice/docker-{neighbour_id}.scope").add(neighbour.pid)
    unit = f"docker-{cid}.scope"

    listed = json.loads(host.cli("holders", "--json", "--unit", unit).stdout)
    assert [(h["pid"], h["unit"], h["container"]) for h in listed] == [(inside.pid, unit, f"docker/{cid}")]
    done = host.cli("sweep", "--json", "--unit", unit)
    report = json.loads(done.stdout)
    assert [t["pid"] for t in report["terminated"]] == [inside.pid], done.stderr
    assert report["scope"]["unit"] == unit and report["scope"]["container"] == f"docker/{cid}"
    assert neighbour.alive()

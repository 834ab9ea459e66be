"""Which systemd unit, container and cgroup a process belongs to, from /proc/<pid>/cgroup.

The container prefix is looked at before the unit: `/lxc/129/system.slice/sglang.service` is
the container's sglang.service, and must never match a host `SweepUnit("sglang.service")`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNIT_SUFFIXES = (".service", ".scope", ".socket", ".mount", ".swap", ".slice", ".target",
                 ".timer", ".path", ".device", ".automount")
# systemd's unit name alphabet (unit-name.c: VALID_CHARS) as a character class's body; '@' is a template's.
UNIT_NAME_CHARS = r"A-Za-z0-9:_.\\-"
_UNIT_NAME = re.compile(rf"[@{UNIT_NAME_CHARS}]+")  # fullmatch: "$" would let a final "\n" in
_CONTAINER_LABEL = re.compile(r"[a-z][a-z0-9-]*/[A-Za-z0-9_.:@+-]+")


@dataclass(frozen=True)
class Attribution:
    cgroup: str
    unit: str
    container: str


def cgroup_path(cgroup_file: str) -> str:
    """systemd's tracking path: name=systemd on v1/hybrid, else the v2 line."""
    unified = ""
    for line in cgroup_file.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "name=systemd":
            return parts[2]
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
    return unified


# (pattern over the whole path, label prefix): the first match wins.
_CONTAINER_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^/lxc\.payload[./]([^/]+)"), "lxc"),  # upstream LXC >= 4
    # Proxmox VE keeps the container's own hierarchy under "ns" (lxc.cgroup.dir.container.inner)
    (re.compile(r"^/lxc/([^/]+)(?:/ns(?=/|$))?"), "lxc"),
    (re.compile(r"/docker-([0-9a-f]{12,})\.scope"), "docker"),
    (re.compile(r"^/docker/([0-9a-f]{12,})"), "docker"),
    (re.compile(r"/libpod-(?:conmon-)?([0-9a-f]{12,})\.scope"), "podman"),
    (re.compile(r"^/libpod_parent/libpod-([0-9a-f]{12,})"), "podman"),
    (re.compile(r"/cri-containerd-([0-9a-f]{12,})\.scope"), "containerd"),
    (re.compile(r"/crio-(?:conmon-)?([0-9a-f]{12,})\.scope"), "crio"),
    (re.compile(r"^/kubepods(?:/[a-z]+)?/pod[0-9a-f-]+/([0-9a-f]{12,})"), "kubepods"),
    (re.compile(r"/systemd-nspawn@([^/]+)\.service(?:/payload(?=/|$))?"), "nspawn"),
    (re.compile(r"^/machine\.slice/machine-([^/]+)\.scope"), "machine"),
)


def container_of(path: str) -> tuple[str, str]:
    """(label, the cgroup path inside the container) for a cgroup path; ("", path) on the host."""
    for pattern, kind in _CONTAINER_PATTERNS:
        match = pattern.search(path)
        if match:
            # systemd escapes '-' in machine scope names as \x2d
            name = match.group(1).replace("\\x2d", "-") if kind == "machine" else match.group(1)
            return f"{kind}/{name}", path[match.end():] or "/"
    return "", path


def unit_of(path: str) -> str:
    """The unit systemd would name for a cgroup path: the first component that is not a slice."""
    first = next((c for c in path.split("/") if c and not c.endswith(".slice")), "")
    return first if first.endswith(UNIT_SUFFIXES) else ""


_CONTAINER_SCOPE = re.compile(r"^(docker|libpod|cri-containerd|crio)-(?:conmon-)?([0-9a-f]{12,})\.scope$")
_SCOPE_KINDS = {"docker": "docker", "libpod": "podman", "cri-containerd": "containerd", "crio": "crio"}


def container_scope_label(unit: str) -> str:
    """The container a runtime's host scope runs (docker-<id>.scope: docker/<id>), or ""."""
    match = _CONTAINER_SCOPE.match(unit)
    return f"{_SCOPE_KINDS[match.group(1)]}/{match.group(2)}" if match else ""


def attribute(cgroup_file: str | None) -> Attribution:
    if not cgroup_file:
        return Attribution("", "", "")
    path = cgroup_path(cgroup_file)
    container, inner = container_of(path)
    unit = unit_of(inner)
    if container and not unit:
        # Docker and Podman (systemd cgroup driver) run a container as a host scope,
        # docker-<id>.scope: the unit of its processes, unless they have one inside.
        host = unit_of(path)
        if container_scope_label(host) == container:
            unit = host
    return Attribution(cgroup=path, unit=unit, container=container)


def normalize_unit_name(name: str) -> str:
    """A unit name validated as systemd would (ValueError), with ".service" added as systemctl does."""
    if not name:
        raise ValueError("empty unit name")
    if len(name) > 255:
        raise ValueError(f"unit name too long ({len(name)} characters): {name[:40]!r}...")
    name = name if name.endswith(UNIT_SUFFIXES) else name + ".service"
    stem = name.rsplit(".", 1)[0]
    if not stem or not _UNIT_NAME.fullmatch(name) or name.startswith(".") or "/" in name:
        raise ValueError(f"invalid unit name {name!r}")
    return name


def validate_container_label(label: str) -> str:
    if not _CONTAINER_LABEL.fullmatch(label):
        raise ValueError(f"invalid container {label!r} (expected e.g. lxc/129 or docker/3f2a9c1d)")
    return label


def container_matches(label: str, wanted: str) -> bool:
    """Exact match, or an id prefix as `docker ps` prints it (docker/3f2a9c1d5e6f)."""
    if label == wanted or not wanted or not label:
        return label == wanted
    kind, _, ident = label.partition("/")
    wanted_kind, _, wanted_ident = wanted.partition("/")
    return kind == wanted_kind and len(wanted_ident) >= 4 and ident.startswith(wanted_ident)


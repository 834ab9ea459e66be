"""cgroup paths -> unit and container, for every runtime the issue names."""

from __future__ import annotations

import pytest

from gpuguardd.engine.attribution import (
    attribute,
    container_matches,
    container_scope_label,
    normalize_unit_name,
    validate_container_label,
)

DOCKER_ID = "3f2a9c1d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b"


@pytest.mark.parametrize(("path", "unit", "container"), [
    ("/system.slice/sglang-qwen.service", "sglang-qwen.service", ""),
    ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope", ""),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/x.service", "user@1000.service", ""),
    ("/", "", ""),
    ("/init.scope", "init.scope", ""),
    ("/lxc/129/system.slice/vllm.service", "vllm.service", "lxc/129"),
    ("/lxc/129/ns/system.slice/vllm.service", "vllm.service", "lxc/129"),
    ("/lxc/129/ns", "", "lxc/129"),
    ("/lxc.monitor/129", "", ""),
    ("/lxc.payload.gpu-box/system.slice/tgi.service", "tgi.service", "lxc/gpu-box"),
    ("/lxc.payload/gpu-box/init.scope", "init.scope", "lxc/gpu-box"),
    # A runtime's host scope is its container's unit ([Watch] Units=docker-*.scope).
    (f"/system.slice/docker-{DOCKER_ID}.scope", f"docker-{DOCKER_ID}.scope", f"docker/{DOCKER_ID}"),
    (f"/docker/{DOCKER_ID}", "", f"docker/{DOCKER_ID}"),
    (f"/machine.slice/libpod-{DOCKER_ID}.scope/container", f"libpod-{DOCKER_ID}.scope",
     f"podman/{DOCKER_ID}"),
    (f"/machine.slice/libpod-conmon-{DOCKER_ID}.scope", f"libpod-conmon-{DOCKER_ID}.scope",
     f"podman/{DOCKER_ID}"),
    # Docker inside an LXC container: that scope is the container's unit, not a host unit.
    (f"/lxc/129/system.slice/docker-{DOCKER_ID}.scope", f"docker-{DOCKER_ID}.scope", "lxc/129"),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{DOCKER_ID}.scope",
     f"cri-containerd-{DOCKER_ID}.scope", f"containerd/{DOCKER_ID}"),
    (f"/kubepods.slice/kubepods-pod2.slice/crio-{DOCKER_ID}.scope", f"crio-{DOCKER_ID}.scope",
     f"crio/{DOCKER_ID}"),
    ("/machine.slice/systemd-nspawn@box.service/payload/system.slice/ollama.service", "ollama.service",
     "nspawn/box"),
])
def test_v2_paths(path: str, unit: str, container: str) -> None:
    where = attribute(f"0::{path}\n")
    assert (where.unit, where.container, where.cgroup) == (unit, container, path)


def test_v1_hybrid_prefers_name_systemd() -> None:
    text = ("12:pids:/system.slice/x.service\n"
            "1:name=systemd:/lxc/200/system.slice/sglang.service\n"
            "0::/lxc/200/system.slice/sglang.service\n")
    where = attribute(text)
    assert (where.unit, where.container) == ("sglang.service", "lxc/200")


def test_unreadable_cgroup_is_empty() -> None:
    assert attribute(None).unit == "" and attribute("").container == ""


@pytest.mark.parametrize(("name", "normal"), [
    ("sglang-qwen", "sglang-qwen.service"), ("vllm.service", "vllm.service"),
    ("run-r1.scope", "run-r1.scope"), ("getty@tty1.service", "getty@tty1.service"),
])
def test_unit_names(name: str, normal: str) -> None:
    assert normalize_unit_name(name) == normal


@pytest.mark.parametrize("name", ["", "a b", "../etc/passwd", "x/y.service", ".service", "x" * 300, "$(reboot)"])
def test_bad_unit_names(name: str) -> None:
    with pytest.raises(ValueError):
        normalize_unit_name(name)


def test_container_labels() -> None:
    assert validate_container_label("lxc/129") == "lxc/129"
    # "lxc/129\n": a pattern ending in "$" lets a final newline through (fullmatch does not).
    for bad in ("129", "lxc/", "/lxc/1", "lxc/1 2", "lxc/129\n"):
        with pytest.raises(ValueError, match="invalid container"):
            validate_container_label(bad)
    assert container_matches(f"docker/{DOCKER_ID}", "docker/3f2a9c1d")
    assert not container_matches(f"docker/{DOCKER_ID}", "docker/3f")  # too short to be unambiguous
    assert not container_matches(f"docker/{DOCKER_ID}", "podman/3f2a9c1d")
    assert not container_matches("lxc/1290", "lxc/129")
    assert container_matches("", "")


def test_scope_names_and_their_containers() -> None:
    cid = "3f2a9c1d5e6f" + "0" * 52
    assert container_scope_label(f"docker-{cid}.scope") == f"docker/{cid}"
    assert container_scope_label(f"libpod-{cid}.scope") == f"podman/{cid}"
    assert container_scope_label(f"libpod-conmon-{cid}.scope") == f"podman/{cid}"
    assert container_scope_label(f"cri-containerd-{cid}.scope") == f"containerd/{cid}"
    assert container_scope_label(f"crio-{cid}.scope") == f"crio/{cid}"
    for other in ("docker.service", "docker-xyz.scope", f"docker-{cid}.service", "session-3.scope",
                  f"mydocker-{cid}.scope"):
        assert container_scope_label(other) == "", other


"""Container scope names (docker-<id>.scope, libpod-<id>.scope) and the containers they name
(a unit sweep of such a scope with real processes: tests/host/test_container_scopes.py)."""

from __future__ import annotations

from gpuguardd.engine.attribution import container_scope_label


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

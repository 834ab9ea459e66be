"""A sweep with a planted lock-file link creates nothing (the state files' links:
tests/unit/adversarial/test_state_symlinks.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import GiB, GpuHost


def test_a_sweep_with_a_planted_lock_link_creates_nothing(gpu_host: GpuHost, tmp_path: Path) -> None:
    host = gpu_host
    locks_dir = host.root / "run" / "locks"
    locks_dir.mkdir(parents=True)
    target = tmp_path / "created-by-root"
    (locks_dir / "gpu-0.lock").symlink_to(target)
    proc = host.spawn("--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"), nvml=(0, GiB))
    result = host.cli("sweep", "--gpu", "0", "--json")
    report_ = json.loads(result.stdout)
    assert not target.exists()
    assert any("a symbolic link, not followed" in w for w in report_["warnings"]), report_["warnings"]
    assert not proc.alive()

"""A huge GraceSec is refused before a sweep starts, not half done (the bounds of every time
span: tests/unit/adversarial/test_time_spans.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import GiB, GpuHost


@pytest.mark.parametrize("grace", ["9" * 400, "100000000"])
def test_a_sweep_with_a_huge_grace_is_refused_not_half_done(gpu_host: GpuHost, grace: str) -> None:
    """The configured grace: a usage error before anything is signalled, not a crash after
    SIGTERM with no SIGKILL and no report."""
    host = gpu_host
    host.write_config(f"[Sweep]\nGraceSec={grace}\n")
    holder = host.spawn("--ignore-term", "--hold", host.node("nvidia0"), "--hold", host.node("nvidia-uvm"),
                        nvml=(0, GiB))
    result = host.cli("sweep", "--gpu", "0", "--json", timeout=30)
    assert result.returncode == 2, result.stderr
    assert f"{host.config_path}:" in result.stderr and "[Sweep] GraceSec" in result.stderr
    assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr
    assert holder.alive()
    # The same huge value given on the command line is a usage error too.
    host.write_config()
    result = host.cli("sweep", "--gpu", "0", "--grace", grace, "--json", timeout=30)
    assert result.returncode == 2 and "too long" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert holder.alive()
    # And an ordinary grace still ends it with SIGKILL and a report.
    result = host.cli("sweep", "--gpu", "0", "--grace", "200ms", "--json", timeout=30)
    report = json.loads(result.stdout)
    assert [t["signal"] for t in report["terminated"]] == ["SIGKILL"], report

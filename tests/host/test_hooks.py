"""The stop hook's root part: a local sweep (no daemon) records the hook as its requester
(the drop-ins and patterns: tests/unit/systemd/test_dropins.py)."""

from __future__ import annotations

import json

from tests.conftest import GpuHost


def test_local_fallback_records_the_hook_as_requester(gpu_host: GpuHost) -> None:
    """`gpuguardctl sweep --unit %n --reason "hook:%n ..."` without a daemon (root's fallback)."""
    done = gpu_host.cli("sweep", "--unit", "sglang-x.service", "--reason",
                        "hook:sglang-x.service result=failed code=killed status=9", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["requested_by"] == "hook:sglang-x.service"
    assert report["reason"].startswith("hook:sglang-x.service result=failed")
    done = gpu_host.cli("sweep", "--unit", "sglang-x.service", "--json")
    assert json.loads(done.stdout)["requested_by"].startswith("uid 0 (root)")

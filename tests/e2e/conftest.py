"""One throwaway systemd machine for the whole e2e session, with gpuguard installed in it.

The host must come out untouched: the teardown checks that a file left in the host's /tmp
survived (systemd booted on the host's own root would have emptied /tmp) and that the host's
/etc/systemd/system is exactly as before, although the tests write units and drop-ins there
inside the container.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Installed, Machine, host_fingerprint, require_tools

HOST_WATCHED = ["/etc/systemd/system"]


def _require() -> None:
    missing = require_tools()
    if missing:
        pytest.skip("the e2e tests need " + ", ".join(missing))


@pytest.fixture(scope="session")
def guard() -> Iterator[Installed]:
    _require()
    sentinel = Path("/tmp") / f"gpuguard-e2e-sentinel-{uuid.uuid4().hex}"
    sentinel.write_text("the host's /tmp must keep this file\n")
    before = host_fingerprint(HOST_WATCHED)
    machine = Machine()
    try:
        machine.boot()
        installed = Installed(machine)
        installed.install()
        installed.start_daemon()
        # Written inside only: must never show up on the host.
        machine.write(f"/tmp/{sentinel.name}.inside", "inside\n")
        yield installed
    finally:
        machine.shutdown()
        survived = sentinel.exists()
        leaked = Path(f"/tmp/{sentinel.name}.inside").exists()
        sentinel.unlink(missing_ok=True)
    assert survived, "the host's /tmp was cleaned: systemd must never boot on the host's root"
    assert not leaked, "a file written inside the container appeared in the host's /tmp"
    assert host_fingerprint(HOST_WATCHED) == before, "the host's /etc/systemd/system changed"
    assert not machine.base.exists(), f"scratch directory {machine.base} left behind"

"""Fixtures the adversarial tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.bus.adversarial.fake_systemd import FakeSystemd
from tests.dbus_harness import BusDaemon


@pytest.fixture
def systemd(system_bus: BusDaemon) -> Iterator[FakeSystemd]:
    """A stand-in systemd manager on the private system bus (fake_systemd.py)."""
    fake = FakeSystemd(system_bus.address)
    try:
        yield fake
    finally:
        fake.close()

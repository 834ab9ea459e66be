"""tests/unit: no root, no services (no bus, no systemd, no daemon); seconds in all.

`make check` runs them as nobody. A unit test never skips: tests/conftest.py turns a skip
here into a failure that says so, on every machine, CI or not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def gpuguard_logger_as_it_was() -> Iterator[None]:
    """A test that runs a verb in-process (cli main) sets up gpuguard's logging: its handler and
    propagate=False would then hide every later test's records from caplog, in whatever test
    runs after it in the same worker. Each test gets the logger back as it found it."""
    logger = logging.getLogger("gpuguard")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.propagate = saved[0], saved[2]
    logger.setLevel(saved[1])  # setLevel, not .level: it also clears the loggers' level cache

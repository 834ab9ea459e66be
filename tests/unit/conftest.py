"""tests/unit: no root, no services (no bus, no systemd, no daemon); seconds in all.

`make check` runs them as nobody. A unit test never skips: a skip here means it wanted root
(a test of another kind: tests/host, tests/bus, ...) or a tool `make deps` installs, so a skip
is turned into a failure that says so, on every machine, CI or not.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"a unit test skipped ({reason}): tests/unit needs no root and no "
                           "service (else move it to its kind), and its tools come from make deps")
    return report

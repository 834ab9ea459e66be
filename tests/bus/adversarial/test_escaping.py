"""Terminal and log injection: a process named with escape sequences or a
newline gets nothing raw into gpuguardctl's human output or the daemon's journal lines.

The attacker chooses a holder's comm (prctl) and argv. Raw, `\\x1b[2J` clears the admin's
screen, `\\x1b]0;pwned\\x07` sets the terminal title, a newline forges a journal line (with a
priority prefix of its choice), U+202E shows text reversed. JSON output stays valid JSON that
still carries the exact name.
"""

from __future__ import annotations

import json
import re

from tests.conftest import GiB
from tests.dbus_harness import GuardDaemon, private_gpu, private_holder, wait_until
from tests.unit.adversarial.test_escaping import FORGED, SCREEN, assert_clean

pytest_plugins = ["tests.dbus_harness"]


def test_daemon_and_ctl_output_escape_hostile_names(guard: GuardDaemon) -> None:
    """holders, sweep (dry and real), history, JSON and the daemon's own log lines."""
    host = guard.host
    screen = private_holder(host, GiB, "--comm", SCREEN)
    forged = private_holder(host, GiB, "--comm", FORGED)
    gpu = str(private_gpu(host))

    def listed() -> str | None:
        result = guard.ctl("holders", "--gpu", gpu)
        return result.stdout if str(screen) in result.stdout and str(forged) in result.stdout \
            else None
    holders = wait_until(listed, 15, "both hostile holders listed")
    assert_clean(holders, lines=3)  # header and one row each: the newline made no row

    as_json = guard.ctl("holders", "--gpu", gpu, "--json")
    assert as_json.returncode == 0, as_json.stderr
    comms = {h["pid"]: h["comm"] for h in json.loads(as_json.stdout)}
    assert comms[screen] == SCREEN and comms[forged] == FORGED  # exact, in valid JSON

    dry = guard.ctl("sweep", "--gpu", gpu, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert_clean(dry.stdout, lines=5)  # header, 2 targets, GPU line, outcome
    real = guard.ctl("sweep", "--gpu", gpu, "--grace", "2")
    assert real.returncode == 0, real.stdout + real.stderr
    assert_clean(real.stdout)
    assert sum("terminated" in line for line in real.stdout.splitlines()) == 2, real.stdout
    history = guard.ctl("history", "-n", "2")
    assert history.returncode == 0, history.stderr
    assert_clean(history.stdout)
    status = guard.ctl("status")
    assert_clean(status.stdout)

    # The daemon's journal lines: each signal was logged, escaped, one line each, all prefixed.
    wait_until(lambda: "gg\\n<3>FORGED" in guard.stderr(), 10, "the signal log line")
    log = guard.stderr()
    assert_clean(log)
    assert all(re.match(r"<\d>", line) for line in log.splitlines()), log
    assert not any(line.startswith("<3>FORGED") for line in log.splitlines())



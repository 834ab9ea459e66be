"""The start gate on a real systemd: `gpuguardctl hook install --start` makes a unit's
ExecStart wait until its own GPUs are free, so "stop A, start B" on the same GPU is safe.

Unit A's workers ignore SIGTERM and their memory lingers after they die (the fake NVML releases
it over 1.5 s and then grows back for 1 s); B, gated on the same GPU, must start only after all
of that and two steady seconds; C, gated on the other GPU, starts at once; a gate that times out
fails its unit's start, saying why in the unit's journal.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.e2e.harness import INFERENCE_UNIT, REPO, Installed, wait_for

pytestmark = pytest.mark.timeout(240)

EVENTS = "/run/fake-nvml/events"
# The daemon's fake NVML says when it first saw each pid gone (tests/fakenvml: EVENTS_ENV).
EVENTS_DROPIN = f"[Service]\nEnvironment=FAKE_NVML_EVENTS={EVENTS}\n"
RELEASE_DELAY_MS, RELEASE_MS, WOBBLE_MS = 200, 1500, 1000  # fake_server.py's registration
STABLE_SEC = 2  # longer than the wobble: a gate that missed it would pass during it


def write_unit(guard: Installed, name: str, gpu: int, args: str, extra: str = "") -> None:
    text = INFERENCE_UNIT.format(
        flavor="SGLang", name=name, python="/usr/bin/python3",
        server=REPO / "tests" / "e2e" / "fake_server.py", args=f"--gpu={gpu} {args}",
        cuda=str(gpu), extra=extra)
    guard.machine.write(f"/etc/systemd/system/{name}", textwrap.dedent(text))


def monotonic_start_ns(guard: Installed, unit: str) -> int:
    return int(guard.machine.show(unit, "ExecMainStartTimestampMonotonic")) * 1000


def dead_ns(guard: Installed) -> dict[int, int]:
    found: dict[int, int] = {}
    for line in guard.machine.read(EVENTS).splitlines():
        _, pid, ns = line.split()
        found.setdefault(int(pid), int(ns))
    return found


@pytest.fixture
def gated(guard: Installed) -> Iterator[Installed]:
    m = guard.machine
    m.write("/etc/systemd/system/gpuguardd.service.d/gate-events.conf", EVENTS_DROPIN)
    m.run(f"rm -f {EVENTS}; gpuguardctl hook install --start gate- >/dev/null")
    m.systemctl("daemon-reload")
    m.systemctl("restart", "gpuguardd.service")
    yield guard
    for unit in ("gate-b.service", "gate-c.service", "gate-d.service",
                 "sglang-gate-a.service", "sglang-gate-hold.service"):
        m.systemctl("stop", unit, check=False)
        # KillMode=process left the gated units' workers (no stop hook on them): end them, so
        # no later test finds them.
        m.run(["gpuguardctl", "sweep", "--unit", unit, "--grace", "1s"], check=False)
        m.run(["rm", "-f", f"/etc/systemd/system/{unit}"])
    m.run(f"gpuguardctl hook remove --start gate- >/dev/null; rm -f {EVENTS} "
          "/etc/systemd/system/gpuguardd.service.d/gate-events.conf")
    m.systemctl("daemon-reload")
    m.systemctl("restart", "gpuguardd.service")
    guard.write_gpus()


def test_start_waits_for_the_predecessors_leftovers_and_steady_memory(gated: Installed) -> None:
    guard, m = gated, gated.machine
    write_unit(guard, "sglang-gate-a.service", 0,
               f"--workers=2 --mib=20480 --stubborn=1 --release-ms={RELEASE_MS} "
               f"--wobble-mib=48 --wobble-ms={WOBBLE_MS}")
    gate_opts = (f'Environment="GPUGUARD_WAIT_OPTIONS=--stable {STABLE_SEC}s --timeout 60s"\n'
                 'TimeoutStartSec=90')
    write_unit(guard, "gate-b.service", 0, "--workers=1 --mib=1024", gate_opts)
    write_unit(guard, "gate-c.service", 1, "--workers=1 --mib=1024", gate_opts)
    m.systemctl("daemon-reload")
    assert "gpuguard-start.conf" in guard.machine.show("gate-b.service", "DropInPaths")
    m.systemctl("start", "sglang-gate-a.service")
    pids = guard.server_pids("sglang-gate-a.service")
    workers = {v for k, v in pids.items() if k.startswith("worker")}
    wait_for("gpuguardd to see A's workers",
             lambda: workers <= {h["pid"] for h in guard.holders()}, 20, 0.3)

    # Stop A (its ExecStopPost sweep takes the 2 s grace for the stubborn worker) and, while
    # that runs, start B on the same GPU and C on the other.
    stop = m.popen(["systemctl", "stop", "sglang-gate-a.service"])
    time.sleep(0.5)
    issued = time.monotonic_ns()
    start_b = m.popen(["systemctl", "start", "gate-b.service"])
    start_c = m.popen(["systemctl", "start", "gate-c.service"])
    for proc in (stop, start_b, start_c):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + m.journal("-n", "40", "-u", "gate-b.service")

    b, c = monotonic_start_ns(guard, "gate-b.service"), monotonic_start_ns(guard, "gate-c.service")
    # C's GPU was free all along: only its steady time, not A's leftovers.
    assert c - issued < (STABLE_SEC + 2.5) * 1e9, (c - issued) / 1e9
    assert c < b
    # B ran only after every worker of A was gone, its memory released over time, grown back
    # (below FreeBelowMiB and ReleasedBelowMiB, so only the steadiness rule sees it) and
    # settled (the fake's own clock), and then STABLE_SEC of steady memory.
    died = dead_ns(guard)
    assert workers <= set(died), died
    settled = max(died[p] for p in workers) + (RELEASE_DELAY_MS + RELEASE_MS + WOBBLE_MS) * 10**6
    assert b >= settled + STABLE_SEC * 10**9 - 50_000_000, (b - settled) / 1e9
    # ...and after A's sweep was over (a gate waits for a sweep covering its GPUs).
    report = guard.reports_for("sglang-gate-a.service")[0]
    assert report["outcome"] == "freed", report
    swept_until = report["started_usec"] + report["duration_ms"] * 1000
    # The container shares the host's clocks (no time namespace): B's start on CLOCK_REALTIME.
    b_realtime_usec = (b + time.time_ns() - time.monotonic_ns()) // 1000
    assert b_realtime_usec >= swept_until - 1_000_000
    assert "gpuguard: free after" in m.journal("-u", "gate-b.service")


def test_a_gate_that_times_out_fails_the_start_with_the_reason(gated: Installed) -> None:
    guard, m = gated, gated.machine
    pids = guard.start_server("sglang-gate-hold.service", workers=1, gpus=(0,))
    write_unit(guard, "gate-d.service", 0, "--workers=1 --mib=1024",
               'Environment="GPUGUARD_WAIT_OPTIONS=--stable 1s --timeout 3s"')
    m.systemctl("daemon-reload")
    done = m.systemctl("start", "gate-d.service", check=False)
    assert done.returncode != 0
    assert m.show("gate-d.service", "ActiveState") == "failed"
    assert m.show("gate-d.service", "ExecMainStartTimestampMonotonic") == "0"  # never ran
    journal = m.journal("-u", "gate-d.service")
    assert "not free after 3 s" in journal, journal
    assert f"compute holder pid {pids['worker0']}" in journal, journal


def test_sweep_leftovers_then_wait(guard: Installed) -> None:
    """A predecessor without the stop hook: `wait --sweep-leftovers UNIT` ends what it left,
    then waits for its memory."""
    m = guard.machine
    write_unit(guard, "rot-e.service", 0, "--workers=2 --mib=4096 --stubborn=1")
    m.systemctl("daemon-reload")
    try:
        m.systemctl("start", "rot-e.service")
        pids = guard.server_pids("rot-e.service")
        workers = [v for k, v in pids.items() if k.startswith("worker")]
        wait_for("gpuguardd to see the workers",
                 lambda: set(workers) <= {h["pid"] for h in guard.holders()}, 20, 0.3)
        m.systemctl("stop", "rot-e.service")  # KillMode=process: the workers stay
        assert all(guard.alive(p) for p in workers)
        done = m.run(["gpuguardctl", "wait", "--gpu", "0", "--stable", "1s", "--timeout", "60s",
                      "--sweep-leftovers", "rot-e.service"], check=False, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "gpuguard: free after" in done.stdout
        assert not any(guard.alive(p) for p in workers)
        report = guard.reports_for("rot-e.service")[0]
        assert report["outcome"] == "freed", report
        assert report["reason"] == "gate: leftovers of rot-e.service"
        assert {t["pid"] for t in report["terminated"]} == set(workers)
    finally:
        m.systemctl("stop", "rot-e.service", check=False)
        m.run(["gpuguardctl", "sweep", "--unit", "rot-e.service", "--grace", "1s"], check=False)
        m.run(["rm", "-f", "/etc/systemd/system/rot-e.service"])
        m.systemctl("daemon-reload")

"""The start gate through the real daemon on a private dbus-daemon: Manager.Wait,
the Gpu objects' FreeSinceUsec and WaitingOn, and `gpuguardctl wait` over them, against a
fake NVML whose memory comes back slowly and wobbles (tests/fakenvml)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

from tests.conftest import GiB
from tests.dbus_harness import GPU, MANAGER_PATH, PYTHON, GuardDaemon, wait_until
from tests.fakenvml import CALLS_ENV, EVENTS_ENV, calls_per_gpu

pytest_plugins = ["tests.dbus_harness"]

GPU0 = MANAGER_PATH + "/gpu/0"
GPU1 = MANAGER_PATH + "/gpu/1"
EXIT_GATE_TIMEOUT = 8
GATE = "[Gate]\nStableSec=1\nToleranceMiB=16\nFreeBelowMiB=256\n"


def start(daemon: GuardDaemon) -> None:
    daemon.host.write_config("[Daemon]\nPollIntervalSec=2\n" + GATE)
    daemon.extra_env[EVENTS_ENV] = str(daemon.workdir / "nvml-events")
    daemon.start()


def hold(daemon: GuardDaemon, gpu: int, used: int, **release: int) -> int:
    """A compute process on `gpu` (its node open, NVML listing it with `used` bytes)."""
    host = daemon.host
    proc = host.spawn("--hold", host.node(f"nvidia{gpu}"))
    host.state.add_proc(gpu, proc.pid, used, **release)  # type: ignore[arg-type]
    host.publish()
    return proc.pid


def dead_ns(daemon: GuardDaemon, pid: int) -> int:
    """When the fake NVML in gpuguardd found `pid` gone (CLOCK_MONOTONIC ns)."""
    for line in (daemon.workdir / "nvml-events").read_text().splitlines():
        _, found, ns = line.split()
        if int(found) == pid:
            return int(ns)
    raise AssertionError(f"the fake NVML never saw pid {pid} gone")


def ctl_wait(daemon: GuardDaemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "wait", "--json", *args],
                            env=daemon.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 40) -> tuple[int, dict[str, Any], int]:
    out, err = proc.communicate(timeout=timeout)
    ended = time.monotonic_ns()
    assert out.strip(), err
    return proc.returncode, json.loads(out), ended


def test_wait_passes_only_after_slow_release_and_wobble_settle(daemon: GuardDaemon) -> None:
    start(daemon)
    # 20 GiB that fall over 0.6 s after the exit, then 128 MiB back for 0.8 s (below
    # FreeBelowMiB, above ToleranceMiB): the gate must not count the dip before it as steady.
    pid = hold(daemon, 0, 20 * GiB, release_delay_ms=300, release_ms=600, wobble=128 * 2**20,
               wobble_ms=800)
    other = hold(daemon, 1, 20 * GiB)
    daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")  # a scan after both started
    wait_until(lambda: daemon.get_property(GPU0, GPU, "WaitingOn") != ["not judged yet"]
               and any(f"pid {pid}" in w for w in daemon.get_property(GPU0, GPU, "WaitingOn")),
               15, "GPU 0 waits on the holder")
    assert daemon.get_property(GPU0, GPU, "FreeSinceUsec") == 0
    waiter = ctl_wait(daemon, "--gpu", "0", "--timeout", "30")
    time.sleep(1.0)
    assert waiter.poll() is None  # held: still waiting
    os.kill(pid, 9)
    code, result, ended = finish(waiter)
    assert code == 0, result
    assert result["free"] is True
    # Settled (on the fake's clock) at death + delay + release + wobble; passing needs 1 s of
    # steady memory after that.
    settled = dead_ns(daemon, pid) + (300 + 600 + 800) * 1_000_000
    assert ended >= settled + 1_000_000_000 - 50_000_000
    (gpu,) = result["gpus"]
    assert gpu["index"] == 0 and gpu["waiting_on"] == [] and gpu["stable_ms"] >= 1000
    # The property says the same; GPU 1, still held, says why.
    wait_until(lambda: daemon.get_property(GPU0, GPU, "FreeSinceUsec") > 0, 10, "FreeSinceUsec")
    assert daemon.get_property(GPU0, GPU, "WaitingOn") == []
    assert any(f"pid {other}" in w for w in daemon.get_property(GPU1, GPU, "WaitingOn"))


def test_wait_times_out_with_a_distinct_status_naming_the_holder(daemon: GuardDaemon) -> None:
    start(daemon)
    pid = hold(daemon, 0, 4 * GiB)
    wait_until(lambda: any(f"pid {pid}" in w for w in daemon.get_property(GPU0, GPU, "WaitingOn")),
               15, "GPU 0 waits on the holder")
    done = daemon.ctl("wait", "--gpu", "0", "--timeout", "2", "--stable", "0.5")
    assert done.returncode == EXIT_GATE_TIMEOUT, done.stderr
    assert f"compute holder pid {pid}" in done.stdout
    assert "not free after" in done.stdout
    # GPU 1 is free: it passes after its stable time.
    quick = daemon.ctl("wait", "--gpu", "1", "--stable", "0.5", "--timeout", "10")
    assert quick.returncode == 0, quick.stdout + quick.stderr
    assert "free after" in quick.stdout


def test_cuda_visible_devices_selects_the_gpus(daemon: GuardDaemon) -> None:
    start(daemon)
    hold(daemon, 1, 4 * GiB)
    env = {**daemon.env, "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run([PYTHON, "-m", "gpuguardd.cli.main", "wait", "--stable", "0.3",
                           "--timeout", "10"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    env["CUDA_VISIBLE_DEVICES"] = "1"
    held = subprocess.run([PYTHON, "-m", "gpuguardd.cli.main", "wait", "--stable", "0.3",
                           "--timeout", "1"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert held.returncode == EXIT_GATE_TIMEOUT, held.stdout + held.stderr
    env["CUDA_VISIBLE_DEVICES"] = "0,x1"
    bad = subprocess.run([PYTHON, "-m", "gpuguardd.cli.main", "wait", "--timeout", "1"],
                         env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert bad.returncode == 2 and "CUDA_VISIBLE_DEVICES" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_memory_above_free_below_blocks_and_the_option_moves_it(daemon: GuardDaemon) -> None:
    daemon.host.state.gpus[0].base_used = 512 * 1024 * 1024  # held by nobody
    daemon.host.publish()
    start(daemon)
    (result,) = daemon.manager("Wait", "a{sv}", "3", "gpus", "au", "1", "0", "timeout_ms", "u",
                               "500", "stable_ms", "u", "100")
    assert result["free"] is False
    assert result["gpus"][0]["waiting_on"] == ["memory in use at or above 256 MiB"]
    (passed,) = daemon.manager("Wait", "a{sv}", "4", "gpus", "au", "1", "0", "timeout_ms", "u",
                               "5000", "stable_ms", "u", "200", "free_below_mib", "u", "1024")
    assert passed["free"] is True
    # Anyone may call it (the XML's rule: public), through the shipped bus policy.
    (anyone,) = daemon.manager("Wait", "a{sv}", "2", "gpus", "au", "1", "0", "timeout_ms", "u",
                               "100", as_nobody=True)
    assert anyone["free"] is False and anyone["gpus"][0]["index"] == 0


def test_bad_options_are_refused_by_name(daemon: GuardDaemon) -> None:
    start(daemon)
    for key, value in (("free_below_mib", "0"), ("stable_ms", "3600001")):
        try:
            daemon.manager("Wait", "a{sv}", "1", key, "u", value)
        except AssertionError as exc:
            assert key in str(exc) and "out of range" in str(exc)
        else:
            raise AssertionError(f"{key}={value} was accepted")


def test_without_nvml_it_fails_closed_unless_unverified_is_allowed(daemon: GuardDaemon) -> None:
    daemon.host.state.init_error = 9  # driver not loaded
    daemon.host.publish()
    start(daemon)
    closed = daemon.ctl("wait", "--timeout", "1", "--stable", "0")
    assert closed.returncode == EXIT_GATE_TIMEOUT, closed.stdout + closed.stderr
    assert "NVML unavailable" in closed.stdout
    allowed = daemon.ctl("wait", "--timeout", "5", "--stable", "0", "--allow-unverified")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_waiting_on_a_held_gpu_polls_nothing_more_and_its_exit_is_seen_at_once(
        daemon: GuardDaemon) -> None:
    """Behind a live holder nothing can be free: no fast polling (a pidfd on the holder), and
    its exit is seen at once although PollIntervalSec is long."""
    calls = daemon.workdir / "nvml-calls"
    daemon.host.write_config("[Daemon]\nPollIntervalSec=30\n" + GATE)
    daemon.start(env={CALLS_ENV: str(calls)})
    pid = hold(daemon, 0, 4 * GiB)
    daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")
    waiters = [ctl_wait(daemon, "--gpu", "0", "--timeout", "30", "--stable", "0.5")
               for _ in range(4)]
    time.sleep(3)  # every waiter in its Wait call
    before = calls_per_gpu(calls).get(0, 0)
    time.sleep(2)
    during = calls_per_gpu(calls).get(0, 0) - before
    # Polling fast (40 a second) would make this hundreds of calls; a poll every 30 s, a few.
    assert during < 20, during
    assert all(w.poll() is None for w in waiters)
    killed = time.monotonic_ns()
    os.kill(pid, 9)
    for waiter in waiters:
        code, result, ended = finish(waiter)
        assert code == 0, result
        # The exit, then 0.5 s steady: nowhere near the 30 s poll interval.
        assert ended - killed < 3_000_000_000, (ended - killed) / 1e9


def test_a_mig_instance_is_gated_alone(daemon: GuardDaemon) -> None:
    """Instance A's tenant exits and its memory comes back over time, then wobbles; B stays
    busy. A gate on A passes once A's own memory settled; one on the whole GPU does not."""
    from tests.host.test_mig import MIG_A, MIG_B, setup_mig

    mig = setup_mig(daemon.host, "[Daemon]\nPollIntervalSec=2\n" + GATE)
    for proc in daemon.host.state.procs:
        if proc.pid == mig.a.pid:
            proc.release_ms, proc.wobble, proc.wobble_ms = 600, 64 * 2**20, 500
    daemon.host.publish()
    daemon.extra_env[EVENTS_ENV] = str(daemon.workdir / "nvml-events")
    daemon.start()
    daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")
    (held,) = daemon.manager("Wait", "a{sv}", "2", "gpus", "as", "1", MIG_A, "timeout_ms", "u", "300")
    assert held["free"] is False
    assert [g["mig_uuid"] for g in held["gpus"]] == [MIG_A]
    assert any(f"pid {mig.a.pid}" in w for w in held["gpus"][0]["waiting_on"])
    waiter = ctl_wait(daemon, "--gpu", MIG_A, "--timeout", "30")
    time.sleep(1.0)
    mig.a.stop()
    code, result, ended = finish(waiter)
    assert code == 0, result
    settled = dead_ns(daemon, mig.a.pid) + (200 + 600 + 500) * 1_000_000
    assert ended >= settled + 1_000_000_000 - 50_000_000, (ended - settled) / 1e9
    # B's tenant and leak keep the whole GPU, and B, from being free.
    for wanted in (["1"], [MIG_B]):
        (whole,) = daemon.manager("Wait", "a{sv}", "2", "gpus", "as", str(len(wanted)), *wanted,
                                  "timeout_ms", "u", "300")
        assert whole["free"] is False, whole


def test_on_a_terminal_it_shows_progress_then_one_line(daemon: GuardDaemon) -> None:
    import pty
    import select

    start(daemon)
    pid = hold(daemon, 0, 4 * GiB)
    daemon.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")
    main, sub = pty.openpty()
    proc = subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "wait", "--gpu", "0",
                             "--stable", "0.5", "--timeout", "20"], env=daemon.env,
                            stdin=sub, stdout=sub, stderr=sub)
    os.close(sub)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        killed = False
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # the other side closed: the process ended
                    break
                if not chunk:
                    break
                seen += chunk
            if not killed and seen.count(b"\r\x1b[K") >= 2:  # it has drawn progress twice
                os.kill(pid, 9)
                killed = True
        proc.wait(timeout=10)
    finally:
        os.close(main)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text
    # Each GPU's memory and what it waits on, redrawn in place; then one line when it passes.
    assert f"GPU 0: 4.0 GiB used; compute holder pid {pid}" in text, text
    assert "free and steady for" in text, text
    assert text.rstrip().splitlines()[-1].startswith("gpuguard: free after "), text

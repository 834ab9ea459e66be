"""gpuguard on a real systemd (PID 1 in a throwaway nspawn container, see harness.py).

The user's main path: an admin runs `systemctl stop sglang-demo` and, with no further command,
every leftover holder of the unit's GPUs is gone, the memory is verified free, and the result
is on the bus, in the history and in the journal.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import GiB, Installed, booted, host_fingerprint, wait_for

pytestmark = pytest.mark.timeout(240)

MANAGER_PROPS = ("get-property", "org.gpuguard.GpuGuard1", "/org/gpuguard/GpuGuard1",
                 "org.gpuguard.GpuGuard1.Manager")


def worker_pids(pids: dict[str, int]) -> list[int]:
    return [pid for name, pid in pids.items() if name.startswith("worker")]


def wait_gone(guard: Installed, pids: list[int], timeout: float = 20) -> None:
    wait_for(f"pids {pids} to be gone", lambda: not any(guard.alive(p) for p in pids), timeout)


def main_pid(guard: Installed) -> int:
    return int(guard.machine.show("gpuguardd.service", "MainPID"))


def wait_daemon_up(guard: Installed, old_pid: int = 0, timeout: float = 30) -> int:
    def up() -> int | None:
        if guard.machine.show("gpuguardd.service", "ActiveState") != "active":
            return None
        pid = main_pid(guard)
        return pid if pid and pid != old_pid else None
    return wait_for("gpuguardd to be active", up, timeout, 0.2)


# -- the unit and its sandbox ----------------------------------------------------------------

def test_unit_verifies_clean_and_is_hardened(guard: Installed) -> None:
    m = guard.machine
    # --man=no: the man pages are built by the package, not present in this test root.
    done = m.run(["systemd-analyze", "verify", "--man=no",
                  "/usr/lib/systemd/system/gpuguardd.service"], check=False)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr
    security = m.run(["systemd-analyze", "security", "--no-pager", "gpuguardd.service"],
                     check=False).stdout
    score = re.search(r"Overall exposure level for gpuguardd\.service: ([0-9.]+)", security)
    assert score, security
    print(f"systemd-analyze security gpuguardd.service: {score.group(1)}")
    assert float(score.group(1)) <= 2.0, security
    # The bounding set is exactly what reading and signalling other users' processes needs.
    status = m.read(f"/proc/{main_pid(guard)}/status")
    bounding = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.M).group(1), 16)  # type: ignore[union-attr]
    cap_dac_read_search, cap_kill, cap_sys_ptrace = 2, 5, 19
    assert bounding == (1 << cap_dac_read_search) | (1 << cap_kill) | (1 << cap_sys_ptrace)
    assert m.show("gpuguardd.service", "MemoryDenyWriteExecute") == "yes"
    assert m.show("gpuguardd.service", "ProtectSystem") == "strict"


def test_prefix_dropins_apply_to_inference_units(guard: Installed) -> None:
    guard.add_server("vllm-probe.service", workers=1)
    guard.machine.systemctl("daemon-reload")
    paths = guard.machine.show("vllm-probe.service", "DropInPaths")
    assert "/etc/systemd/system/vllm-.service.d/gpuguard.conf" in paths
    stop_post = guard.machine.show("vllm-probe.service", "ExecStopPost")
    assert "gpuguardctl" in stop_post and "--unit vllm-probe.service" in stop_post


# -- the main path: systemctl stop ------------------------------------------------------------

def test_stop_ends_every_leftover_and_verifies_memory(guard: Installed) -> None:
    m = guard.machine
    unit = "sglang-demo.service"
    pids = guard.start_server(unit, workers=3, gpus=(0,), stubborn=(1,), escaper=2)
    workers = worker_pids(pids)
    stubborn, escaper = pids["worker1"], pids["worker2"]
    # Worker 2 leaves the unit's cgroup for one no unit owns, as a re-parented rank would.
    m.run(["kill", "-USR1", str(escaper)])
    wait_for("the worker to leave the unit's cgroup", lambda: unit not in guard.cgroup(escaper), 10)
    holders = {h["pid"]: h for h in guard.holders()}
    assert holders[escaper]["unit"] == "", holders[escaper]

    with guard.monitor() as bus:
        m.systemctl("stop", unit)  # returns after ExecStopPost, i.e. after the sweep
    # systemctl stop itself left them running (KillMode=process); gpuguard ended them all.
    wait_gone(guard, workers, 5)
    assert not [h for h in guard.holders() if h["pid"] in workers]

    report = guard.reports_for(unit)[0]
    assert report["requested_by"] == f"hook:{unit}"
    assert report["reason"] == f"hook:{unit} result=success code=exited status=0"
    assert report["outcome"] == "freed", report
    ended = {t["pid"]: t["signal"] for t in report["terminated"]}
    assert set(ended) == set(workers)
    assert ended[stubborn] == "SIGKILL"  # ignored SIGTERM
    assert ended[escaper] == "SIGTERM"  # outside the cgroup, still the unit's leftover
    assert report["scope"]["adopted_pids"] == [escaper]
    gpu0 = next(g for g in report["gpus"] if g["index"] == 0)
    assert gpu0["memory_used_before"] == 3 * 20 * GiB and gpu0["memory_used_after"] == 0

    seen = [(s.member, s.args[0]) for s in bus]
    assert seen[0] == ("SweepStarted", report["id"]) and seen[-1] == ("SweepFinished", report["id"])
    terminated = {s.args[1]: s.args[4] for s in bus if s.member == "ProcessTerminated"}
    assert terminated == ended
    assert bus[-1].args[1] == "freed" and bus[-1].args[2]["id"] == report["id"]
    journal = m.journal("-u", "gpuguardd.service")
    assert re.search(rf"sweep {report['id'][:8]} started by hook:{re.escape(unit)}", journal)
    assert f"pid {escaper} (sglang-tp2) is in cgroup" in journal


def test_user_owned_leftovers_are_read_and_ended(guard: Installed) -> None:
    """The three capabilities suffice for another user's processes (fds readable, signals)."""
    m = guard.machine
    m.run("id alice >/dev/null 2>&1 || useradd --no-create-home alice")
    unit = "ollama-alice.service"
    guard.add_server(unit, workers=2, gpus=(1,))
    m.write(f"/etc/systemd/system/{unit}.d/user.conf", "[Service]\nUser=alice\n")
    m.systemctl("daemon-reload")
    m.systemctl("start", unit)
    pids = worker_pids(guard.server_pids(unit))

    def both() -> list[dict[str, Any]] | None:
        found = [h for h in guard.holders() if h["pid"] in pids]
        return found if len(found) == 2 else None
    seen = wait_for("alice's workers", both, 20)
    python = m.run(["readlink", "-f", "/usr/bin/python3"]).stdout.strip()
    for holder in seen:
        # /proc/<pid>/fd listed (CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE) and /proc/<pid>/exe
        # resolved (CAP_SYS_PTRACE), not guessed from the command line.
        assert holder["user"] == "alice" and "fd" in holder["how"], holder
        assert holder["exe"] == python, holder
    m.systemctl("stop", unit)
    wait_gone(guard, pids, 5)
    report = guard.reports_for(unit)[0]
    assert report["outcome"] == "freed"
    # The '+' prefix: the hook ran as root although the unit runs as alice (a non-root
    # caller saying "hook:" would be recorded as "hook:... via uid ...").
    assert report["requested_by"] == f"hook:{unit}"


# -- watch mode -----------------------------------------------------------------------------

def test_watch_sweeps_a_matching_unit_without_dropin(guard: Installed) -> None:
    unit = "watched-llm.service"
    pids = worker_pids(guard.start_server(unit, workers=2, gpus=(1,)))
    assert not guard.machine.show(unit, "DropInPaths")  # no hook: only the watch can act
    guard.machine.systemctl("stop", unit)
    wait_gone(guard, pids, 20)
    report = wait_for("the watch's report", lambda: guard.reports_for(unit) or None, 10)[0]
    assert report["requested_by"] == f"watch:{unit}"
    assert report["outcome"] == "freed"


def test_cuda_visible_devices_names_the_units_gpus(guard: Installed) -> None:
    """A rank that left before anyone saw it in the unit: the unit's CUDA_VISIBLE_DEVICES
    still says GPU 1 was the unit's, so the holder of GPU 1 that no unit owns goes too."""
    m = guard.machine
    unit = "watched-hint.service"
    guard.add_server(unit, workers=1, gpus=(1,), escaper=0, escape_now=True, cuda="GPU-00000000")
    m.write(f"/etc/systemd/system/{unit}.d/cuda.conf",
            "[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-000000000001\n")
    m.systemctl("daemon-reload")
    m.systemctl("start", unit)
    rank = guard.server_pids(unit)["worker0"]
    wait_for("the escaped rank", lambda: any(h["pid"] == rank and h["unit"] == ""
                                            for h in guard.holders()), 10)
    m.systemctl("stop", unit)
    wait_gone(guard, [rank], 20)
    report = wait_for("the watch's report", lambda: guard.reports_for(unit) or None, 10)[0]
    assert report["scope"]["adopted_pids"] == [rank] and report["outcome"] == "freed"


def test_hook_and_watch_share_one_sweep(guard: Installed) -> None:
    unit = "sglang-both-1.service"  # has the sglang- drop-in and matches [Watch] Units
    pids = worker_pids(guard.start_server(unit, workers=1, gpus=(1,)))
    with guard.monitor() as bus:
        guard.machine.systemctl("stop", unit)
        wait_for("the watch to see the stop", lambda: "this stop was already swept" in
                 guard.machine.journal("-u", "gpuguardd.service", "--grep", unit) or None, 10)
    wait_gone(guard, pids, 5)
    reports = guard.reports_for(unit)
    assert len(reports) == 1 and reports[0]["requested_by"] == f"hook:{unit}"
    assert [s.member for s in bus].count("SweepStarted") == 1


def test_restarting_unit_is_not_swept_by_the_watch(guard: Installed) -> None:
    m = guard.machine
    unit = "watched-restart.service"
    pids = guard.start_server(unit, workers=1, gpus=(0,), restart="on-failure")
    m.run(["kill", "-9", str(pids["main"])])  # a crash: systemd restarts the unit
    wait_for("the new instance", lambda: guard.server_pids(unit)["main"] != pids["main"]
             and m.show(unit, "ActiveState") == "active", 20)
    new = worker_pids(guard.server_pids(unit))
    time.sleep(2)  # the watch would have acted by now
    assert guard.reports_for(unit) == []
    assert all(guard.alive(p) for p in new)
    m.systemctl("stop", unit)  # a real stop is swept: new and old leftovers alike
    wait_gone(guard, new + worker_pids(pids), 20)


# -- the daemon as a system service --------------------------------------------------------

def test_polkit_refuses_then_a_rule_allows(guard: Installed) -> None:
    m = guard.machine
    m.run("getent group gpuadmins >/dev/null || groupadd gpuadmins; "
          "id bob >/dev/null 2>&1 || useradd --no-create-home -G gpuadmins bob; "
          "id carol >/dev/null 2>&1 || useradd --no-create-home carol")
    args = ("Sweep", "a{sv}", "1", "gpus", "au", "1", "1")
    # gdbus names the D-Bus error (busctl prints only its message).
    refused = m.run(["gdbus", "call", "--system", "--dest", "org.gpuguard.GpuGuard1",
                     "--object-path", "/org/gpuguard/GpuGuard1",
                     "--method", "org.gpuguard.GpuGuard1.Manager.Sweep", "{'gpus': <[uint32 1]>}"],
                    user="bob", check=False)
    assert refused.returncode != 0
    assert "org.gpuguard.GpuGuard1.Error.NotAuthorized" in refused.stderr, refused.stderr
    # The real polkitd decided: it was bus-activated for the question.
    assert m.show("polkit.service", "ActiveState") == "active"
    m.write("/etc/polkit-1/rules.d/50-gpuguard-e2e.rules", """\
polkit.addRule(function(action, subject) {
    if (action.id == "org.gpuguard.GpuGuard1.sweep" && subject.isInGroup("gpuadmins")) {
        return polkit.Result.YES;
    }
});
""")
    # polkitd notices new rules through inotify; give it a moment.
    allowed = wait_for("polkit to load the rule", lambda: (
        done if (done := guard.call(*args, user="bob", check=False)).returncode == 0 else None),
        15, 0.5)
    assert '"nothing-to-do"' in allowed.stdout
    assert guard.call(*args, user="carol", check=False).returncode != 0  # not in the group
    journal = m.journal("-u", "gpuguardd.service")
    assert "uid" in journal and "bob" in journal


def test_bus_activation_starts_the_daemon(guard: Installed) -> None:
    m = guard.machine
    m.systemctl("stop", "gpuguardd.service")
    assert m.show("gpuguardd.service", "ActiveState") == "inactive"
    guard.history(1)  # the first call starts it
    assert m.show("gpuguardd.service", "ActiveState") == "active"


def test_kill9_restarts_with_history_intact(guard: Installed) -> None:
    ids = [r["id"] for r in guard.history()]
    assert ids, "earlier tests left reports"
    pid = main_pid(guard)
    guard.machine.run(["kill", "-9", str(pid)])
    wait_daemon_up(guard, pid)
    assert [r["id"] for r in guard.history()][:len(ids)] == ids


def test_hung_daemon_is_restarted_by_the_watchdog(guard: Installed) -> None:
    m = guard.machine
    dropin = "/etc/systemd/system/gpuguardd.service.d/zz-watchdog.conf"
    m.write(dropin, "[Service]\nWatchdogSec=2s\nTimeoutAbortSec=2s\n")
    try:
        m.systemctl("daemon-reload")
        m.systemctl("restart", "gpuguardd.service")
        pid = wait_daemon_up(guard)
        m.run(["kill", "-STOP", str(pid)])
        wait_daemon_up(guard, pid, timeout=30)
        assert "Watchdog timeout" in m.journal("-u", "gpuguardd.service")
    finally:
        m.run(["rm", "-f", dropin])
        m.systemctl("daemon-reload")
        m.systemctl("restart", "gpuguardd.service")


def test_reload_applies_config_to_the_watch(guard: Installed) -> None:
    m = guard.machine
    unit = "reloaded-llm.service"
    try:
        guard.configure("watched-* sglang-both-* reloaded-*")
        pid = main_pid(guard)
        m.systemctl("reload", "gpuguardd.service")
        assert main_pid(guard) == pid  # a reload, not a restart
        wait_for("WatchedUnits to change", lambda: "reloaded-*" in guard.busctl(
            *MANAGER_PROPS, "WatchedUnits").stdout or None, 10)
        pids = worker_pids(guard.start_server(unit, workers=1, gpus=(1,)))
        m.systemctl("stop", unit)
        wait_gone(guard, pids, 20)
        assert wait_for("the report", lambda: guard.reports_for(unit) or None, 10)
    finally:
        guard.configure("watched-* sglang-both-*")
        m.systemctl("reload", "gpuguardd.service")


# -- gpuguardctl hook on the real systemd -----------------------------------------------------

def test_hook_install_remove_reloads_systemd(guard: Installed) -> None:
    m = guard.machine
    unit = "qwen-custom.service"
    guard.add_server(unit, workers=1)
    m.systemctl("daemon-reload")
    done = m.run(["gpuguardctl", "hook", "install", "qwen-"])
    assert "daemon-reload: done" in done.stdout
    assert "/etc/systemd/system/qwen-.service.d/gpuguard.conf" in m.show(unit, "DropInPaths")
    listed = m.run(["gpuguardctl", "hook", "list", "qwen-"]).stdout
    assert "qwen-.service" in listed and f"applies to {unit}" in listed
    assert "already installed" in m.run(["gpuguardctl", "hook", "install", "qwen-"]).stdout
    m.run(["gpuguardctl", "hook", "remove", "qwen-"])
    assert "qwen-.service.d" not in m.show(unit, "DropInPaths")


# -- the host ---------------------------------------------------------------------------------

def test_a_machine_leaves_the_host_untouched() -> None:
    """Boot and stop a second machine that writes where a careless harness would hurt."""
    from tests.e2e.conftest import _require
    _require()
    before = host_fingerprint(["/etc/systemd/system"])
    marker = f"gpuguard-e2e-{time.time_ns()}"
    with booted() as machine:
        machine.write(f"/etc/systemd/system/{marker}.service", "[Service]\nExecStart=/bin/true\n")
        machine.write(f"/tmp/{marker}", "x\n")
        machine.systemctl("daemon-reload")
        base, cgroups = machine.base, list(machine.cgroups)
    assert host_fingerprint(["/etc/systemd/system"]) == before
    assert not base.exists() and not (Path("/tmp") / marker).exists()
    assert cgroups and not any(c.exists() for c in cgroups)  # its own cgroups, removed

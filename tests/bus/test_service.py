"""gpuguardd on a real bus: the contract's methods, properties, signals and errors, driven with
busctl, gdbus and gpuguardctl as an admin would, against fake GPUs and real holder processes.

Other processes on the machine (another suite, a benchmark) may hold device nodes with the
same numbers as the shared test nodes. So assertions look for the processes a test started
rather than exact holder counts, and every real (not dry-run) sweep is scoped to a private
GPU whose device node nobody else has: a test can never end a process it did not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.bus import contract
from gpuguardd.daemon.inventory import LIST_MAX_AGE_SEC
from tests import dbusxml
from tests.conftest import GiB, GpuHost
from tests.dbus_harness import (
    BUS_NAME,
    COMM,
    GPU,
    MANAGER,
    MANAGER_PATH,
    PYTHON,
    BusctlError,
    BusDaemon,
    FakePolkit,
    GuardDaemon,
    SignalRecorder,
    leak_on,
    private_gpu,
    private_holder,
    run,
    unwrap_busctl,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]

GPU0 = MANAGER_PATH + "/gpu/0"
GPU1 = MANAGER_PATH + "/gpu/1"
INVALID = "org.gpuguard.GpuGuard1.Error.InvalidArgument"
NOT_AUTHORIZED = "org.gpuguard.GpuGuard1.Error.NotAuthorized"


def compute_holder(host: GpuHost, gpu: int = 0, used: int = 2 * GiB) -> int:
    """A compute process on a shared test GPU: for listing only, never for a real sweep."""
    proc = host.spawn("--hold", host.node(f"nvidia{gpu}"), "--hold", host.node("nvidia-uvm"),
                      "--comm", COMM, nvml=(gpu, used))
    return proc.pid


def listed(guard: GuardDaemon, pid: int, *args: str, as_nobody: bool = False) -> list[Any]:
    """ListHolders (all holders, or `args` as its filter) once `pid` is in it. The daemon may
    answer from a scan that started up to LIST_MAX_AGE_SEC before the holder appeared."""
    def holders() -> list[Any] | None:
        found: list[Any] = guard.manager("ListHolders", "a{sv}", *(args or ("0",)),
                                         as_nobody=as_nobody)[0]
        return found if any(h["pid"] == pid for h in found) else None
    result: list[Any] = wait_until(holders, LIST_MAX_AGE_SEC + 10, f"ListHolders to list {pid}",
                                   interval=0.1)
    return result


def xml_types(dictionary: str) -> dict[str, str]:
    """Key -> D-Bus type of one of the contract's typed dictionaries (the XML's Keys)."""
    return {key: kind.signatures[0] for key, kind in contract.contract().dictionaries[dictionary].items()}


def busctl_types(guard: GuardDaemon, member: str, *args: str) -> dict[str, str]:
    """The D-Bus type of each key of the first a{sv} in a reply, as busctl shows it."""
    result = guard.busctl("call", "--json=short", BUS_NAME, MANAGER_PATH, MANAGER, member, *args)
    assert result.returncode == 0, result.stderr
    data = result.json["data"][0]
    first = data[0] if isinstance(data, list) else data
    return {key: value["type"] for key, value in first.items()}


# -- the contract's shape --------------------------------------------------------------------

def test_introspection_matches_the_contract_xml(guard: GuardDaemon) -> None:
    documents = []
    for path in (MANAGER_PATH, GPU0):
        result = guard.busctl("introspect", "--xml-interface", BUS_NAME, path)
        assert result.returncode == 0, result.stderr
        documents.append(result.stdout)
    running = dbusxml.merge(documents)
    assert dbusxml.canonical(running) == dbusxml.canonical(dbusxml.contract())
    # The manager is also the ObjectManager (cockpit.dbus().proxies(), gdbus introspect).
    assert "org.freedesktop.DBus.ObjectManager" in dbusxml.interfaces(documents[0], include_standard=True)


def test_manager_properties_have_the_contract_types(guard: GuardDaemon) -> None:
    result = guard.busctl("call", "--json=short", BUS_NAME, MANAGER_PATH,
                          "org.freedesktop.DBus.Properties", "GetAll", "s", MANAGER)
    assert result.returncode == 0, result.stderr
    props = result.json["data"][0]
    types = {name: value["type"] for name, value in props.items()}
    assert types == {name: p.signature for name, p in contract.interface(MANAGER).properties.items()}
    assert props["GpuCount"]["data"] == 2
    assert props["NvmlAvailable"]["data"] is True
    assert props["DriverVersion"]["data"] == "550.54.15"
    assert props["Busy"]["data"] is False
    assert props["ConfigFiles"]["data"] == [str(guard.host.config_path)]
    assert props["Vendors"]["data"] == ["nvidia"]


def test_object_manager_lists_one_object_per_gpu(guard: GuardDaemon) -> None:
    result = guard.gdbus("--object-path", MANAGER_PATH,
                         "--method", "org.freedesktop.DBus.ObjectManager.GetManagedObjects")
    assert result.returncode == 0, result.stderr
    assert f"objectpath '{GPU0}'" in result.stdout and f"'{GPU1}': {{'{GPU}'" in result.stdout
    assert "'Uuid': <'GPU-00000000-0000-4000-8000-000000000001'>" in result.stdout
    assert "'MemoryTotal': <uint64 85899345920>" in result.stdout
    assert guard.get_property(GPU1, GPU, "Index") == 1
    assert guard.get_property(GPU1, GPU, "DevicePath") == "/dev/nvidia1"
    assert guard.get_property(GPU1, GPU, "PciBusId") == "00000000:02:00.0"
    assert guard.get_property(GPU1, GPU, "Vendor") == "nvidia"
    assert "'Vendor': <'nvidia'>" in result.stdout
    assert guard.get_property(GPU0, GPU, "State") in ("idle", "in-use")


def test_peer_interface_answers(guard: GuardDaemon) -> None:
    assert guard.busctl_call(MANAGER_PATH, "org.freedesktop.DBus.Peer", "Ping") == []
    machine = guard.gdbus("--object-path", MANAGER_PATH, "--method",
                          "org.freedesktop.DBus.Peer.GetMachineId")
    assert machine.returncode == 0 or "org.freedesktop.DBus.Error.FileNotFound" in machine.stderr
    assert guard.alive() and "Traceback" not in guard.stderr()


def test_list_holders_types_and_filters(guard: GuardDaemon) -> None:
    pid = compute_holder(guard.host, gpu=1)
    holders = listed(guard, pid)
    mine = [h for h in holders if h["pid"] == pid]
    assert len(mine) == 1, holders
    holder = mine[0]
    assert holder["gpus"] == [1] and holder["kind"] == "compute"
    assert holder["gpu_memory"] == 2 * GiB and "nvml" in holder["how"]
    assert guard.host.node("nvidia-uvm") in holder["devices"]
    assert "holder.py" in holder["cmdline"] and holder["user"] == "root"
    result = guard.busctl("call", "--json=short", BUS_NAME, MANAGER_PATH, MANAGER, "ListHolders",
                          "a{sv}", "0")
    raw = next(h for h in result.json["data"][0] if h["pid"]["data"] == pid)
    # Every key the XML lists for a holder, of the XML's type (and no other key).
    assert {k: v["type"] for k, v in raw.items()} == xml_types("Holder")
    on_gpu0 = guard.manager("ListHolders", "a{sv}", "1", "gpus", "au", "1", "0")[0]
    assert pid not in [h["pid"] for h in on_gpu0]
    on_gpu1 = guard.manager("ListHolders", "a{sv}", "1", "gpus", "au", "1", "1")[0]
    assert pid in [h["pid"] for h in on_gpu1]
    in_unit = guard.manager("ListHolders", "a{sv}", "1", "unit", "s", "no-such-unit")[0]
    assert in_unit == []


def fd_holder(host: GpuHost) -> int:
    """A holder NVML does not list (a management client): no poll event announces it."""
    return host.spawn("--hold", host.node("nvidia0"), "--comm", COMM).pid


def test_list_holders_cache_expires(guard: GuardDaemon) -> None:
    guard.manager("ListHolders", "a{sv}", "0")  # a scan the next second's calls may reuse
    pid = fd_holder(guard.host)
    started = time.monotonic()
    # Nothing announces this holder: only the age bound brings it in, and within it.
    listed(guard, pid)
    assert time.monotonic() - started < LIST_MAX_AGE_SEC + 5  # slack for a loaded machine


def test_fresh_list_never_serves_an_older_scan(guard: GuardDaemon) -> None:
    guard.manager("ListHolders", "a{sv}", "0")  # a scan the next second's calls may reuse
    pid = fd_holder(guard.host)
    # What gpuguardctl asks for: no waiting, no cache, the holder is there at once.
    fresh = guard.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true")[0]
    assert pid in [h["pid"] for h in fresh]


def test_a_sweep_makes_the_next_list_rescan(guard: GuardDaemon) -> None:
    guard.manager("ListHolders", "a{sv}", "0")
    pid = fd_holder(guard.host)
    guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")
    # A finished sweep invalidates every scan that started before it: at once, no waiting.
    assert pid in [h["pid"] for h in guard.manager("ListHolders", "a{sv}", "0")[0]]


def test_gpu_properties_follow_holders_and_memory(guard: GuardDaemon, recorder: SignalRecorder) -> None:
    assert guard.get_property(GPU1, GPU, "MemoryUsed") == 0
    pid = compute_holder(guard.host, gpu=1, used=3 * GiB)
    wait_until(lambda: guard.get_property(GPU1, GPU, "MemoryUsed") == 3 * GiB, 10, "MemoryUsed")
    wait_until(lambda: guard.get_property(GPU1, GPU, "State") == "in-use", 10, "State in-use")
    # NVML listed a new process: a holder scan follows (rate-limited by the scan's cost).
    wait_until(lambda: guard.get_property(GPU1, GPU, "HolderCount") >= 1, 10, "HolderCount")
    recorder.wait_for("PropertiesChanged",
                      lambda s: s.path == GPU1 and s.body[1].get("MemoryUsed") == 3 * GiB)
    # PropertiesChanged carries changes only: no signal repeats an unchanged value.
    time.sleep(1.0)
    assert recorder.property_changes(GPU1, "MemoryUsed").count(3 * GiB) == 1
    assert recorder.property_changes(GPU1, "MemoryTotal") == []
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: guard.get_property(GPU1, GPU, "MemoryUsed") == 0, 10, "memory released")


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "needle"), [
    (["Sweep", "{'bogus': <true>}"], "unknown sweep option 'bogus'"),
    (["Sweep", "{'grace_ms': <'soon'>}"], "'grace_ms' must be of type u, got s"),
    (["Sweep", "{'gpus': <@au [7]>, 'dry_run': <true>}"], "GPU index 7 out of range"),
    (["Sweep", "{'unit': <'bad/unit'>, 'dry_run': <true>}"], "invalid unit name"),
    (["Sweep", "{'container': <'not a container'>, 'dry_run': <true>}"], "invalid container"),
    (["Sweep", "{'reason': <'line\\nforged'>, 'dry_run': <true>}"], "control characters"),
    (["Sweep", "{'grace_ms': <uint32 4000000>, 'dry_run': <true>}"], "grace_ms 4000000 out of range"),
    (["SweepUnit", "''", "@a{sv} {}"], "empty unit name"),
    (["SweepUnit", "'x.service'", "{'unit': <'y.service'>}"], "unit given twice"),
    (["ListHolders", "{'gpus': <@au [9]>}"], "GPU index 9 out of range"),
    (["ListHolders", "{'include_protected': <'yes'>}"], "must be of type b"),
])
def test_bad_input_is_invalid_argument(guard: GuardDaemon, args: list[str], needle: str) -> None:
    result = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.{args[0]}", *args[1:])
    assert result.returncode != 0
    assert INVALID in result.stderr and needle in result.stderr, result.stderr
    # Still up and answering.
    assert guard.alive()
    assert guard.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 2


def test_wrong_signature_is_invalid_argument(guard: GuardDaemon) -> None:
    # gdbus and busctl convert arguments from introspection; dbus-send sends what it is told.
    result = run(["dbus-send", f"--bus={guard.address}", "--print-reply", f"--dest={BUS_NAME}",
                  MANAGER_PATH, f"{MANAGER}.GetHistory", "string:ten"])
    assert result.returncode != 0
    assert f"Error {INVALID}: GetHistory takes arguments of type (u), got (s)" in result.stderr
    with pytest.raises(BusctlError, match="unknown filter option"):
        guard.manager("ListHolders", "a{sv}", "1", "gpu", "u", "0")
    assert guard.manager("GetHistory", "u", "1") == [[]]


def test_non_ascii_text_never_cuts_the_daemon_off_the_bus(guard: GuardDaemon) -> None:
    # Process names are chosen by whoever starts the process. Debian 12's dbus-fast cannot
    # marshal non-ASCII strings, and the daemon escapes them there instead of dying.
    pid = private_holder(guard.host, GiB, "--comm", "gpu-caf\u00e9")
    holders = listed(guard, pid)
    assert next(h for h in holders if h["pid"] == pid)["comm"] in ("gpu-caf\u00e9", "gpu-caf\\xe9")
    reason = "nettoyage d'\u00e9t\u00e9"
    report = guard.manager("Sweep", "a{sv}", "2", "dry_run", "b", "true", "reason", "s", reason)[0]
    assert report["reason"] in (reason, "nettoyage d'\\xe9t\\xe9")
    bad = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.SweepUnit",
                      "'\u00fcn\u00eft/x'", "@a{sv} {}")
    assert INVALID in bad.stderr and "invalid unit name" in bad.stderr, bad.stderr
    assert guard.alive()
    assert guard.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 3


# -- sweeps and their signals ----------------------------------------------------------------

def test_sweep_emits_signals_and_returns_a_typed_report(guard: GuardDaemon,
                                                        recorder: SignalRecorder) -> None:
    pid = private_holder(guard.host)
    gpu = str(private_gpu(guard.host))
    report = guard.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "grace_ms", "u", "2000")[0]
    assert report["outcome"] == "freed", report
    assert [t["pid"] for t in report["terminated"]] == [pid]
    assert report["terminated"][0]["signal"] == "SIGTERM"
    assert report["requested_by"].startswith("uid 0 (root) :1.")
    assert report["scope"]["gpus"] == [int(gpu)] and report["scope"]["grace_ms"] == 2000
    entry = next(g for g in report["gpus"] if g["index"] == int(gpu))
    assert entry["memory_used_before"] == 2 * GiB and entry["memory_used_after"] == 0

    started = recorder.wait_for("SweepStarted", lambda s: s.body[0] == report["id"])
    ended = recorder.wait_for("ProcessTerminated", lambda s: s.body[1] == pid)
    finished = recorder.wait_for("SweepFinished", lambda s: s.body[0] == report["id"])
    assert started.at <= ended.at <= finished.at
    assert ended.body == [report["id"], pid, COMM, "", "SIGTERM"]
    assert finished.body[1] == "freed" and finished.body[2]["id"] == report["id"]
    assert started.body[1]["gpus"] == [int(gpu)]
    busy = recorder.property_changes(MANAGER_PATH, "Busy")
    assert busy[:2] == [True, False]
    last = guard.get_property(MANAGER_PATH, MANAGER, "LastSweep")
    assert last["id"] == report["id"] and last["outcome"] == "freed"
    assert recorder.wait_for("PropertiesChanged", lambda s: s.path == MANAGER_PATH
                             and s.body[1].get("LastSweep", {}).get("id") == report["id"])


def test_report_keys_have_the_contract_types(guard: GuardDaemon) -> None:
    types = busctl_types(guard, "Sweep", "a{sv}", "1", "dry_run", "b", "true")
    expected = xml_types("Report")
    assert {"id", "started_usec", "requested_by", "scope", "terminated", "gpus", "outcome"} <= set(types)
    assert {k: types[k] for k in expected if k in types} == {k: v for k, v in expected.items() if k in types}


def test_sweep_unit_records_the_hook(guard: GuardDaemon) -> None:
    report = guard.manager("SweepUnit", "sa{sv}", "gpuguard-test-job", "2",
                           "reason", "s", "hook:gpuguard-test-job.service result=exit-code",
                           "dry_run", "b", "true")[0]
    assert report["requested_by"] == "hook:gpuguard-test-job.service"
    assert report["scope"]["unit"] == "gpuguard-test-job.service"
    assert report["outcome"] == "dry-run" and report["dry_run"] is True
    # Who asked travels as a code, decided by the daemon: in the reply and in the history.
    assert report["requester_kind"] == "hook"
    (stored,) = guard.manager("GetHistory", "u", "1")[0]
    assert stored["id"] == report["id"] and stored["requester_kind"] == "hook"


def test_history_newest_first(guard: GuardDaemon) -> None:
    ids = [guard.manager("Sweep", "a{sv}", "2", "dry_run", "b", "true", "reason", "s", f"r{i}")[0]["id"]
           for i in range(3)]
    reports = guard.manager("GetHistory", "u", "2")[0]
    assert [r["id"] for r in reports] == ids[::-1][:2]
    assert len(guard.manager("GetHistory", "u", "0")[0]) == 3
    assert reports[0]["reason"] == "r2"


def busy_sweep(guard: GuardDaemon) -> tuple[int, str, subprocess.Popen[str]]:
    """A Sweep call, in the background, of a holder that ignores SIGTERM: the daemon stays
    Busy for its 1.5 s grace period. (pid, GPU index, the busctl call)."""
    pid = private_holder(guard.host, 2 * GiB, "--ignore-term")
    gpu = str(private_gpu(guard.host))
    call = subprocess.Popen(
        ["busctl", f"--address={guard.address}", "call", "--json=short", BUS_NAME, MANAGER_PATH,
         MANAGER, "Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "grace_ms", "u", "1500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: guard.get_property(MANAGER_PATH, MANAGER, "Busy"), 10, "Busy")
    return pid, gpu, call


def test_sweeps_of_one_gpu_wait_for_each_other(guard: GuardDaemon) -> None:
    # A holder that ignores SIGTERM keeps the first sweep busy for its grace period.
    pid, gpu, first = busy_sweep(guard)
    second = guard.manager("Sweep", "a{sv}", "1", "gpus", "au", "1", gpu)[0]
    out, _ = first.communicate(timeout=30)
    first_report = json.loads(out)["data"][0]
    assert first_report["terminated"]["data"][0]["signal"]["data"] == "SIGKILL"
    assert first_report["terminated"]["data"][0]["pid"]["data"] == pid
    # The second ran after the first released the GPU: nothing left for it.
    assert second["outcome"] == "nothing-to-do"
    assert second["started_usec"] >= first_report["started_usec"]["data"]


# -- authorization ---------------------------------------------------------------------------

def test_other_user_without_polkit(guard: GuardDaemon) -> None:
    pid = private_holder(guard.host)
    gpu = private_gpu(guard.host)
    dry = guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true", as_nobody=True)[0]
    assert dry["outcome"] == "dry-run"
    assert dry["requested_by"].startswith("uid 65534 (nobody) :1.")
    assert dry["requester_kind"] == "manual"
    assert pid in [t["pid"] for t in dry["targets"]]
    scoped = f"{{'gpus': <@au [{gpu}]>}}"
    for member, args in (("Sweep", [scoped]), ("SweepUnit", ["'x'", scoped]), ("Reload", [])):
        result = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.{member}",
                             *args, as_nobody=True)
        assert NOT_AUTHORIZED in result.stderr, (member, result.stderr)
    assert os.path.exists(f"/proc/{pid}"), "a refused sweep must not touch anything"
    # The dry run above finished after the holder started: no scan older than it is served.
    holders = guard.manager("ListHolders", "a{sv}", "0", as_nobody=True)[0]
    mine = next(h for h in holders if h["pid"] == pid)
    assert mine["cmdline"] == "" and mine["comm"] == COMM
    # Another user's dry run is answered but not kept in the audit history.
    assert dry["id"] not in [r["id"] for r in guard.manager("GetHistory", "u", "5", as_nobody=True)[0]]
    ctl = guard.ctl("sweep", "--gpu", str(gpu), as_nobody=True)
    assert ctl.returncode == 5, ctl.stderr
    assert "not authorized" in ctl.stderr


def test_polkit_decides_for_other_users(guard: GuardDaemon, system_bus: BusDaemon, tmp_path: Path) -> None:
    polkit = FakePolkit(system_bus.address, tmp_path, {65534: ["org.gpuguard.GpuGuard1.sweep",
                                                               "org.gpuguard.GpuGuard1.view-details"]})
    try:
        pid = private_holder(guard.host)
        gpu = str(private_gpu(guard.host))
        holders = listed(guard, pid, as_nobody=True)
        assert "holder.py" in next(h for h in holders if h["pid"] == pid)["cmdline"]
        report = guard.manager("Sweep", "a{sv}", "1", "gpus", "au", "1", gpu, as_nobody=True)[0]
        assert [t["pid"] for t in report["terminated"]] == [pid]
        denied = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.Reload",
                             as_nobody=True)
        assert NOT_AUTHORIZED in denied.stderr
        interactive = guard.gdbus("--interactive", "--object-path", MANAGER_PATH, "--method",
                                  f"{MANAGER}.Reload", as_nobody=True)
        assert NOT_AUTHORIZED in interactive.stderr
        requests = polkit.requests()
        assert {r["action"] for r in requests} == {"org.gpuguard.GpuGuard1.view-details",
                                                  "org.gpuguard.GpuGuard1.sweep",
                                                  "org.gpuguard.GpuGuard1.reload"}
        assert all(r["kind"] == "system-bus-name" and r["name"].startswith(":1.")
                   and r["uid"] == 65534 for r in requests)
        reloads = [r for r in requests if r["action"].endswith(".reload")]
        # gdbus asks for interactive authorization only with --interactive.
        assert [r["flags"] for r in reloads] == [0, 1]
        # root is never sent to polkit.
        guard.manager("Reload")
        assert len(polkit.requests()) == len(requests)
    finally:
        polkit.close()


# -- lifecycle -------------------------------------------------------------------------------

def test_second_daemon_exits_while_the_name_is_taken(guard: GuardDaemon) -> None:
    env = dict(guard.env)
    second = subprocess.run(
        [PYTHON, "-m", "gpuguardd.daemon.main", "--bus-address", guard.address, "--config",
         str(guard.host.config_path)], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert second.returncode == 1
    assert "org.gpuguard.GpuGuard1 is already owned by :1." in second.stderr
    assert "another gpuguardd is running" in second.stderr
    assert "Traceback" not in second.stderr
    assert guard.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 2


def test_sd_notify_ready_status_watchdog_stopping(daemon: GuardDaemon) -> None:
    daemon.host.write_config()
    daemon.start(env={"WATCHDOG_USEC": "200000"})
    assert daemon.notify is not None
    # READY=1 only once the name is owned.
    owner = daemon.busctl("status", BUS_NAME)
    assert owner.returncode == 0, owner.stderr
    lines = daemon.notify.lines()
    assert lines.index("READY=1") >= 0
    status = next(line for line in lines if line.startswith("STATUS="))
    assert "2 GPU(s)" in status and "holder(s)" in status
    notify = daemon.notify
    wait_until(lambda: notify.lines().count("WATCHDOG=1") >= 3, 5, "three watchdog pings")
    daemon.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")
    wait_until(lambda: any("last sweep" in line for line in notify.lines()), 5,
               "STATUS naming the last sweep")
    assert daemon.stop(signal.SIGINT) == 0
    assert "STOPPING=1" in notify.lines()


def test_unread_notify_socket_never_blocks_the_daemon(guard: GuardDaemon) -> None:
    assert guard.notify is not None
    guard.notify.pause()
    # Each sweep changes STATUS= twice; the socket queue holds ~10 datagrams.
    for n in range(30):
        guard.manager("Sweep", "a{sv}", "2", "dry_run", "b", "true", "reason", "s", f"n{n}", timeout=10)
    assert len(guard.manager("GetHistory", "u", "0")[0]) == 30


def test_sighup_and_reload_keep_the_last_good_configuration(guard: GuardDaemon,
                                                             recorder: SignalRecorder) -> None:
    host = guard.host
    assert guard.proc is not None
    host.write_config("PollIntervalSec=0.25\n[Watch]\nUnits=train-*.service\n")
    guard.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: guard.get_property(MANAGER_PATH, MANAGER, "WatchedUnits") == ["train-*.service"],
               10, "WatchedUnits after SIGHUP")
    assert recorder.wait_for("PropertiesChanged", lambda s: s.path == MANAGER_PATH
                             and s.body[1].get("WatchedUnits") == ["train-*.service"])

    good = host.config_path.read_text()
    host.config_path.write_text(good + "[Sweep]\nGraceSex=3\n")
    bad_line = len(good.splitlines()) + 2
    guard.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "configuration not reloaded" in guard.stderr(), 10, "the reload error")
    assert f"{host.config_path}:{bad_line}: [Sweep] GraceSex: unknown key" in guard.stderr()
    result = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.Reload")
    assert INVALID in result.stderr and f"{host.config_path}:{bad_line}" in result.stderr
    assert guard.get_property(MANAGER_PATH, MANAGER, "WatchedUnits") == ["train-*.service"]

    host.config_path.write_text(good.replace("train-*", "infer-*"))
    assert guard.manager("Reload") == []
    assert guard.get_property(MANAGER_PATH, MANAGER, "WatchedUnits") == ["infer-*.service"]


def test_a_broken_reload_during_a_sweep_leaves_it_and_the_daemon_alone(guard: GuardDaemon) -> None:
    """The configuration made invalid, then Reload and SIGHUP while a sweep is
    in its grace period. Reload fails at once with the file and line, the sweep finishes with
    the settings it started with and is recorded, and the daemon keeps serving."""
    host = guard.host
    assert guard.proc is not None
    good = host.config_path.read_text()  # GraceSec=2 (tests/conftest.py)
    pid = private_holder(host, 2 * GiB, "--ignore-term")
    gpu = str(private_gpu(host))
    sweep = subprocess.Popen(
        ["busctl", f"--address={guard.address}", "call", "--json=short", BUS_NAME, MANAGER_PATH,
         MANAGER, "Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "reason", "s", "during reload"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: f"sent SIGTERM to pid {pid}" in guard.stderr(), 20, "the SIGTERM")
        host.config_path.write_text(good.replace("GraceSec=2", "GraceSec=30")
                                    + "[Sweep]\nKillTimeout=1\n")
        bad_line = len(good.splitlines()) + 2
        result = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.Reload")
        assert INVALID in result.stderr, result.stderr
        assert f"{host.config_path}:{bad_line}: [Sweep] KillTimeout: unknown key" in result.stderr
        guard.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: guard.stderr().count("configuration not reloaded") >= 2, 10,
                   "the SIGHUP's reload error")
        # Both answered while the sweep was still in its grace period, and it still is.
        assert guard.get_property(MANAGER_PATH, MANAGER, "Busy") is True
        assert isinstance(guard.manager("ListHolders", "a{sv}", "0")[0], list)
        out, err = sweep.communicate(timeout=30)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.communicate()
    assert sweep.returncode == 0, err
    report = unwrap_busctl(json.loads(out)["data"][0])
    assert report["outcome"] == "freed", report
    assert [(t["pid"], t["signal"]) for t in report["terminated"]] == [(pid, "SIGKILL")]
    assert report["scope"]["grace_ms"] == 2000 and report["duration_ms"] < 15_000
    assert guard.manager("GetHistory", "u", "1")[0][0]["id"] == report["id"]
    # Still serving, still on the last good configuration; a good file is taken again.
    dry = guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")[0]
    assert dry["scope"]["grace_ms"] == 2000
    host.config_path.write_text(good.replace("GraceSec=2", "GraceSec=1"))
    assert guard.manager("Reload") == []
    assert guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")[0]["scope"]["grace_ms"] == 1000


def test_sigterm_waits_for_the_running_sweep(guard: GuardDaemon) -> None:
    pid, _, sweep = busy_sweep(guard)
    assert guard.stop(signal.SIGTERM) == 0
    out, err = sweep.communicate(timeout=30)
    assert sweep.returncode == 0, err
    report = json.loads(out)["data"][0]
    assert report["outcome"]["data"] == "freed"
    assert report["terminated"]["data"][0]["pid"]["data"] == pid
    assert "waiting for 1 running sweep(s) to finish" in guard.logs[-1]
    guard.start()
    assert guard.manager("GetHistory", "u", "1")[0][0]["id"] == report["id"]["data"]


def test_sigterm_exits_zero_and_releases_the_name(guard: GuardDaemon) -> None:
    assert guard.stop(signal.SIGTERM) == 0
    assert "stopping" in guard.stderr()
    gone = guard.busctl("status", BUS_NAME)
    assert gone.returncode != 0


def test_idle_daemon_uses_no_measurable_cpu(daemon: GuardDaemon) -> None:
    daemon.host.write_config()  # PollIntervalSec=2 (the default)
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    time.sleep(1.0)  # startup work done

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before = cpu()
    time.sleep(4.0)
    used = cpu() - before
    # A poll every 2 s costs milliseconds; what is charged for each wake-up from idle varies by
    # machine (bench/README.md: ~1 ms here). The bound catches a loop that spins or polls fast
    # when nothing waits (a busy loop takes ~4 s), not the machine's accounting.
    assert used < 0.2, f"idle gpuguardd used {used:.2f} s of CPU in 4 s"


# -- GPUs coming and going -------------------------------------------------------------------

def test_gpus_appear_and_disappear_with_object_manager_signals(guard: GuardDaemon,
                                                                recorder: SignalRecorder) -> None:
    host = guard.host
    host.state.fail = {"nvmlSystemGetDriverVersion": 999}  # NVML_ERROR_UNKNOWN: NVML stops answering
    host.publish()
    removed = recorder.wait_for("InterfacesRemoved", lambda s: s.body[0] == GPU1)
    assert removed.path == MANAGER_PATH and removed.body[1] == [GPU]
    wait_until(lambda: guard.get_property(MANAGER_PATH, MANAGER, "NvmlAvailable") is False, 10,
               "NvmlAvailable false")
    assert guard.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 0
    assert guard.get_property(MANAGER_PATH, MANAGER, "NvmlError") != ""
    assert guard.get_property(MANAGER_PATH, MANAGER, "Vendors") == []

    host.state.fail = {}
    host.state.add_gpu(memory_total=40 * GiB)
    host.publish()
    added = recorder.wait_for("InterfacesAdded", lambda s: s.body[0] == MANAGER_PATH + "/gpu/2")
    assert added.path == MANAGER_PATH
    assert added.body[1][GPU]["MemoryTotal"] == 40 * GiB and added.body[1][GPU]["Index"] == 2
    wait_until(lambda: guard.get_property(MANAGER_PATH, MANAGER, "GpuCount") == 3, 10, "3 GPUs")
    assert guard.get_property(MANAGER_PATH, MANAGER, "Vendors") == ["nvidia"]
    listed = guard.busctl("tree", "--list", BUS_NAME).stdout.split()
    assert MANAGER_PATH + "/gpu/2" in listed

    host.state.gpus[1].lost = True
    host.publish()
    wait_until(lambda: guard.get_property(GPU1, GPU, "State") == "lost", 10, "State lost")
    assert "NVML" in guard.get_property(GPU1, GPU, "Error")


def test_leak_suspected_when_memory_stays_without_holder(guard: GuardDaemon,
                                                         recorder: SignalRecorder) -> None:
    host = guard.host
    gpu = private_gpu(host)
    leak_on(guard, recorder, gpu, 5 * GiB)
    time.sleep(1.0)
    assert len([s for s in recorder.of("LeakSuspected") if s.body[0] == gpu]) == 1, "once per leak"
    # A sweep that finds the memory still used reports the leak too.
    report = guard.manager("Sweep", "a{sv}", "1", "gpus", "au", "1", str(gpu))[0]
    assert report["outcome"] == "memory-not-released" and report["leaks"][0]["bytes"] == 5 * GiB
    wait_until(lambda: len([s for s in recorder.of("LeakSuspected") if s.body[0] == gpu]) == 2, 5,
               "LeakSuspected from the sweep")


# -- gpuguardctl over D-Bus ------------------------------------------------------------------

def test_gpuguardctl_talks_to_the_daemon(guard: GuardDaemon) -> None:
    pid = compute_holder(guard.host, gpu=1)
    status = guard.ctl("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["mode"] == "daemon" and json.loads(status.stdout)["gpu_count"] == 2
    gpus = json.loads(guard.ctl("gpus", "--json").stdout)
    assert [g["uuid"] for g in gpus] == ["GPU-00000000-0000-4000-8000-000000000000",
                                         "GPU-00000000-0000-4000-8000-000000000001"]
    assert [g["vendor"] for g in gpus] == ["nvidia", "nvidia"]
    assert json.loads(status.stdout)["vendors"] == ["nvidia"]
    shown = guard.ctl("gpus").stdout.splitlines()
    assert shown[0].split()[:3] == ["GPU", "VENDOR", "NAME"] and shown[1].split()[1] == "nvidia"
    listed(guard, pid)  # in the daemon's view: gpuguardctl may not get an older scan now
    on_gpu = guard.ctl("holders", "--json", "--gpu", "GPU-00000000-0000-4000-8000-000000000001")
    assert pid in [h["pid"] for h in json.loads(on_gpu.stdout)], (on_gpu.stderr, guard.stderr())
    dry = guard.ctl("sweep", "--dry-run", "--gpu", "1", "--json")
    assert dry.returncode == 0 and json.loads(dry.stdout)["outcome"] == "dry-run"
    bad = guard.ctl("sweep", "--gpu", "7")
    assert bad.returncode == 2 and "GPU index 7 out of range" in bad.stderr
    history = json.loads(guard.ctl("history", "--json", "-n", "1").stdout)
    assert history[0]["id"] == json.loads(dry.stdout)["id"]
    mine = private_holder(guard.host)
    real = guard.ctl("sweep", "--gpu", str(private_gpu(guard.host)), "--grace", "2")
    assert real.returncode == 0, real.stdout + real.stderr
    assert f"terminated  {mine:>7}  {COMM}" in real.stdout
    assert "Outcome: freed" in real.stdout


def test_gpuguardctl_watch_prints_signals(guard: GuardDaemon) -> None:
    watch = subprocess.Popen([PYTHON, "-m", "gpuguardd.cli.main", "watch", "--json"],
                             env=guard.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # subscribed
        report = guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true")[0]
        assert watch.stdout is not None
        lines = [json.loads(watch.stdout.readline()) for _ in range(2)]
    finally:
        watch.send_signal(signal.SIGINT)
        watch.wait(timeout=10)
    assert [line["signal"] for line in lines] == ["SweepStarted", "SweepFinished"]
    assert lines[0]["id"] == report["id"] and lines[1]["outcome"] == "dry-run"
    assert watch.returncode == 0


def test_gpuguardctl_without_daemon(system_bus: BusDaemon, gpu_host: GpuHost) -> None:
    env = dict(gpu_host.env)
    env["GPUGUARD_BUS_ADDRESS"] = system_bus.address
    status = subprocess.run([PYTHON, "-m", "gpuguardd.cli.main", "status"], env=env,
                            capture_output=True, text=True, timeout=30, check=False)
    assert status.returncode == 1 and "no gpuguardd answers" in status.stderr

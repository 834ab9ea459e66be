"""Bytes that are not UTF-8 in what a process shows in /proc (argv, executable path) never
break a reply, a signal, a property or the history, for anyone, across restarts.

D-Bus strings must be valid UTF-8. The holder here is started by the test with a \\xff in its
argv and runs from a directory named b"bin-\\xff\\xfe"; everything the daemon sends about it
must carry those bytes as backslash escapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuguardd.daemon.history import FILE_NAME
from tests.bus.adversarial.hostile_holder import odd_interpreter, spawn
from tests.dbus_harness import (
    MANAGER,
    MANAGER_PATH,
    GuardDaemon,
    SignalRecorder,
    private_gpu,
    wait_until,
)

pytest_plugins = ["tests.dbus_harness"]

BAD_ARG = b"--token=caf\xff\xfe-\xc3(-end"


def holders_with(guard: GuardDaemon, pid: int, as_nobody: bool = False) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        found = guard.manager("ListHolders", "a{sv}", "1", "fresh", "b", "true",
                              as_nobody=as_nobody)[0]
        return next((h for h in found if h["pid"] == pid), None)
    holder: dict[str, Any] = wait_until(find, 15, f"ListHolders to list {pid}", interval=0.1)
    return holder


def everything_answers(guard: GuardDaemon) -> list[dict[str, Any]]:
    """GetHistory, gpuguardctl history and status, Properties.GetAll: all succeed."""
    reports: list[dict[str, Any]] = guard.manager("GetHistory", "u", "0")[0]
    for as_nobody in (False, True):
        history = guard.ctl("history", "--json", as_nobody=as_nobody)
        assert history.returncode == 0, history.stderr
        status = guard.ctl("status", as_nobody=as_nobody)
        assert status.returncode == 0, status.stderr
    props = guard.busctl("call", "--json=short", "org.gpuguard.GpuGuard1", MANAGER_PATH,
                         "org.freedesktop.DBus.Properties", "GetAll", "s", MANAGER)
    assert props.returncode == 0, props.stderr
    return reports


def test_bad_bytes_in_argv_and_exe_never_break_replies(guard: GuardDaemon, tmp_path: Path,
                                                       recorder: SignalRecorder) -> None:
    exe = odd_interpreter(tmp_path)
    proc = spawn(guard.host, [BAD_ARG], exe=exe)
    holder = holders_with(guard, proc.pid)
    assert "--token=caf\\xff\\xfe-\\xc3(-end" in holder["cmdline"]
    assert "bin-\\xff\\xfe/python3" in holder["exe"]
    # Another user's call (cmdline redacted, everything else sent) works as well.
    assert holders_with(guard, proc.pid, as_nobody=True)["exe"] == holder["exe"]

    # A dry run by nobody records the holder's text; every reader keeps working, also after
    # a restart (the history is read back from disk).
    dry = guard.manager("Sweep", "a{sv}", "1", "dry_run", "b", "true", as_nobody=True)[0]
    assert any(t["pid"] == proc.pid for t in dry["targets"])
    everything_answers(guard)

    # A real sweep by root ends it, answers with the report and announces it.
    gpu = str(private_gpu(guard.host))
    report = guard.manager("Sweep", "a{sv}", "2", "gpus", "au", "1", gpu, "grace_ms", "u", "2000")[0]
    assert report["outcome"] == "freed", report
    assert [t["pid"] for t in report["terminated"]] == [proc.pid]
    target = next(t for t in report["targets"] if t["pid"] == proc.pid)
    assert "bin-\\xff\\xfe/python3" in target["exe"]
    recorder.wait_for("SweepFinished", lambda s: s.body[0] == report["id"])
    assert not proc.alive() or wait_until(lambda: not proc.alive(), 5, "holder to exit")

    guard.stop()
    guard.start()
    reports = everything_answers(guard)
    assert report["id"] in [r["id"] for r in reports]
    assert guard.alive()


def test_history_records_with_bad_text_are_repaired_on_load(daemon: GuardDaemon) -> None:
    """What an older gpuguard wrote (lone surrogates as JSON escapes, or raw bytes) loads,
    is served, and the file is rewritten clean."""
    state = Path(str(daemon.host.root)) / "state"
    state.mkdir(exist_ok=True)
    escaped = ('{"id": "%s", "outcome": "dry-run", "requested_by": "uid 65534 (nobody)", '
               '"targets": [{"pid": 7, "exe": "/tmp/bin-\\udcff/x", "comm": "a\\u0000b"}]}')
    raw = b'{"id": "%s", "outcome": "freed", "requested_by": "root", "reason": "r\xff"}'
    (state / FILE_NAME).write_bytes(
        (escaped % ("a" * 32)).encode() + b"\n" + raw % (b"b" * 32) + b"\n")
    daemon.host.write_config()
    daemon.start()
    reports = everything_answers(daemon)
    by_id = {r["id"]: r for r in reports}
    assert by_id["a" * 32]["targets"][0]["exe"] == "/tmp/bin-\\xff/x"
    assert by_id["a" * 32]["targets"][0]["comm"] == "a\\x00b"
    assert by_id["b" * 32]["reason"] == "r\\xff"
    lines = (state / FILE_NAME).read_bytes().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert b"\\udc" not in line and line.isascii() and b"\\u0000" not in line
        json.loads(line)



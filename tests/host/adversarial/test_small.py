"""The smaller items of the configuration's hardening:
* `--gpu 99` with no such GPU and no NVML exited 0 ("taken to be /dev/nvidia99"): a usage error
  now unless a configured node names it; `gpus --local` without NVML lists the nodes' GPUs;
* PID 2 was always taken for kthreadd, which in a PID namespace it is not;
* a holder that exits on its own timer during a sweep was recorded as ended by SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.config import load_config
from gpuguardd.engine.engine import Engine
from gpuguardd.records.models import SweepRequest
from tests.conftest import ROOT, GiB, GpuHost, Proc

# Holds the nodes given, optionally ignores SIGTERM, and exits with status 7 when its "timer"
# goes off: a line on stdin, which the test sends once the sweep has sent SIGTERM, so the exit
# falls inside the grace period however slow the machine is, and owes nothing to the signal.
TIMED_HOLDER = """
import os, signal, sys
fds = [os.open(path, os.O_PATH) for path in sys.argv[2:]]
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
sys.exit(7)
"""


def no_driver(host: GpuHost) -> None:
    host.state.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED, as on a host whose driver is gone
    host.publish()


def test_an_unknown_gpu_without_nvml_is_a_usage_error(gpu_host: GpuHost) -> None:
    host = gpu_host
    no_driver(host)
    holder = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    for verb in ("sweep", "holders"):
        result = host.cli(verb, "--gpu", "99", "--json")
        assert result.returncode == 2, (verb, result.stdout, result.stderr)
        assert "no GPU 99" in result.stderr and "Driver Not Loaded" in result.stderr
        assert "GPUs of the nodes: 0, 1" in result.stderr
    assert holder.alive()
    # A GPU a configured node names is still taken, and the report says from which node.
    result = host.cli("sweep", "--gpu", "1", "--json")
    report = json.loads(result.stdout)
    assert [t["pid"] for t in report["terminated"]] == [holder.pid], report
    assert f"NVML unavailable: GPU 1 taken to be {host.node('nvidia1')}" in report["warnings"]


def test_gpus_local_without_nvml_lists_the_gpus_of_the_nodes(gpu_host: GpuHost) -> None:
    host = gpu_host
    no_driver(host)
    holder = host.spawn("--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"))
    result = host.cli("gpus", "--json")
    assert result.returncode == 0, result.stderr
    gpus = {g["index"]: g for g in json.loads(result.stdout)}
    assert sorted(gpus) == [0, 1]
    assert gpus[0]["device_path"] == host.node("nvidia0") and gpus[0]["state"] == "unknown"
    assert gpus[1]["holder_count"] == 1 and gpus[1]["state"] == "in-use"
    assert gpus[1]["memory_total"] == 0 and "Driver Not Loaded" in gpus[1]["error"]
    text = host.cli("gpus").stdout
    assert text.count("unknown") >= 3, text  # memory of both, state of GPU 0
    assert holder.alive()


PID2_PROBE = """
import json, subprocess
from gpuguardd.engine import procfs
from gpuguardd.config import Config, load_config
from gpuguardd.records.models import Holder
from gpuguardd.engine.protection import protection
child = subprocess.Popen(["sleep", "30"])
stat = procfs.read_stat(child.pid)
found = protection(Holder(pid=child.pid, exe="/usr/bin/sleep", state="S"), Config(), [1])
reason = found and found[1]
child.kill()
child.wait()
print(json.dumps({"pid": child.pid, "kthread": stat.is_kernel_thread, "reason": reason}))
"""


def test_pid_2_in_a_pid_namespace_is_an_ordinary_process() -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is required: make deps installs it")
    result = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID2_PROBE],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["pid"] == 2 and seen["kthread"] is False
    assert seen["reason"] is None, seen  # `sleep`, not kthreadd: nothing protects it


def timed_holder(host: GpuHost, mode: str, reap: bool, namespace_init: bool = False) -> Proc:
    """`namespace_init`: the holder is PID 1 of a PID namespace of its own (unshare --fork
    then reaps it), where a signal it has no handler for, sent from outside, is dropped."""
    prefix = ["unshare", "--pid", "--fork"] if namespace_init else []
    popen = subprocess.Popen([*prefix, sys.executable, "-c", TIMED_HOLDER, mode, host.node("nvidia0"),
                              host.node("nvidia-uvm")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert popen.stdout is not None
    line = popen.stdout.readline().split()
    assert line and line[0] == "ready"
    pid = int(line[1])
    if namespace_init:
        assert pid == 1
        pid = int(Path(f"/proc/{popen.pid}/task/{popen.pid}/children").read_text().split()[0])
    proc = Proc(popen, pid)
    host.procs.append(proc)
    if reap:
        threading.Thread(target=popen.wait, daemon=True).start()
    return proc


class TimerAfterSigterm(logging.Handler):
    """Sets off the holder's timer once the sweep logs that it sent SIGTERM."""

    def __init__(self, proc: Proc) -> None:
        super().__init__()
        self.proc = proc

    def emit(self, record: logging.LogRecord) -> None:
        if f"sent SIGTERM to pid {self.proc.pid} " in record.getMessage():
            assert self.proc.popen.stdin is not None
            self.proc.popen.stdin.write("time is up\n")
            self.proc.popen.stdin.flush()


def terminated(host: GpuHost, timed: Proc | None = None) -> dict[str, Any]:
    """Sweep GPU 0 in this process with a long grace; `timed`'s timer goes off after SIGTERM."""
    config = dataclasses.replace(load_config([str(host.config_path)]), grace_sec=20, verify_timeout_sec=2)
    engine = Engine(config)
    sweep_log = logging.getLogger("gpuguard.sweep")
    handler = TimerAfterSigterm(timed) if timed is not None else None
    level = sweep_log.level
    if handler is not None:
        sweep_log.addHandler(handler)
        sweep_log.setLevel(logging.INFO)  # the "sent SIGTERM" line is INFO
    try:
        report = engine.sweep(SweepRequest(gpus=["0"])).to_dict()
    finally:
        if handler is not None:
            sweep_log.removeHandler(handler)
            sweep_log.setLevel(level)
    assert len(report["terminated"]) == 1 and not report["survived"], report
    return dict(report["terminated"][0])


def test_a_holder_that_ignores_sigterm_and_exits_on_its_timer_was_not_ended_by_it(
        inproc_nvml: GpuHost) -> None:
    """Reaped at once by its parent: the kernel has forgotten how it ended. What is known is
    that SIGTERM could not end it, so the report does not say it did."""
    host = inproc_nvml
    proc = timed_holder(host, "ignore", reap=True)
    host.state.add_proc(0, proc.pid, GiB)
    host.publish()
    entry = terminated(host, timed=proc)
    assert entry["pid"] == proc.pid
    assert entry["signal"] == "", entry
    assert entry["exited_after_ms"] < 19000  # on its timer, inside the grace
    assert entry.get("exit_status") in (None, "exited with status 7")  # if not reaped yet


def test_the_kernel_exit_status_is_recorded_while_it_has_it(inproc_nvml: GpuHost) -> None:
    host = inproc_nvml
    on_its_own = timed_holder(host, "ignore", reap=False)
    entry = terminated(host, timed=on_its_own)
    assert (entry["signal"], entry.get("exit_status")) == ("", "exited with status 7"), entry
    on_its_own.popen.wait()
    # The control: one that SIGTERM really ends is recorded as such.
    by_sigterm = timed_holder(host, "default", reap=False)
    entry = terminated(host)
    assert entry["pid"] == by_sigterm.pid
    assert (entry["signal"], entry.get("exit_status")) == ("SIGTERM", "killed by SIGTERM"), entry
    by_sigterm.popen.wait()


def test_a_namespace_init_that_sigterm_cannot_reach_exits_on_its_own(inproc_nvml: GpuHost) -> None:
    """A container's init without a SIGTERM handler never receives ours (the kernel drops it):
    when it exits on its own during the grace, SIGTERM is not credited."""
    host = inproc_nvml
    proc = timed_holder(host, "default", reap=False, namespace_init=True)
    entry = terminated(host, timed=proc)
    assert entry["pid"] == proc.pid
    assert entry["signal"] == "", entry
    assert entry.get("exit_status") in (None, "exited with status 7")

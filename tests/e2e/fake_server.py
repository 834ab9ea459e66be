"""A fake LLM inference server for the end-to-end tests and the demo (run by systemd, inside
the throwaway container; never imported).

Like SGLang or vLLM with tensor parallelism it is a launcher with one worker per rank. Each
worker holds the GPU the way CUDA does (fds on /dev/nvidiaN, /dev/nvidiactl, /dev/nvidia-uvm)
and is listed with its memory by the fake NVML, as the driver would list it. Workers can be
made awkward in the ways real leftovers are:

* --stubborn=I: worker I ignores SIGTERM (a rank stuck in NCCL teardown); only SIGKILL ends it.
* --escaper=I: on SIGUSR1 worker I moves itself out of the unit's cgroup into one that no unit
  owns, as a process re-parented by a launcher script or a debugger would; with --escape-now
  it does so before it opens the GPU, so nothing ever sees it inside the unit.

The launcher writes "main=PID workerN=PID" to /run/fake-server/<name>.pids (container PIDs) and
tells systemd READY=1 once every worker holds its GPU and is listed in NVML.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import signal
import socket
import sys
import time

STATE = os.environ.get("FAKE_NVML_STATE", "/run/fake-nvml/state")
CGROUP_ROOTS = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")
ESCAPE_CGROUP = "gpuguard-escaped"  # not a unit name: attributes to no unit
MiB = 1024 * 1024


def set_comm(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def open_node(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except OSError:
        # Nodes with no driver behind them (major 120) open only O_PATH; /proc/<pid>/fd looks
        # the same to a scanner.
        return os.open(path, os.O_PATH)


def escape_cgroup() -> None:
    """Leave the unit: into a cgroup of our own in every hierarchy that is writable."""
    for root in CGROUP_ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        target = os.path.join(root, ESCAPE_CGROUP)
        try:
            os.makedirs(target, exist_ok=True)
            with open(os.path.join(target, "cgroup.procs"), "w") as handle:
                handle.write("0")
        except OSError as exc:
            sys.stderr.write(f"escape into {target}: {exc}\n")


def worker(index: int, gpu: int, stubborn: bool, escaper: bool, escape_now: bool, name: str,
           ready: int) -> None:
    set_comm(f"{name.partition('-')[0][:8]}-tp{index}")
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if escaper and escape_now:
        escape_cgroup()
    elif escaper:
        signal.signal(signal.SIGUSR1, lambda *_: escape_cgroup())
    fds = [open_node(f"/dev/nvidia{gpu}"), open_node("/dev/nvidiactl"),
           open_node("/dev/nvidia-uvm")]
    os.write(ready, b"x")
    os.close(ready)
    while fds:
        time.sleep(3600)


def register(entries: list[tuple[int, int, int]], release: str = "") -> None:
    """Add (gpu, pid, bytes) to the fake NVML's state, as the driver lists CUDA contexts.

    Read-modify-replace under a lock: several servers may start at once.
    """
    with open(STATE + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(STATE) as handle:
            text = handle.read()
        text += "".join(f"proc {gpu} {pid} {used} compute release_delay_ms=200{release}\n"
                        for gpu, pid, used in entries)
        tmp = f"{STATE}.{os.getpid()}"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, STATE)


def notify(text: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(text.encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--gpu", type=int, action="append", default=[])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024, help="GPU memory per worker")
    parser.add_argument("--stubborn", type=int, action="append", default=[])
    parser.add_argument("--escaper", type=int, default=-1)
    parser.add_argument("--escape-now", action="store_true")
    # The driver's unkind release (tests/fakenvml): memory back over this long after the exit,
    # then this much in use again for --wobble-ms before it settles.
    parser.add_argument("--release-ms", type=int, default=0)
    parser.add_argument("--wobble-mib", type=int, default=0)
    parser.add_argument("--wobble-ms", type=int, default=0)
    args = parser.parse_args()
    gpus = args.gpu or [0]
    set_comm(f"{args.name.partition('-')[0][:8]}-main")
    pids: dict[str, int] = {"main": os.getpid()}
    entries: list[tuple[int, int, int]] = []
    for index in range(args.workers):
        gpu = gpus[index % len(gpus)]
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                worker(index, gpu, index in args.stubborn, index == args.escaper, args.escape_now,
                       args.name, write_end)
            finally:
                os._exit(0)
        os.close(write_end)
        os.read(read_end, 1)  # the worker holds its nodes now
        os.close(read_end)
        pids[f"worker{index}"] = pid
        entries.append((gpu, pid, args.mib * MiB))
    release = "".join(f" {key}={value}" for key, value in (
        ("release_ms", args.release_ms), ("wobble", args.wobble_mib * MiB),
        ("wobble_ms", args.wobble_ms)) if value)
    register(entries, release)
    os.makedirs("/run/fake-server", exist_ok=True)
    with open(f"/run/fake-server/{args.name}.pids", "w") as handle:
        handle.write(" ".join(f"{k}={v}" for k, v in pids.items()) + "\n")
    notify("READY=1\nSTATUS=serving")
    # Reap nothing on purpose: when systemd stops us (KillMode=process: only this process
    # gets SIGTERM) the workers are re-parented and left behind, as real ranks are.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # A worker that dies while we run must not linger as a zombie: NVML would still list it.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()

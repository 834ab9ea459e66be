"""A Slurm job for the e2e tests (run by slurmd inside the throwaway container; never
imported by the suite). Its worker holds the job's GPUs as CUDA does and is listed by the
fake NVML (tests/e2e/fake_server.py's helpers):

* escape: the worker double-forks out of the job's process tree (a launcher's daemonised
  rank, what SGLang's DP workers do), then the job ends. It is still in the job's cgroup,
  where proctrack/cgroup finds and ends it; only leaving the cgroup takes it out of Slurm's
  sight (the test moves it, as a root launcher or container runtime would).
* stay: the worker is the job's own process and runs until the job is cancelled.
* neighbour N: as stay, for a job without gres, on GPU N (another job's): it holds the GPU's
  node and is not on NVML's lists. gpuguardd runs in the machine's own PID namespace, where
  NVML's pids name nobody it can see, so a listed neighbour would leave the other job's sweep
  `unverified` (tests/host/test_nvml_pids.py); unlisted, only its job cgroup tells it apart.
* escape-wait: as escape, but the job ends only once /run/fake-server/slurm-<job id>.go
  exists (the test first moves the worker out of the job's cgroup, or freezes it: a rank
  stuck in the driver, which no signal ends).

Each writes "worker=PID gpu=N" to /run/fake-server/slurm-<job id>.pids.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.e2e.fake_server import open_node, register, set_comm

MiB = 1024 * 1024


def gpus() -> list[int]:
    # A neighbour is given its GPU (a second argument): it has no gres.
    text = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(g) for g in text.split(",") if g.strip().isdigit()]


def record(**pids: int) -> None:
    os.makedirs("/run/fake-server", exist_ok=True)
    path = f"/run/fake-server/slurm-{os.environ['SLURM_JOB_ID']}.pids"
    with open(path + ".tmp", "w") as handle:
        handle.write(" ".join(f"{k}={v}" for k, v in pids.items()) + "\n")
    os.replace(path + ".tmp", path)


def hold_forever(listed: bool = True) -> None:
    fds = [open_node(f"/dev/nvidia{g}") for g in gpus()]
    fds += [open_node("/dev/nvidiactl"), open_node("/dev/nvidia-uvm")]
    if listed:
        register([(g, os.getpid(), 2048 * MiB) for g in gpus()])
    while fds:
        time.sleep(3600)


def daemonize(ready_w: int) -> None:
    """In the grandchild: a new session, parented by init, stdio closed."""
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def main() -> None:
    mode = sys.argv[1]
    if mode in ("stay", "neighbour"):
        set_comm("job-rank0")
        record(worker=os.getpid(), gpu=gpus()[0])
        hold_forever(listed=mode == "stay")
        return
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(read_end)
        daemonize(write_end)
        if mode.startswith("escape"):
            set_comm("dp-worker")
            record(worker=os.getpid(), gpu=gpus()[0])
            os.write(write_end, b"x")
            os.close(write_end)
            hold_forever()
        os._exit(0)
    os.close(write_end)
    os.read(read_end, 1)  # the worker is up; the job's own process ends here
    os.wait()
    if mode == "escape-wait":
        go = f"/run/fake-server/slurm-{os.environ['SLURM_JOB_ID']}.go"
        while not os.path.exists(go):
            time.sleep(0.1)


if __name__ == "__main__":
    main()

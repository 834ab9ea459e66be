"""The start gate as Slurm's Prolog=, against the real Slurm of test_slurm.py: the
shipped prolog (slurm/prolog.d/50-gpuguard) holds a job whose GPU still has its predecessor's
memory until the memory is back and steady, and a prolog that times out drains the node with
gpuguard's reason (what still holds the GPU), not Slurm's bare "Prolog error"."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.harness import FAKE_NVML_STATE, Installed, wait_for
from tests.e2e.test_slurm import (
    job_pids,
    job_state,
    node_reason,
    node_state,
    slurm,
    slurm_logs,
    submit,
)

__all__ = ["slurm"]  # the module-scoped cluster fixture, used by name

pytestmark = pytest.mark.timeout(300)

PROLOG = "/usr/share/gpuguard/slurm/prolog.d/50-gpuguard"
GiB = 2**30


@pytest.fixture
def prolog(slurm: Installed) -> Iterator[Installed]:
    """Prolog=/etc/slurm/prolog.d/* with the shipped prolog linked there; undone after."""
    m = slurm.machine
    m.install_shipped("slurm/prolog.d/50-gpuguard", PROLOG, 0o755)
    m.run(f"mkdir -p /etc/slurm/prolog.d && ln -sf {PROLOG} /etc/slurm/prolog.d/50-gpuguard && "
          "echo 'Prolog=/etc/slurm/prolog.d/*' >> /etc/slurm/slurm.conf && scontrol reconfigure")
    try:
        yield slurm
    finally:
        m.run("sed -i '/^Prolog=/d' /etc/slurm/slurm.conf; rm -rf /etc/slurm/prolog.d; "
              "scontrol reconfigure", check=False)
        host = m.run(["hostname", "-s"]).stdout.strip()
        m.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], check=False)
        wait_for("the node to be idle again", lambda: node_state(slurm) == "idle" or None, 60, 0.5)


def linger(guard: Installed, delay_ms: int) -> int:
    """Memory on both GPUs of a process that is gone, which the driver keeps for `delay_ms` after
    gpuguardd first looks (the fake NVML's release delay): a predecessor's leftovers."""
    m = guard.machine
    dead = int(m.run(["sh", "-c", "echo $$"]).stdout.strip())
    text = m.read(FAKE_NVML_STATE)
    text += "".join(f"proc {gpu} {dead} {4 * GiB} compute release_delay_ms={delay_ms}\n"
                    for gpu in (0, 1))
    m.write(FAKE_NVML_STATE, text, 0o666)
    return dead


def forget(guard: Installed, pid: int) -> None:
    m = guard.machine
    kept = [line for line in m.read(FAKE_NVML_STATE).splitlines(keepends=True)
            if not line.startswith("proc ") or line.split()[2] != str(pid)]
    m.write(FAKE_NVML_STATE, "".join(kept), 0o666)


def test_a_job_waits_in_the_prolog_for_its_predecessors_memory(prolog: Installed) -> None:
    guard = prolog
    dead = linger(guard, 4000)
    try:
        time.sleep(0.5)  # gpuguardd's poll has seen it: the release delay runs from there
        lingered = time.monotonic()
        job = submit(guard, "stay")
        worker = job_pids(guard, job)["worker"]
        started = time.monotonic()
        # The memory stayed 4 s, then the gate's StableSec (3 s): the job ran after both.
        assert started - lingered >= 4 + 3 - 0.6, started - lingered
        assert job_state(guard, job) == "RUNNING"
        assert guard.alive(worker)
        assert node_state(guard) in ("mixed", "allocated")
    finally:
        forget(guard, dead)
        guard.machine.run(["scancel", "--full", "--user", "ggslurm"], check=False)


def test_a_prolog_that_times_out_drains_the_node_with_gpuguards_reason(prolog: Installed) -> None:
    guard = prolog
    m = guard.machine
    # The shipped prolog with a 3 s deadline (slurmd passes the prolog no environment of ours).
    # (The link goes first: writing through it would truncate the file sed reads.)
    m.run(f"rm -f /etc/slurm/prolog.d/50-gpuguard && sed '2i GPUGUARD_WAIT_OPTIONS=\"--timeout 3s\"' "
          f"{PROLOG} > /etc/slurm/prolog.d/50-gpuguard && chmod 755 /etc/slurm/prolog.d/50-gpuguard")
    dead = linger(guard, 600_000)
    try:
        job = submit(guard, "stay")
        wait_for("the node to drain", lambda: node_state(guard) in ("drained", "draining") or None,
                 90, 0.5)
        # slurmctld drains the node for the failed prolog and keeps the reason the script gave.
        try:
            reason = wait_for("gpuguard's drain reason", lambda: node_reason(guard) if
                              node_reason(guard).startswith("gpuguard:") else None, 20, 0.5)
        except Exception as exc:
            raise AssertionError(f"{exc}: {node_reason(guard)!r}\n"
                                 f"{m.journal('-t', 'gpuguard-prolog')}\n{slurm_logs(guard)}") from None
        assert reason.startswith(f"gpuguard: job {job}: not free after 3 s: GPU "), reason
        assert "NVML lists processes on it" in reason, reason
        assert f"gpuguard: job {job}: not free after 3 s" in m.journal("-t", "gpuguard-prolog")
        assert job_state(guard, job) != "RUNNING"  # requeued or held, never run
    finally:
        forget(guard, dead)
        m.run(["scancel", "--full", "--user", "ggslurm"], check=False)

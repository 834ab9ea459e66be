"""`gpuguardctl check --gpu N` fails closed: a compute holder whose GPU is unknown (it holds
only nvidia-uvm and nvidiactl, and NVML does not list it) may be on GPU N, so GPU N is not
free. Before, plain `check` said 7 and `check --gpu 0` said 0, since the listing by
GPU used the sweep's rule, which leaves out whatever it cannot place."""

from __future__ import annotations

import json

from gpuguardd.cli.exits import EXIT_NOT_FREE
from tests.conftest import GiB, GpuHost


def test_a_holder_of_unknown_gpu_counts_against_every_selected_gpu(gpu_host: GpuHost) -> None:
    host = gpu_host
    hidden = host.spawn("--comm", "escaped-worker", "--hold", host.node("nvidia-uvm"),
                        "--hold", host.node("nvidiactl"))
    for selectors in ([], ["--gpu", "0"], ["--gpu", "1"], ["--gpu", host.state.gpus[0].uuid]):
        done = host.cli("check", *selectors, "--json")
        assert done.returncode == EXIT_NOT_FREE, (selectors, done.stdout, done.stderr)
        problems = json.loads(done.stdout)["problems"]
        assert [(p["kind"], p["pid"]) for p in problems] == [("holder", hidden.pid)], selectors
    # The listing by GPU shows it too (it is what check reads).
    done = host.cli("holders", "--gpu", "1", "--json")
    assert hidden.pid in [h["pid"] for h in json.loads(done.stdout)], done.stdout
    assert hidden.alive()


def test_a_holder_of_another_gpus_node_alone_does_not_count(gpu_host: GpuHost) -> None:
    """Failing closed stays precise: NVML's word, where it has one, decides."""
    host = gpu_host
    host.spawn("--comm", "on-one", "--hold", host.node("nvidia1"), "--hold", host.node("nvidia-uvm"),
               nvml=(1, GiB))
    done = host.cli("check", "--gpu", "0")
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr

"""Numbers on the bus read strictly: a `gpus` option given as text (`as`)
with digits int() takes but ASCII does not ("\\u00b2" made int() raise, a traceback and
Failed; "\\u0660" named GPU 0), or an index past a `u`, is InvalidArgument naming the value,
for any caller; and a Slurm job id with a trailing newline is refused, as `--local` refuses it."""

from __future__ import annotations

import json

import pytest

from tests.dbus_harness import MANAGER, MANAGER_PATH, BusctlError, GuardDaemon, private_gpu

pytest_plugins = ["tests.dbus_harness"]


@pytest.mark.parametrize("gpu", ["\u00b2", "\u0660", "\uff14\uff12", "4294967296", "1" * 23, "-1"])
def test_loose_gpu_text_is_invalid_argument(guard: GuardDaemon, gpu: str) -> None:
    options = "{'dry_run': <true>, 'gpus': <[" + json.dumps(gpu) + "]>}"
    for as_nobody in (True, False):
        done = guard.gdbus("--object-path", MANAGER_PATH, "--method", f"{MANAGER}.Sweep", options,
                           as_nobody=as_nobody)
        assert done.returncode != 0, done.stdout
        assert "org.gpuguard.GpuGuard1.Error.InvalidArgument" in done.stderr, done.stderr
        assert gpu in done.stderr, done.stderr  # the message names the value
    logs = "\n".join(guard.logs)
    assert "Traceback" not in logs and guard.alive()


def test_a_job_id_with_a_newline_is_refused(guard: GuardDaemon) -> None:
    gpu = str(private_gpu(guard.host))
    with pytest.raises(BusctlError, match="slurm_job"):
        guard.manager("Sweep", "a{sv}", "4", "slurm_job", "s", "4711\n", "slurm_uid", "u", "65534",
                      "gpus", "au", "1", gpu, "dry_run", "b", "true")

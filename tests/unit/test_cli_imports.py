"""gpuguardctl imports what its verb needs and nothing more (cli/main.py): the engine only for
--local, dbus-fast only to ask the daemon. Which modules load is checked, never how long they
take (bench/bench_startup.py measures that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs gpuguardctl with the given arguments in a fresh interpreter and prints, as JSON, its
# exit status and the modules loaded by then.
PROBE = """
import json, runpy, sys
sys.argv = ["gpuguardctl", *json.loads(sys.argv[1])]
try:
    runpy.run_module("gpuguardd.cli.main", run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

ENGINE = {"gpuguardd.engine.engine", "gpuguardd.engine.holders", "gpuguardd.engine.nvml",
          "gpuguardd.engine.sweep", "pynvml"}
DBUS = {"dbus_fast", "gpuguardd.cli.client", "gpuguardd.bus.marshal"}
NEVER = {"psutil"}  # the engine reads /proc itself
# Each verb's own module: loaded by its verb, never at start-up.
VERB_MODULES = {"gpuguardd.cli.output", "gpuguardd.cli.sweep",
                "gpuguardd.cli.check", "gpuguardd.cli.wait", "gpuguardd.cli.watch"}


def loaded(*args: str) -> tuple[int, set[str]]:
    env = {k: v for k, v in os.environ.items() if k != "GPUGUARD_BUS_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    result = json.loads(proc.stdout.splitlines()[-1])
    return int(result["code"] or 0), set(result["modules"])


def test_version_imports_neither_engine_nor_dbus(tmp_path: Path) -> None:
    code, modules = loaded("--version")
    assert code == 0
    assert not modules & (ENGINE | DBUS | NEVER | {"asyncio"}), modules & (ENGINE | DBUS | NEVER)
    assert not modules & VERB_MODULES, modules & VERB_MODULES


def test_daemon_verbs_import_no_engine(tmp_path: Path) -> None:
    # No daemon on this address: the verb fails, after importing what it needs.
    address = f"unix:path={tmp_path}/no-bus"
    for verb in ("status", "holders", "history"):
        code, modules = loaded(verb, "--bus-address", address)
        assert code == 1, verb
        assert "dbus_fast" in modules, verb  # it did try the bus
        assert not modules & (ENGINE | NEVER), (verb, modules & (ENGINE | NEVER))


def test_local_holders_imports_no_dbus(tmp_path: Path) -> None:
    config = tmp_path / "gpuguard.conf"
    # Nodes that do not exist: an empty answer, quickly; what matters is what was imported.
    config.write_text(f"[Devices]\nPaths=\nPaths={tmp_path}/dev/nvidia*\n"
                      f"[Daemon]\nRuntimeDirectory={tmp_path}/run\nStateDirectory={tmp_path}/state\n")
    code, modules = loaded("holders", "--local", "--json", "--config", str(config))
    assert code == 0
    assert "gpuguardd.engine.holders" in modules  # it did scan
    assert not modules & (DBUS | NEVER | {"asyncio"}), modules & (DBUS | NEVER | {"asyncio"})

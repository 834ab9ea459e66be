"""No reply nears the bus's message limit: the bounding of holder lists, the wire-size
estimate, the capped command-line read and the CLI's note (the daemon's replies:
tests/bus/adversarial/test_reply_size.py)."""

from __future__ import annotations

from typing import Any

from dbus_fast import Message, Variant

from gpuguardd import safetext
from gpuguardd.bus import names, replysize
from gpuguardd.records.models import Holder
from gpuguardd.records.report import Report
from tests.bus.adversarial.hostile_holder import ARG_MAX_ONE
from tests.dbus_harness import BUS_NAME, MANAGER, MANAGER_PATH

MiB = 1024 * 1024


def plain(value: Any) -> Any:
    if isinstance(value, Variant):
        return plain(value.value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def big_report(n: int, targets: int, exe_len: int = 300) -> dict[str, Any]:
    return {"id": f"{n:032x}", "started_usec": 1_700_000_000_000_000 + n, "outcome": "freed",
            "requested_by": "uid 0 (root) :1.7", "dry_run": False, "duration_ms": 5,
            "scope": {"gpus": [], "unit": "", "container": ""},
            "targets": [{"pid": 1000 + i, "comm": "python3", "unit": "",
                         "exe": "/" + "x" * exe_len} for i in range(targets)],
            "terminated": [{"pid": 1000 + i, "comm": "python3", "unit": "", "signal": "SIGTERM",
                            "exited_after_ms": 3} for i in range(targets)]}


def test_bound_holders_compacts_then_omits() -> None:
    def holder(pid: int) -> dict[str, Variant]:
        return {"pid": Variant("u", pid), "cmdline": Variant("s", "c" * 4000),
                "exe": Variant("s", "/" + "e" * 4000)}
    holders = [holder(pid) for pid in range(100)]
    # Fits: sent as they are, the very same entries.
    fits = replysize.bound_holders(holders, budget=2 * MiB)
    assert all(a is b for a, b in zip(fits, holders, strict=True)) and len(fits) == len(holders)
    # Over: every holder is kept, its text cut.
    compact = replysize.bound_holders(holders, budget=100 * 1024)
    assert [h["pid"].value for h in compact] == list(range(100))
    assert all(len(h["cmdline"].value) <= replysize.COMPACT_TEXT for h in compact)
    assert compact[0]["cmdline"].value.endswith(safetext.MARKER)
    assert replysize.wire_size(compact) <= 100 * 1024
    # Far over: the first ones, the last saying how many were left out.
    few = replysize.bound_holders(holders, budget=10 * 1024)
    assert 0 < len(few) < 100 and few[-1][names.OMITTED_KEY].value == 100 - len(few)
    assert replysize.wire_size(few) <= 10 * 1024


def test_wire_size_is_an_upper_bound() -> None:
    from gpuguardd.bus import marshal
    data = big_report(1, 50)
    data["warnings"] = ["\u00e9t\u00e9 \U0001f600" * 20]
    typed = marshal.report(data)
    message = Message(destination=BUS_NAME, path=MANAGER_PATH, interface=MANAGER,
                      member="X", signature="a{sv}", body=[typed])
    actual = len(bytes(message._marshall(False)))
    estimate = replysize.wire_size(typed)
    assert actual - 200 <= estimate <= actual * 2, (actual, estimate)


def test_only_the_capped_part_of_a_command_line_is_read() -> None:
    import subprocess
    import sys
    import tracemalloc

    from gpuguardd.engine import procfs
    code = "import sys, time; print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, *["B" * ARG_MAX_ONE] * 15],
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        tracemalloc.start()
        try:
            cmdline = procfs.read_cmdline(proc.pid) or ""
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(cmdline.encode()) <= safetext.CMDLINE_MAX and cmdline.endswith(safetext.MARKER)
        assert peak < 64 * 1024, peak  # 1.9 MB of argv, 4 KiB of it read
    finally:
        proc.kill()
        proc.wait()


def test_the_cli_says_when_a_reply_was_cut() -> None:
    import io

    from gpuguardd.cli import output
    holders = plain(replysize.bound_holders(
        [{"pid": Variant("u", pid), "comm": Variant("s", "x"), "exe": Variant("s", "e" * 4000),
          "cmdline": Variant("s", "c" * 4000), "uid": Variant("u", 0), "user": Variant("s", "root"),
          "unit": Variant("s", ""), "container": Variant("s", ""), "kind": Variant("s", "compute"),
          "protected": Variant("b", False), "state": Variant("s", "S"), "gpus": Variant("au", [0]),
          "gpu_memory": Variant("t", 0), "how": Variant("as", ["fd"])} for pid in range(100)],
        budget=10 * 1024))
    out = io.StringIO()
    output.print_holders([Holder.from_dict(h) for h in holders], out)
    assert f"({100 - len(holders)} more holders not shown" in out.getvalue()
    out = io.StringIO()
    output.print_omitted([Report.from_dict(r) for r in ({"id": "a"}, {"id": "b", names.OMITTED_KEY: 7})],
                         "reports", out)
    assert out.getvalue().startswith("(7 more reports not shown")

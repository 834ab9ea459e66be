"""Terminal and log injection, the rules without a daemon: the escaping, log
lines, gpuguardctl's human output and hook list (the daemon and gpuguardctl on the bus:
tests/bus/adversarial/test_escaping.py)."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

from gpuguardd.cli.output import print_holders, print_report, print_status
from gpuguardd.cli.watch import describe
from gpuguardd.escaping import escape_text, escaped
from gpuguardd.log import PlainFormatter, SdDaemonFormatter
from gpuguardd.records.models import Holder
from gpuguardd.records.report import Report

SCREEN = "\x1b[2J\x1b]0;pwned\x07"  # 14 characters: fits a comm (15)


FORGED = "gg\n<3>FORGED"


BIDI = "gg\u202etxt.exe"


# Anything a terminal or journald acts on: C0 (newline, ESC, BEL...), DEL, C1, bidi controls,
# line/paragraph separators.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def assert_clean(text: str, lines: int | None = None) -> None:
    assert RAW.search(text) is None, repr(text)
    if lines is not None:
        assert len(text.splitlines()) == lines, text


def test_escape_text_rule() -> None:
    assert escape_text(SCREEN) == "\\x1b[2J\\x1b]0;pwned\\x07"
    assert escape_text(FORGED) == "gg\\n<3>FORGED"
    assert escape_text("a\u202eb\x85c\u2028d\x7f") == "a\\u202eb\\x85c\\u2028d\\x7f"
    assert escape_text("caf\u00e9 \u4e2d") == "caf\u00e9 \u4e2d"  # printable text stays
    assert escape_text("\udcff") == "\\udcff"  # a lone surrogate cannot even be printed
    # Escaping twice changes nothing: layers may each apply it.
    assert escape_text(escape_text(SCREEN + FORGED)) == escape_text(SCREEN + FORGED)
    assert escaped({"k\n": [SCREEN, 3, ("x\r",)]}) == {"k\\n": ["\\x1b[2J\\x1b]0;pwned\\x07", 3,
                                                               ("x\\r",)]}


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("gpuguard.t", logging.INFO, __file__, 1, msg, args, None)


def test_log_lines_cannot_be_forged() -> None:
    line = SdDaemonFormatter("%(message)s").format(
        _record("sent SIGTERM to pid %d (%s)", 42, FORGED + SCREEN + BIDI))
    assert_clean(line, lines=1)
    assert line.startswith("<6>sent SIGTERM to pid 42 (gg\\n<3>FORGED")
    plain = PlainFormatter("gpuguardctl").format(_record("%s", FORGED))
    assert plain == "gpuguardctl: gg\\n<3>FORGED"
    # Even a message built before logging (no arguments) and an exception's text.
    try:
        raise RuntimeError(f"bad {FORGED}")
    except RuntimeError:
        import sys
        record = logging.LogRecord("gpuguard.t", logging.ERROR, __file__, 1, f"x {SCREEN}", (),
                                   sys.exc_info())
    text = SdDaemonFormatter("%(message)s").format(record)
    assert_clean(text)
    assert all(line.startswith("<3>") for line in text.splitlines()), text
    assert "RuntimeError: bad gg\\n<3>FORGED" in text


def _report() -> dict[str, object]:
    target = {"pid": 7, "comm": SCREEN, "unit": FORGED, "signal": "SIGTERM", "exited_after_ms": 3,
              "why": BIDI}
    return {"id": "0123456789", "scope": {"unit": FORGED, "gpus": [1]}, "dry_run": True,
            "requested_by": f"uid 0 {SCREEN}", "targets": [target], "terminated": [target],
            "survived": [target], "spared": [target], "gpus": [], "leaks": [],
            "warnings": [FORGED], "outcome": "dry-run", "duration_ms": 1}


def test_human_output_escapes_every_field() -> None:
    out = io.StringIO()
    print_report(Report.from_dict(_report()), out)
    assert_clean(out.getvalue(), lines=7)
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in out.getvalue()
    holder: dict[str, object] = {"pid": 7, "user": FORGED, "uid": 0, "unit": SCREEN, "container": BIDI,
              "kind": "compute", "protected": False, "state": "S", "gpus": [0], "gpu_memory": 0,
              "how": ["fd"], "cmdline": f"python3 {FORGED}", "comm": SCREEN}
    out = io.StringIO()
    print_holders([Holder.from_dict(holder)], out)
    assert_clean(out.getvalue(), lines=2)
    out = io.StringIO()
    print_status({"last_sweep": _report(), "version": SCREEN}, out)
    assert_clean(out.getvalue(), lines=2)
    watch_line = describe("ProcessTerminated", {"id": "0123456789", "pid": 7, "comm": FORGED,
                                                "unit": SCREEN, "signal": BIDI})
    assert_clean(watch_line, lines=1)


def test_hook_list_escapes_unit_names(tmp_path: Path) -> None:
    """`hook list` shows unit file names from the host's directories."""
    from gpuguardd.cli.hook import format_list
    from gpuguardd.systemd import dropins as hooks
    hooks.install("vllm-", str(tmp_path), reload=False)
    units = tmp_path / "etc" / "systemd" / "system"
    (units / f"vllm-{SCREEN}.service").write_text("[Service]\nExecStart=/bin/true\n")
    text = format_list(hooks.list_hooks("", str(tmp_path)))
    assert_clean(text, lines=2)
    assert "applies to vllm-\\x1b[2J\\x1b]0;pwned\\x07.service" in text

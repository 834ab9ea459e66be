"""Bytes that are not UTF-8 in /proc: the escaping helper, the history's writer and the /proc
readers (replies, signals and history over the bus: tests/bus/adversarial/test_utf8.py)."""

from __future__ import annotations

from pathlib import Path

from gpuguardd import safetext
from gpuguardd.daemon.history import FILE_NAME, History
from gpuguardd.records.report import Report


def test_helper_escapes_bad_bytes_and_bounds_length() -> None:
    assert safetext.text(b"a\xffb\x00c") == "a\\xffb\\x00c"
    assert safetext.clean("a\udcffb") == "a\\xffb"
    assert safetext.clean("\ud800x") == "\\xed\\xa0\\x80x"
    cut = safetext.text(b"\xff" * 10_000, limit=100)
    assert len(cut.encode()) <= 100 and cut.endswith(safetext.MARKER)
    assert safetext.text("\u00e9t\u00e9".encode()) == "\u00e9t\u00e9"  # valid text is kept
    repaired, changed = safetext.repair({"a": ["x\udcff", {"k\udcfe": 1}], "n": 2})
    assert changed and repaired == {"a": ["x\\xff", {"k\\xfe": 1}], "n": 2}


def test_history_append_never_stores_bad_text(tmp_path: Path) -> None:
    history = History(str(tmp_path), 10)
    history.load()
    history.append(Report.from_dict({"id": "c" * 32, "targets": [{"exe": "/x/\udcff"}]}))
    assert history.newest(1) == [{"id": "c" * 32, "targets": [{"exe": "/x/\\xff"}]}]
    assert b"\\udc" not in (tmp_path / FILE_NAME).read_bytes()


def test_proc_readers_escape_what_a_process_names_itself(tmp_path: Path) -> None:
    """comm (prctl), argv and exe with bytes that are not UTF-8, read by procfs/holders."""
    import subprocess
    import sys

    from gpuguardd.engine import procfs
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'gg-\\xff\\xfe', 0, 0, 0); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, b"arg-\xff"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        stat = procfs.read_stat(proc.pid)
        assert stat is not None and stat.comm == "gg-\\xff\\xfe"
        assert (procfs.read_cmdline(proc.pid) or "").endswith(" arg-\\xff")
        assert safetext.is_clean(procfs.read_wchan(proc.pid) or "")
        assert safetext.is_clean(procfs.read_cgroup(proc.pid) or "")
    finally:
        proc.kill()
        proc.wait()

"""write_atomic (gpuguardd/safefiles.py): the one way gpuguard replaces a file (history,
metrics textfile, drop-ins); and safetext.user_name, the one user-name lookup."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd.safefiles import write_atomic


def test_replaces_the_file_with_exactly_the_mode_asked(tmp_path: Path) -> None:
    target = tmp_path / "out.prom"
    target.write_text("old")
    old_umask = os.umask(0o077)  # the mode is the one asked for, whatever the umask
    try:
        write_atomic(str(target), [b"a", b"bc"], prefix=".out.tmp-", mode=0o644, fsync_dir=True)
    finally:
        os.umask(old_umask)
    assert target.read_bytes() == b"abc"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.prom"]


def test_a_failure_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "history.jsonl"
    target.write_text("kept\n")

    def chunks() -> Iterator[bytes]:
        yield b"half"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(str(target), chunks(), prefix="history.jsonl.tmp-", mode=0o600)
    assert target.read_text() == "kept\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl"]


def test_a_link_in_place_of_the_file_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "gpuguard.conf"
    target.symlink_to(victim)
    write_atomic(str(target), [b"[Service]\n"], prefix=".gpuguard.conf.", fsync=False)
    assert victim.read_text() == "untouched"
    assert not target.is_symlink() and target.read_text() == "[Service]\n"


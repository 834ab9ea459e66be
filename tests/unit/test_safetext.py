"""Unit tests of gpuguardd/safetext.py."""

from __future__ import annotations

from gpuguardd.safetext import user_name


def _has_name(uid: int) -> bool:
    import pwd
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_user_name() -> None:
    assert user_name(0) == "root"
    unused = next(uid for uid in range(2_000_000_000, 2_000_001_000) if not _has_name(uid))
    assert user_name(unused) == str(unused)


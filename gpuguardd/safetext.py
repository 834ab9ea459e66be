"""Untrusted text made sendable: D-Bus strings must be UTF-8 without NUL, or the whole reply fails.
/proc hands out a process's own bytes, which psutil and os decode into lone surrogates; everything
read there goes through text() or clean() once, where read. Bad bytes become backslash escapes
(b"\\xff" -> "\\\\xff"), stable for a process; long text is cut at a byte budget, with a marker.
"""

from __future__ import annotations

import pwd
from typing import Any

# Caps, in bytes of UTF-8 after escaping (docs/security.md, gpuguard-dbus(7)).
STRING_MAX = 16384  # any string on the bus (marshal.py): the last line of defence
CMDLINE_MAX = 4096
PATH_MAX = 4096  # exe, cgroup, unit, container: the kernel's own PATH_MAX
NAME_MAX = 256  # user names and other short labels

MARKER = " [...truncated]"


def cut(value: str, limit: int, already_cut: bool = False) -> str:
    """At most `limit` bytes, ending in MARKER when anything was left out (here, or `already_cut`)."""
    if not already_cut and len(value) * 4 <= limit:
        return value  # cannot be over: no need to encode
    data = value.encode("utf-8")
    if len(data) <= limit and not already_cut:
        return value
    keep = max(0, limit - len(MARKER))
    # errors="ignore" drops a character split by the cut rather than escaping half of it.
    return data[:keep].decode("utf-8", "ignore") + MARKER


def text(raw: bytes, limit: int = PATH_MAX, already_cut: bool = False) -> str:
    """`already_cut`: the bytes were cut short where they were read."""
    return cut(raw.decode("utf-8", "backslashreplace").replace("\0", "\\x00"), limit, already_cut)


def clean(value: str, limit: int = 0) -> str:
    """A str with lone surrogates (from os/psutil/pwd, an old JSON record) or NUL as text() makes it."""
    if not is_clean(value):
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # surrogates that stand for no byte (U+D800..U+DC7F)
            raw = value.encode("utf-8", "surrogatepass")
        value = raw.decode("utf-8", "backslashreplace").replace("\0", "\\x00")
    return cut(value, limit) if limit else value


def is_clean(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\0" not in value


def repair(value: Any) -> tuple[Any, bool]:
    """Plain JSON data with every string, key included, clean(); and whether anything changed."""
    if isinstance(value, str):
        return (value, False) if is_clean(value) else (clean(value), True)
    if isinstance(value, dict):
        pairs = [(repair(key), repair(item)) for key, item in value.items()]
        if any(key[1] or item[1] for key, item in pairs):
            return {key[0]: item[0] for key, item in pairs}, True
    elif isinstance(value, list):
        items = [repair(item) for item in value]
        if any(changed for _, changed in items):
            return [item for item, _ in items], True
    return value, False


def user_name(uid: int) -> str:
    """From NSS, which may be LDAP: untrusted, cleaned like /proc's text; the number when it has none."""
    try:
        return clean(pwd.getpwuid(uid).pw_name, NAME_MAX)
    except KeyError:
        return str(uid)

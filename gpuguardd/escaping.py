"""One rule for text that reaches a person: an admin's terminal or the journal.

Process names, command lines, unit names and paths are chosen by whoever started the process.
Written raw, `\\x1b[2J` clears the admin's screen, `\\x1b]0;...\\x07` sets the terminal's title,
a newline forges a second journal line, and a bidi override (U+202E) shows text reversed. So
every character str.isprintable() refuses (C0 and C1 controls, DEL, bidi and zero-width format
characters, line and paragraph separators, lone surrogates) is written as Python's
unicode_escape writes it; escaping twice changes nothing, so layers may each apply it. JSON
output needs none of this: json.dumps escapes control characters itself.
"""

from __future__ import annotations

from typing import Any


def escape_text(text: object) -> str:
    value = str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value)


def escaped(data: Any) -> Any:
    """`data` (dicts, lists, tuples, strings, numbers) with every string in it escaped, keys
    included: what the human output formats from, so no field can be forgotten."""
    if isinstance(data, str):
        return escape_text(data)
    if isinstance(data, dict):
        return {escaped(k): escaped(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(escaped(item) for item in data)
    return data

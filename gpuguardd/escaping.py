"""One rule for text that reaches a terminal or the journal, where process, unit and path names are
anyone's: raw, `\\x1b[2J` clears the screen, a newline forges a journal line, U+202E reverses text.
Every character str.isprintable() refuses (controls, DEL, bidi and zero-width format characters,
separators, lone surrogates) is written as unicode_escape does; escaping twice changes nothing.
JSON needs none of this: json.dumps escapes control characters itself.
"""

from __future__ import annotations

from typing import Any


def escape_text(text: object) -> str:
    value = str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value)


def escaped(data: Any) -> Any:
    """Every string in `data`, keys included, escaped: human output formats from it, forgetting none."""
    if isinstance(data, str):
        return escape_text(data)
    if isinstance(data, dict):
        return {escaped(k): escaped(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(escaped(item) for item in data)
    return data

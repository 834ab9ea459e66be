"""gpuguardctl's argument types: each reads one option's text, or says why argparse refuses it.

The parsers they call are imported when an option is parsed, not at start-up.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import TypeVar

from gpuguardd.errors import InvalidArgument

T = TypeVar("T")


def _refusing(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse`, with its complaint (a ValueError or InvalidArgument) as argparse's own."""
    @functools.wraps(parse)
    def convert(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, InvalidArgument) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


@_refusing
def grace_ms(text: str) -> int:
    """A time span of at most MAX_GRACE_SEC, in milliseconds (--grace, --deadline)."""
    from gpuguardd.config import MAX_GRACE_SEC, parse_timespan

    return int(parse_timespan(text, MAX_GRACE_SEC) * 1000)


@_refusing
def positive(text: str) -> int:
    from gpuguardd.numbers import parse_uint

    return parse_uint(text, "count", minimum=1)


@_refusing
def mib(text: str) -> int:
    from gpuguardd.config import MAX_RELEASED_BELOW_MIB
    from gpuguardd.numbers import parse_uint

    return parse_uint(text, "MiB", MAX_RELEASED_BELOW_MIB, 1)


@_refusing
def stable_sec(text: str) -> float:
    from gpuguardd.config import MAX_GATE_STABLE_SEC, parse_timespan

    return parse_timespan(text, MAX_GATE_STABLE_SEC)


@_refusing
def timeout_sec(text: str) -> float:
    from gpuguardd.config import parse_timespan

    return parse_timespan(text, 24 * 3600.0)


@_refusing
def gpu(text: str) -> str:
    """A --gpu as typed (the backend resolves it), once it names a GPU at all: an index in
    ASCII digits within range, or a GPU-/MIG- UUID (selectors.py)."""
    from gpuguardd.records.selectors import selector

    selector(text).check()
    return text

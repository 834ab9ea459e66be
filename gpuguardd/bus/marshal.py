"""Plain engine dicts to typed D-Bus variants and back, and the options callers send checked.

Types come from the contract XML's Keys, whatever Python type the engine used; a key the XML
does not list (a later engine's, an old history entry's) gets one inferred from its value.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from dbus_fast.signature import Variant

from gpuguardd import safetext
from gpuguardd.bus import names
from gpuguardd.bus.contract import Dictionary, Property, contract
from gpuguardd.errors import InvalidArgument

log = logging.getLogger("gpuguard.marshal")

VarDict = dict[str, Variant]

# The dictionaries of the contract that the daemon types or checks (names as in the XML).
FILTER = "Filter"
SWEEP = "SweepOptions"
HOLDER = contract().dictionaries["Holder"]
REPORT = contract().dictionaries["Report"]
MAX_TEXT = 1024  # characters of a string argument


def snake_case(name: str) -> str:
    """A property's name as the engine's and gpuguardctl's dicts spell it: MemoryTotal -> memory_total."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_RANGES = {"y": (0, 2**8 - 1), "n": (-(2**15), 2**15 - 1), "q": (0, 2**16 - 1),
           "i": (-(2**31), 2**31 - 1), "u": (0, 2**32 - 1), "x": (-(2**63), 2**63 - 1),
           "t": (0, 2**64 - 1)}


class _Mismatch(Exception):
    pass


def _typed(value: Any, signature: str) -> Any:
    """The value in the Python shape dbus-fast expects for `signature` (simple types only)."""
    if signature.startswith("a") and len(signature) == 2:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(f"{value!r} is not a list")
        return [_typed(item, signature[1]) for item in value]
    if signature in _RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(f"{value!r} is not an integer")
        low, high = _RANGES[signature]
        if not low <= value <= high:
            raise _Mismatch(f"{value} does not fit {signature}")
        return value
    if signature == "b":
        if not isinstance(value, bool):
            raise _Mismatch(f"{value!r} is not a boolean")
        return value
    if signature == "d":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch(f"{value!r} is not a number")
        return float(value)
    if signature in ("s", "o", "g"):
        if not isinstance(value, str):
            raise _Mismatch(f"{value!r} is not a string")
        # The last line of defence: one string that is not valid UTF-8 (or holds NUL) would
        # fail the whole reply, and none may be long enough to threaten the message limit.
        # Text from /proc is already clean and bounded where it is read.
        return safetext.clean(value, safetext.STRING_MAX)
    raise _Mismatch(f"unsupported signature {signature}")


def infer(value: Any) -> Variant | None:
    """A variant for a value no schema describes; None for values D-Bus cannot carry (None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return Variant("b", value)
    if isinstance(value, int):
        return Variant("t" if 0 <= value < 2**64 else "x", value)
    if isinstance(value, float):
        return Variant("d", value)
    if isinstance(value, str):
        return Variant("s", _typed(value, "s"))
    if isinstance(value, Mapping):
        return Variant("a{sv}", to_vardict(value, {}))
    if isinstance(value, (list, tuple)):
        items = list(value)
        if items and all(isinstance(i, Mapping) for i in items):
            return Variant("aa{sv}", [to_vardict(i, {}) for i in items])
        if items and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**64 for i in items):
            return Variant("at", items)
        return Variant("as", [_typed(str(i), "s") for i in items])
    return Variant("s", _typed(str(value), "s"))


def to_vardict(data: Mapping[str, Any], dictionary: Dictionary) -> VarDict:
    out: VarDict = {}
    for key, value in data.items():
        field = dictionary.get(key)
        variant: Variant | None
        if field is None or value is None:
            variant = infer(value)
        elif field.dictionary is not None:
            variant = _nested(key, value, field.signatures[0], field.dictionary)
        else:
            try:
                variant = Variant(field.signatures[0], _typed(value, field.signatures[0]))
            except _Mismatch as exc:
                # An engine bug must not turn every call into an error: log it, send what we have.
                log.warning("key %r: %s; sent with an inferred type", key, exc)
                variant = infer(value)
        if variant is not None:
            out[str(key)] = variant
    return out


def _nested(key: str, value: Any, signature: str, dictionary: Dictionary) -> Variant | None:
    if signature == "a{sv}" and isinstance(value, Mapping):
        return Variant("a{sv}", to_vardict(value, dictionary))
    if signature == "aa{sv}" and isinstance(value, (list, tuple)) and all(isinstance(i, Mapping) for i in value):
        return Variant("aa{sv}", [to_vardict(item, dictionary) for item in value])
    log.warning("key %r: %r is not %s; sent with an inferred type", key, value, signature)
    return infer(value)


def holder(data: Mapping[str, Any]) -> VarDict:
    # A uid that could not be read (-1 in the engine) is a `u` on the bus: names.UID_UNKNOWN.
    uid = data.get("uid")
    if isinstance(uid, int) and uid < 0:
        data = {**data, "uid": names.UID_UNKNOWN}
    return to_vardict(data, HOLDER)


def report(data: Mapping[str, Any]) -> VarDict:
    return to_vardict(data, REPORT)


def scope(data: Mapping[str, Any]) -> VarDict:
    return to_vardict(data, contract().dictionaries["Scope"])


def unwrap(value: Any) -> Any:
    """Variants (nested anywhere) to plain Python values, as the CLI's JSON shows them."""
    if isinstance(value, Variant):
        return unwrap(value.value)
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unwrap(v) for v in value]
    return value


def parse_options(options: Mapping[str, Any], dictionary: str) -> dict[str, Any]:
    """The plain values of an a{sv} argument, checked against `dictionary` (InvalidArgument names the key)."""
    spec = contract().dictionaries[dictionary]
    what = dictionary.removesuffix("Options").lower()  # "sweep", "filter"
    values: dict[str, Any] = {}
    for key, variant in options.items():
        if key not in spec:
            raise InvalidArgument(f"unknown {what} option {key!r} (known: {', '.join(sorted(spec))})")
        accepted = spec[key].signatures
        signature = variant.signature if isinstance(variant, Variant) else "?"
        if signature not in accepted:
            raise InvalidArgument(f"{what} option {key!r} must be of type {' or '.join(accepted)}, got {signature}")
        value = variant.value
        if signature == "s":
            check_text(key, value)
        if signature == "as":
            for item in value:
                check_text(key, item)
        values[key] = list(value) if signature.startswith("a") else value
    return values


def option(dictionary: str, key: str, value: Any, signature: str = "") -> Variant:
    """An option as a caller sends it: of its first type in the XML, or `signature` if it takes that."""
    accepted = contract().dictionaries[dictionary][key].signatures
    if signature and signature not in accepted:
        raise ValueError(f"{dictionary} option {key} is {' or '.join(accepted)}, not {signature}")
    return Variant(signature or accepted[0], value)


def check_text(key: str, value: str) -> None:
    # Strings end up in the journal and in reports: no control characters to forge lines with.
    if len(value) > MAX_TEXT:
        raise InvalidArgument(f"{key} is too long ({len(value)} characters, at most {MAX_TEXT})")
    if any(not ch.isprintable() for ch in value):
        raise InvalidArgument(f"{key} {value[:60]!r} contains control characters")


def property_value(prop: Property, value: Any) -> Any:
    """An engine value as property `prop` carries it (None: empty, zero or false)."""
    if prop.signature == "s":
        return str(value or "")
    if prop.signature in ("u", "t"):
        return max(0, int(value or 0))
    if prop.signature == "b":
        return bool(value)
    if prop.keys and prop.signature == "a{sv}":
        return to_vardict(value or {}, contract().dictionaries[prop.keys])
    if prop.keys and prop.signature == "aa{sv}":
        return [to_vardict(v, contract().dictionaries[prop.keys]) for v in value or []]
    return value

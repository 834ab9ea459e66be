"""Typed records and the plain dicts the wire carries (D-Bus `a{sv}` through bus/marshal.py,
history.jsonl, `gpuguardctl --json`): one way out, one way back.

`to_dict()` of a record gpuguard built gives its wire form: every field, in the order the
record declares them (the order the keys have always had), except the OPTIONAL ones while
they are empty, with enums as their values and nested records as dicts.

`from_dict()` reads a record from someone else's hands: a history file an older version
wrote or someone edited, a newer daemon's reply. It never raises. A key that is missing, or
holds another type than the field's, is named in `unread` (printers show "?") and its field
gets a stand-in (the field's `unread` metadata, else its default, else the type's zero); and
what it held, like every key this version does not know, is given back as it came by
to_dict(), so a record passed through (the CLI's --json, a history served again) keeps its
shape. A record read back is a view of what was read: it is not to be changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # for mypy only: Debian 12's python3 has no typing_extensions (nor typing.Self)
    from typing_extensions import Self

# A record's wire form: what to_dict gives, marshalling types and history.jsonl stores.
Wire = dict[str, Any]

# A reader returns (True, typed value), or for a value of another type (False, None) or
# (False, what of it can still be shown).
Reader = Callable[[object], tuple[bool, Any]]


@dataclass
class _ReadBack:
    """What from_dict saw besides the typed values."""

    present: frozenset[str]  # the known keys the dict had
    kept: dict[str, Any]  # given back as they came: unknown keys, and values of another type
    whole: tuple[object, ...] = ()  # (the value,) when it was no dict at all


@dataclass
class WireRecord:
    """Base of the records that travel as dicts; subclasses are dataclasses."""

    # Keys left out of the wire form while empty: they appear only when they say something
    # (a MIG UUID, a zombie's parent). A field typed `X | None` is left out while None only
    # (an empty list then still says "none", where None says "not known here").
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    unread: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _back: _ReadBack | None = field(default=None, init=False, repr=False, compare=False)

    def to_dict(self) -> Wire:
        wire = self._wire()
        return wire if isinstance(wire, dict) else {}

    def _wire(self) -> object:
        back = self._back
        out: Wire = {}
        if back is None:
            for name, left_out in _layout(type(self)):
                value = getattr(self, name)
                if not left_out(value):
                    out[name] = plain(value)
            return out
        if back.whole:
            return back.whole[0]
        for name, _ in _layout(type(self)):
            if name in back.kept:
                out[name] = back.kept[name]
            elif name in back.present:
                out[name] = plain(getattr(self, name))
        out.update((key, value) for key, value in back.kept.items() if key not in out)
        return out

    @classmethod
    def from_dict(cls, data: object) -> Self:
        specs = _specs(cls)
        values: dict[str, Any] = {}
        unread: set[str] = set()
        kept: dict[str, Any] = {}
        present: set[str] = set()
        source: Mapping[Any, Any] = data if isinstance(data, Mapping) else {}
        for key, raw in source.items():
            if key not in specs:
                kept[str(key)] = raw
        for name, (reader, stand_in, _) in specs.items():
            if name not in source:
                if name not in cls.OPTIONAL:  # an optional key is absent where it does not apply
                    unread.add(name)
                values[name] = stand_in()
                continue
            present.add(name)
            ok, value = reader(source[name])
            if ok:
                values[name] = value
            else:
                unread.add(name)
                kept[name] = source[name]
                # What a printer can still show of it (text for a list of texts), else a stand-in.
                values[name] = value if value is not None else stand_in()
        record = cls(**{name: value for name, value in values.items() if specs[name][2]})
        for name, value in values.items():
            if not specs[name][2]:
                object.__setattr__(record, name, value)
        object.__setattr__(record, "unread", frozenset(unread))
        object.__setattr__(record, "_back", _ReadBack(
            frozenset(present), kept, () if isinstance(data, Mapping) else (data,)))
        return record

    @property
    def unknown(self) -> Mapping[str, Any]:
        """Keys of a record read back that this version does not know (e.g. replysize's
        `omitted_after`), as they came."""
        back = self._back
        if back is None:
            return {}
        known = _specs(type(self))
        return {key: value for key, value in back.kept.items() if key not in known}


def plain(value: object) -> Any:
    """A field's value as the wire carries it."""
    if type(value) in _AS_IS:
        return value
    if isinstance(value, WireRecord):
        return value._wire()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


_AS_IS = frozenset({int, str, bool, float, type(None)})


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and not value)


# -- reading each field's type (from its annotation, once per class) ---------------------------

# name -> (reader, stand-in for an unread value, whether __init__ takes it)
_Spec = tuple[Reader, Callable[[], Any], bool]
_SPECS: dict[type, dict[str, _Spec]] = {}
_LAYOUTS: dict[type, tuple[tuple[str, Callable[[object], bool]], ...]] = {}
_BASE_FIELDS = frozenset({"unread", "_back"})


def _wire_fields(cls: type) -> list[Field[Any]]:
    """The fields that are keys on the wire: not the base's bookkeeping, nor a field
    declared with metadata {"wire": False} (what only this process needs to know)."""
    return [f for f in fields(cls) if f.name not in _BASE_FIELDS and f.metadata.get("wire", True)]


def _layout(cls: type[WireRecord]) -> tuple[tuple[str, Callable[[object], bool]], ...]:
    """The keys of the wire form, in order, each with when a record built here leaves it
    out: an OPTIONAL field typed `X | None` while None, another OPTIONAL field while empty,
    any other field never."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = tuple((f.name, _left_out(cls, f)) for f in _wire_fields(cls))
    return layout


def _left_out(cls: type[WireRecord], f: Field[Any]) -> Callable[[object], bool]:
    if f.name not in cls.OPTIONAL:
        return _never
    if str(f.type).replace(" ", "").endswith("|None"):
        return _is_none
    return _empty


def _never(value: object) -> bool:
    return False


def _is_none(value: object) -> bool:
    return value is None


def _specs(cls: type) -> dict[str, _Spec]:
    specs = _SPECS.get(cls)
    if specs is None:
        namespace = vars(sys.modules[cls.__module__])
        specs = {}
        for f in _wire_fields(cls):
            reader, zero = _reader(str(f.type), namespace)
            if "unread" in f.metadata:
                stand_in: Callable[[], Any] = _constant(f.metadata["unread"])
            elif f.default is not MISSING:
                stand_in = _constant(f.default)
            elif f.default_factory is not MISSING:
                stand_in = f.default_factory
            else:
                stand_in = zero
            specs[f.name] = (reader, stand_in, f.init)
        _SPECS[cls] = specs
    return specs


def _constant(value: object) -> Callable[[], Any]:
    return lambda: value


def _reader(annotation: str, namespace: Mapping[str, Any]) -> tuple[Reader, Callable[[], Any]]:
    """A reader and a zero for the annotations records use: int, str, bool, an enum, a
    record, list[...] and tuple[...] of those, and `X | None`."""
    text = annotation.replace(" ", "")
    if text.endswith("|None"):
        inner, _ = _reader(text[: -len("|None")], namespace)
        return (lambda value: (True, None) if value is None else inner(value)), _constant(None)
    if text.startswith("list[") and text.endswith("]"):
        item, _ = _reader(text[len("list["):-1], namespace)
        return _list_of(item), list
    if text.startswith("tuple[") and text.endswith("]"):  # a fixed pair of scalars: (pid, start)
        parts = [_reader(part, namespace)[0] for part in text[len("tuple["):-1].split(",")]
        return _tuple_of(parts), tuple
    if text in _SCALARS:
        return _SCALARS[text]
    kind = namespace.get(text)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return _enum_of(kind), _constant(next(iter(kind)))
    if isinstance(kind, type) and issubclass(kind, WireRecord):
        record = kind
        # A list of records keeps an item that is no dict as a record of its own (shown "?").
        return (lambda value: (True, record.from_dict(value))), lambda: record.from_dict({})
    raise TypeError(f"no wire reader for the annotation {annotation!r}")


def _is_int(value: object) -> tuple[bool, Any]:
    return (True, value) if isinstance(value, int) and not isinstance(value, bool) else (False, None)


def _is_str(value: object) -> tuple[bool, Any]:
    return (True, value) if isinstance(value, str) else (False, None)


def _is_bool(value: object) -> tuple[bool, Any]:
    return (True, value) if isinstance(value, bool) else (False, None)


_SCALARS: dict[str, tuple[Reader, Callable[[], Any]]] = {
    "int": (_is_int, _constant(0)), "str": (_is_str, _constant("")),
    "bool": (_is_bool, _constant(False))}


def _list_of(item: Reader) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        if not isinstance(value, list):
            return False, _as_texts(value, item)
        items = []
        for entry in value:
            ok, typed = item(entry)
            if not ok:
                return False, _as_texts(value, item)
            items.append(typed)
        return True, items
    return read


def _tuple_of(parts: list[Reader]) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        if not isinstance(value, (list, tuple)) or len(value) != len(parts):
            return False, None
        items = [part(entry) for part, entry in zip(parts, value)]
        return (True, tuple(v for _, v in items)) if all(ok for ok, _ in items) else (False, None)
    return read


def _as_texts(value: object, item: Reader) -> list[str] | None:
    """A list of texts (warnings) that is something else, salvaged as text to show: a lone
    string is one entry, a list's items are shown as they print."""
    if item is not _is_str or value is None or value == "":
        return None
    return [str(entry) for entry in value] if isinstance(value, list) else [str(value)]


def _enum_of(kind: type[Enum]) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        if not isinstance(value, str):
            return False, None
        try:
            return True, kind(value)
        except ValueError:
            return False, None
    return read

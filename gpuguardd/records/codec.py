"""Typed records to and from the plain dicts of D-Bus `a{sv}`, history.jsonl and `--json`.

to_dict() of a record built here gives every field in declaration order, but OPTIONAL ones while
empty. from_dict() reads someone else's dict (an old or edited history, a newer daemon) and never
raises: a key missing or mistyped is named in `unread` (printed "?") and stands in as the field's
`unread` metadata, else its default, else the type's zero. to_dict() of what was read gives it
back key for key, unknown keys included: a record passed through keeps its shape.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # for mypy only: Debian 12's python3 has no typing_extensions (nor typing.Self)
    from typing_extensions import Self

Wire = dict[str, Any]  # what to_dict gives, marshalling types and history.jsonl stores

Reader = Callable[[object], tuple[bool, Any]]  # (True, typed), or (False, None or what can be shown)


@dataclass
class WireRecord:
    """Base of the records that travel as dicts; subclasses are dataclasses."""

    # Keys left out while empty (a MIG UUID, a zombie's parent); an `X | None` one while None only.
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    unread: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _source: tuple[object] | None = field(default=None, init=False, repr=False, compare=False)

    def to_dict(self) -> Wire:
        wire = self._wire()
        return wire if isinstance(wire, dict) else {}

    def _wire(self) -> object:
        specs = _specs(type(self))
        if self._source is None:
            return {name: plain(value) for name, spec in specs.items()
                    if (value := getattr(self, name)) not in spec.empty}
        (source,) = self._source
        if not isinstance(source, Mapping):
            return source
        out: Wire = {}
        for name in specs:
            if name in source:
                out[name] = source[name] if name in self.unread else plain(getattr(self, name))
        out.update((key, value) for key, value in source.items() if key not in out)
        return out

    @classmethod
    def from_dict(cls, data: object) -> Self:
        specs = _specs(cls)
        values: dict[str, Any] = {}
        unread: set[str] = set()
        source: Mapping[Any, Any] = data if isinstance(data, Mapping) else {}
        for name, spec in specs.items():
            # A missing optional key is not unread: it is absent where it does not apply.
            ok, value = spec.read(source[name]) if name in source else (name in cls.OPTIONAL, None)
            if not ok:
                unread.add(name)
            # Missing, None or unread: a stand-in, unless a printer can still show some (list[str]).
            values[name] = value if value is not None else spec.stand_in()
        record = cls(**values)
        object.__setattr__(record, "unread", frozenset(unread))
        object.__setattr__(record, "_source", (data,))
        return record


def plain(value: object) -> Any:
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


class _Spec(NamedTuple):
    read: Reader
    stand_in: Callable[[], Any]  # the value of a key missing or unreadable
    empty: tuple[object, ...]  # the values for which a record built here leaves the key out


_SPECS: dict[type, dict[str, _Spec]] = {}


def _specs(cls: type[WireRecord]) -> dict[str, _Spec]:
    """The wire's keys in order: the fields but the base's and those with metadata {"wire": False}."""
    if cls in _SPECS:
        return _SPECS[cls]
    namespace = vars(sys.modules[cls.__module__])
    specs: dict[str, _Spec] = {}
    for f in fields(cls):
        if f.name in ("unread", "_source") or not f.metadata.get("wire", True):
            continue
        annotation = str(f.type).replace(" ", "")
        reader, zero = _reader(annotation, namespace)
        given = f.metadata.get("unread", f.default)
        factory = f.default_factory if f.default_factory is not MISSING else zero
        stand_in = _constant(given) if given is not MISSING else factory
        empty: tuple[object, ...] = ()
        if f.name in cls.OPTIONAL:
            empty = (None,) if annotation.endswith("|None") else (None, "", [], ())
        specs[f.name] = _Spec(reader, stand_in, empty)
    _SPECS[cls] = specs
    return specs


def _constant(value: object) -> Callable[[], Any]:
    return lambda: value


def _reader(text: str, namespace: Mapping[str, Any]) -> tuple[Reader, Callable[[], Any]]:
    if text.endswith("|None"):
        inner, _ = _reader(text[: -len("|None")], namespace)
        return (lambda value: (True, None) if value is None else inner(value)), _constant(None)
    if text.startswith("list[") and text.endswith("]"):
        item, _ = _reader(text[len("list["):-1], namespace)
        return _list_of(item, salvage=text == "list[str]"), list
    if text.startswith("tuple[") and text.endswith("]"):  # a fixed pair of scalars: (pid, start)
        parts = [_reader(part, namespace)[0] for part in text[len("tuple["):-1].split(",")]
        return _tuple_of(parts), tuple
    if text in _SCALARS:
        scalar = _SCALARS[text]
        return _scalar(scalar), _constant(scalar())
    kind = namespace.get(text)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return _enum_of(kind), _constant(next(iter(kind)))
    if isinstance(kind, type) and issubclass(kind, WireRecord):
        # A list of records keeps an item that is no dict as a record of its own (shown "?").
        return (lambda value: (True, kind.from_dict(value))), lambda: kind.from_dict({})
    raise TypeError(f"no wire reader for the annotation {text!r}")


_SCALARS: dict[str, type] = {"int": int, "str": str, "bool": bool}


def _scalar(kind: type) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return True, value
        return False, None
    return read


def _list_of(item: Reader, salvage: bool) -> Reader:
    """`salvage`: a list of texts given as something else still shows: a string as one entry, items as text."""
    def read(value: object) -> tuple[bool, Any]:
        if isinstance(value, list):
            items = [item(entry) for entry in value]
            if all(ok for ok, _ in items):
                return True, [typed for _, typed in items]
        if not salvage or value is None or value == "":
            return False, None
        return False, ([str(entry) for entry in value] if isinstance(value, list) else [str(value)])
    return read


def _tuple_of(parts: list[Reader]) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        if not isinstance(value, (list, tuple)) or len(value) != len(parts):
            return False, None
        items = [part(entry) for part, entry in zip(parts, value)]
        return (True, tuple(v for _, v in items)) if all(ok for ok, _ in items) else (False, None)
    return read


def _enum_of(kind: type[Enum]) -> Reader:
    def read(value: object) -> tuple[bool, Any]:
        try:
            return (True, kind(value)) if isinstance(value, str) else (False, None)
        except ValueError:
            return False, None
    return read

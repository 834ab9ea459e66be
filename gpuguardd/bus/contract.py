"""The D-Bus interface as dbus/org.gpuguard.GpuGuard1.xml defines it (its header comment describes
the annotations), read once. No dbus_fast here: gpuguardctl reads it without it.

The build installs the file next to this module (setup.py's build_py, `make install`), so the
daemon serves the definition of the code it runs; a checkout has no copy or link there (tools
that copy regular files lose links) and reads dbus/ itself.
"""

from __future__ import annotations

import functools
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

XML_NAME = "org.gpuguard.GpuGuard1.xml"
_INSTALLED = Path(__file__).with_name(XML_NAME)
# A checkout (tests, an editable install).
_SOURCE_TREE = Path(__file__).resolve().parents[2] / "dbus" / XML_NAME
XML_PATH = _INSTALLED if _INSTALLED.is_file() or not _SOURCE_TREE.is_file() else _SOURCE_TREE

_PREFIX = "org.gpuguard.GpuGuard1."
KEYS = _PREFIX + "Keys"  # on an argument or property: the dictionary it is
KEYS_DEFINITION = KEYS + "."  # on an interface: Keys.<Name> defines the dictionary <Name>
AUTHORIZATION = _PREFIX + "Authorization"
DICT_SIGNATURES = ("a{sv}", "aa{sv}")
_KEY = re.compile(r"^(?P<key>[a-z][a-z0-9_]*):(?P<types>[^=]+)(?:=(?P<keys>[A-Za-z]\w*))?$")
_SIGNATURE = re.compile(r"^[ybnqiuxtdsogva{}()]+$")


class ContractError(ValueError):
    """The XML is not what this module understands (a packaging or editing mistake)."""


@dataclass(frozen=True)
class KeyType:
    """One key of a typed dictionary: its signatures (replies carry the first, options take any)
    and, for a{sv} or aa{sv}, the dictionary its values are."""

    signatures: tuple[str, ...]
    dictionary: Dictionary | None = None


Dictionary = Mapping[str, KeyType]


@dataclass(frozen=True)
class Rule:
    """Who may call a method. `action` empty: anyone; else root or whom polkit grants it
    (anyone for a dry run if `dry_run_public`)."""

    action: str = ""
    dry_run_public: bool = False

    def needs(self, dry_run: bool) -> str:
        return "" if self.dry_run_public and dry_run else self.action

    @classmethod
    def parse(cls, text: str) -> Rule:
        words = text.split()
        if words == ["public"]:
            return cls()
        if not words or not words[0].startswith("polkit:") or len(words[0]) == len("polkit:"):
            raise ContractError(f"authorization {text!r}: expected public or polkit:<action>")
        extra = words[1:]
        if extra not in ([], ["dry_run:public"]):
            raise ContractError(f"authorization {text!r}: unknown {' '.join(extra)!r}")
        return cls(action=words[0].removeprefix("polkit:"), dry_run_public=bool(extra))


@dataclass(frozen=True)
class Arg:
    name: str
    signature: str
    keys: str = ""  # the dictionary of an a{sv} or aa{sv} argument


@dataclass(frozen=True)
class Method:
    name: str
    in_args: tuple[Arg, ...]
    out_args: tuple[Arg, ...]
    rule: Rule | None  # None: no Authorization annotation, so nobody may call it

    @property
    def in_signature(self) -> str:
        return "".join(a.signature for a in self.in_args)


@dataclass(frozen=True)
class Signal:
    name: str
    args: tuple[Arg, ...]

    @property
    def signature(self) -> str:
        return "".join(a.signature for a in self.args)


@dataclass(frozen=True)
class Property:
    name: str
    signature: str
    access: str
    keys: str = ""


@dataclass(frozen=True)
class Interface:
    name: str
    methods: Mapping[str, Method]
    signals: Mapping[str, Signal]
    properties: Mapping[str, Property]
    element: ET.Element  # the file's <interface>, for Introspect


class Contract:
    """The interfaces and typed dictionaries of one introspection document."""

    def __init__(self, xml_text: str) -> None:
        root = ET.fromstring(xml_text)
        elements = [e for e in root.iter("interface") if e.get("name", "").startswith(_PREFIX)]
        definitions = [(a.get("name", "").removeprefix(KEYS_DEFINITION), a.get("value", ""))
                       for e in elements for a in e.findall("annotation")
                       if a.get("name", "").startswith(KEYS_DEFINITION)]
        # Every name first: a key's value may be a dictionary defined further down.
        self.dictionaries: dict[str, dict[str, KeyType]] = {}
        for name, _ in definitions:
            if name in self.dictionaries:
                raise ContractError(f"dictionary {name} defined twice")
            self.dictionaries[name] = {}
        for name, text in definitions:
            self._define(name, text)
        self.interfaces: dict[str, Interface] = {e.get("name", ""): self._interface(e) for e in elements}

    def _define(self, name: str, text: str) -> None:
        keys = self.dictionaries[name]
        for word in text.split():
            match = _KEY.match(word)
            if match is None:
                raise ContractError(f"dictionary {name}: {word!r} is not key:type")
            signatures = tuple(match["types"].split("|"))
            if not all(_SIGNATURE.match(s) for s in signatures) or match["key"] in keys:
                raise ContractError(f"dictionary {name}: bad or repeated key {word!r}")
            if (match["keys"] is not None) != (signatures[0] in DICT_SIGNATURES):
                raise ContractError(f"dictionary {name}: {word!r}: a{{sv}}/aa{{sv}} keys name "
                                    "their dictionary (=Name), other types none")
            nested = self.dictionaries[self._known(match["keys"])] if match["keys"] else None
            keys[match["key"]] = KeyType(signatures, nested)

    def _known(self, keys: str) -> str:
        if keys and keys not in self.dictionaries:
            raise ContractError(f"unknown dictionary {keys!r}")
        return keys

    def _keys_of(self, element: ET.Element, signature: str, where: str) -> str:
        names = [a.get("value", "") for a in element.findall("annotation") if a.get("name") == KEYS]
        if signature in DICT_SIGNATURES and len(names) != 1:
            raise ContractError(f"{where}: an {signature} names its dictionary ({KEYS})")
        if signature not in DICT_SIGNATURES and names:
            raise ContractError(f"{where}: only an a{{sv}} or aa{{sv}} has keys")
        return self._known(names[0]) if names else ""

    def _arg(self, element: ET.Element, where: str) -> Arg:
        name, signature = element.get("name", ""), element.get("type", "")
        return Arg(name, signature, self._keys_of(element, signature, f"{where} argument {name}"))

    def _interface(self, element: ET.Element) -> Interface:
        iface = element.get("name", "")
        methods: dict[str, Method] = {}
        for m in element.findall("method"):
            name = m.get("name", "")
            args = m.findall("arg")
            rules = [a.get("value", "") for a in m.findall("annotation") if a.get("name") == AUTHORIZATION]
            if len(rules) > 1:
                raise ContractError(f"{iface}.{name}: more than one authorization")
            methods[name] = Method(
                name,
                tuple(self._arg(a, f"{iface}.{name}") for a in args if a.get("direction", "in") == "in"),
                tuple(self._arg(a, f"{iface}.{name}") for a in args if a.get("direction") == "out"),
                Rule.parse(rules[0]) if rules else None)
        signals = {s.get("name", ""): Signal(s.get("name", ""),
                                             tuple(self._arg(a, f"{iface}.{s.get('name')}")
                                                   for a in s.findall("arg")))
                   for s in element.findall("signal")}
        properties = {p.get("name", ""): Property(
            p.get("name", ""), p.get("type", ""), p.get("access", ""),
            self._keys_of(p, p.get("type", ""), f"{iface}.{p.get('name')}"))
            for p in element.findall("property")}
        return Interface(iface, methods, signals, properties, element)

    def introspection(self, name: str) -> ET.Element:
        """A copy of interface `name`'s element as Introspect serves it, multi-line annotation
        values folded (documentation is in comments, which the parser drops)."""
        copy = ET.fromstring(ET.tostring(self.interfaces[name].element))
        for annotation in copy.iter("annotation"):
            annotation.set("value", " ".join(annotation.get("value", "").split()))
        for element in copy.iter():
            element.text = element.tail = None
        return copy


@functools.cache
def contract() -> Contract:
    try:
        text = XML_PATH.read_text(encoding="utf-8")
    except OSError as exc:
        raise ContractError(f"cannot read the D-Bus interface definition {XML_PATH}: {exc}") from None
    return Contract(text)


def interface(name: str) -> Interface:
    return contract().interfaces[name]

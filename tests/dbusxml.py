"""Canonical form of D-Bus introspection XML, to hold the running daemon to dbus/*.xml.

Two documents are equal in canonical form when they declare the same interfaces with the
same members, argument names, types and directions, property access, and annotations (on
interfaces, members and arguments: the contract's keys and authorization rules are
annotations). Documentation (comments, org.gtk.GDBus.DocString* annotations), whitespace
(also inside annotation values), member order and the standard org.freedesktop.DBus.*
interfaces (which the bus library adds to every object) do not count. Argument order does:
it is part of a signature.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable

from gpuguardd.bus.contract import XML_PATH

INTERFACE_XML = XML_PATH
STANDARD_PREFIX = "org.freedesktop.DBus."
_DOC_ANNOTATION = "org.gtk.GDBus.DocString"

Member = tuple[str, str, tuple[tuple[str, ...], ...]]


def _annotations(element: ET.Element) -> tuple[tuple[str, ...], ...]:
    return tuple(sorted(
        ("annotation", a.get("name", ""), " ".join(a.get("value", "").split()))
        for a in element.findall("annotation")
        if not a.get("name", "").startswith(_DOC_ANNOTATION)))


def _args(element: ET.Element, kind: str) -> tuple[tuple[str, ...], ...]:
    args = []
    for arg in element.findall("arg"):
        # Signal arguments have no direction (some libraries write "out"); methods default "in".
        direction = "" if kind == "signal" else arg.get("direction", "in")
        args.append(("arg", arg.get("name", ""), arg.get("type", ""), direction,
                     *("=".join(a) for a in _annotations(arg))))
    return tuple(args)


def _interface(element: ET.Element) -> tuple[Member, ...]:
    members: list[Member] = []
    for kind in ("method", "signal"):
        for child in element.findall(kind):
            members.append((kind, child.get("name", ""), (*_args(child, kind), *_annotations(child))))
    for prop in element.findall("property"):
        members.append(("property", prop.get("name", ""),
                        (("type", prop.get("type", ""), prop.get("access", "")), *_annotations(prop))))
    members.append(("interface-annotations", "", _annotations(element)))
    return tuple(sorted(members))


def interfaces(xml_text: str, include_standard: bool = False) -> dict[str, tuple[Member, ...]]:
    """Interface name -> canonical members, from one introspection document (nested nodes too)."""
    root = ET.fromstring(xml_text)
    found: dict[str, tuple[Member, ...]] = {}
    for element in root.iter("interface"):
        name = element.get("name", "")
        if name.startswith(STANDARD_PREFIX) and not include_standard:
            continue
        found[name] = _interface(element)
    return found


def merge(documents: Iterable[str]) -> dict[str, tuple[Member, ...]]:
    """The interfaces of several objects' introspection (each interface once; must agree)."""
    merged: dict[str, tuple[Member, ...]] = {}
    for text in documents:
        for name, members in interfaces(text).items():
            if name in merged and merged[name] != members:
                raise ValueError(f"interface {name} differs between objects")
            merged[name] = members
    return merged


def canonical(found: dict[str, tuple[Member, ...]]) -> str:
    """A stable text form, one line per member, for readable diffs in test failures."""
    lines: list[str] = []
    for name in sorted(found):
        lines.append(f"interface {name}")
        for kind, member, details in found[name]:
            lines.append(f"  {kind} {member} " + " ".join("/".join(d) for d in details))
    return "\n".join(lines) + "\n"


def contract() -> dict[str, tuple[Member, ...]]:
    return interfaces(INTERFACE_XML.read_text(encoding="utf-8"))

"""The contract XML as the one definition: what is derived from it, what it refuses, and
authorization declared per method and denied by default.

No restatement of the interface here: every expectation is read from the XML, or from a
copy of it changed on purpose.
"""

from __future__ import annotations

import asyncio
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import DBusError, Variant

from gpuguardd.bus import contract, marshal
from gpuguardd.bus.contract import Contract, ContractError, Rule
from gpuguardd.bus.interfaces import ContractInterface, GpuInterface, ManagerInterface
from gpuguardd.bus.names import ERROR_PREFIX, GPU_INTERFACE, MANAGER_INTERFACE
from gpuguardd.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[3]
XML = (ROOT / "dbus" / contract.XML_NAME).read_text(encoding="utf-8")
POLICY = ROOT / "dbus" / "org.gpuguard.GpuGuard1.policy"
NOT_AUTHORIZED = ERROR_PREFIX + "NotAuthorized"


def without_rule(text: str, member: str) -> str:
    """The XML with `member`'s Authorization annotation taken out."""
    changed = re.sub(rf'(<method name="{member}">\s*)<annotation name="{re.escape(contract.AUTHORIZATION)}"'
                     r'\s+value="[^"]*"/>', r"\1", text)
    assert changed != text
    return changed


def placeholder(signature: str) -> Any:
    """A value of `signature` for a property table (its contents do not matter here)."""
    return {"s": "", "b": False, "as": [], "a{sv}": {}, "aa{sv}": []}.get(signature, 0)


def manager_values() -> dict[str, Any]:
    return {name: placeholder(p.signature)
            for name, p in contract.interface(MANAGER_INTERFACE).properties.items()}


def dispatch(interface: ContractInterface, member: str, *args: Any) -> Any:
    """Call `member` as dbus-fast does for a message: through the interface's handler."""
    return asyncio.run(getattr(type(interface), member).__wrapped__(interface, *args))


def call_error(interface: ContractInterface, member: str, *args: Any) -> DBusError:
    with pytest.raises(DBusError) as raised:
        dispatch(interface, member, *args)
    return raised.value


# -- the installed contract is the repository's file ----------------------------------------

def test_the_package_reads_the_file_in_dbus() -> None:
    # In the source tree the package reads dbus/ itself: one file, no copy or link.
    assert contract.XML_PATH.resolve() == (ROOT / "dbus" / contract.XML_NAME).resolve()
    assert set(contract.contract().interfaces) == {MANAGER_INTERFACE, GPU_INTERFACE}


# -- authorization: declared for each method, denied by default ------------------------------

def test_a_requests_options_are_the_sweep_options_and_read_back_whole() -> None:
    """SweepRequest.options/from_options is the one codec of SweepOptions; a request read from
    a call's options is a fresh record whose to_dict has every key (the in-flight file's)."""
    from gpuguardd.records.models import SweepRequest

    assert set(SweepRequest.OPTIONS) == set(contract.contract().dictionaries[marshal.SWEEP])
    request = SweepRequest(gpus=["0", "GPU-x"], grace_ms=0, dry_run=False, slurm_job="7", slurm_uid=5)
    options = request.options()
    assert options == {"gpus": ["0", "GPU-x"], "grace_ms": 0, "dry_run": False, "slurm_job": "7", "slurm_uid": 5}
    back = SweepRequest.from_options({**options, "gpus": [0, "GPU-x"], "fresh": True})
    assert back == request and back.to_dict() == request.to_dict()
    assert set(SweepRequest.from_options({}).to_dict()) == set(SweepRequest().to_dict())


def test_every_method_of_the_xml_declares_a_rule_naming_a_shipped_polkit_action() -> None:
    actions = {a.get("id") for a in ET.parse(POLICY).getroot().iter("action")}
    methods = [m for i in contract.contract().interfaces.values() for m in i.methods.values()]
    assert methods
    undeclared = [m.name for m in methods if m.rule is None]
    assert undeclared == [], f"methods without org.gpuguard.GpuGuard1.Authorization: {undeclared}"
    for m in methods:
        assert m.rule is not None
        assert not m.rule.action or m.rule.action in actions, (m.name, m.rule)
    # The XML's rules, as the interface applies them.
    assert any(m.rule is not None and not m.rule.action for m in methods)
    assert any(m.rule is not None and m.rule.dry_run_public for m in methods)


def test_a_method_without_a_rule_is_refused_to_everyone_before_anything_runs() -> None:
    assert Contract(without_rule(XML, "Reload")).interfaces[MANAGER_INTERFACE].methods["Reload"].rule is None
    definition = Contract("""<node><interface name="org.gpuguard.GpuGuard1.Test">
      <method name="Reload"/>
    </interface></node>""")

    class Unruled(ContractInterface, interface="org.gpuguard.GpuGuard1.Test", definition=definition):
        async def Reload(self) -> None:
            raise AssertionError("past the gate")  # would be answered Failed, not NotAuthorized

    error = call_error(Unruled({}), "Reload")
    assert error.type == NOT_AUTHORIZED
    assert "Reload declares no authorization" in str(error.text)
    # The Manager with the installed rules gets past the gate (and then has no backend).
    error = call_error(ManagerInterface(None, manager_values()), "Reload")  # type: ignore[arg-type]
    assert error.type == ERROR_PREFIX + "Failed"
    # A new interface's method without a rule, called over a bus: tests/bus/test_contract_gate.py.


@pytest.mark.parametrize(("text", "rule"), [
    ("public", Rule()),
    ("polkit:org.gpuguard.GpuGuard1.reload", Rule("org.gpuguard.GpuGuard1.reload")),
    ("polkit:a.b.sweep  dry_run:public", Rule("a.b.sweep", dry_run_public=True)),
])
def test_rules_parse(text: str, rule: Rule) -> None:
    assert Rule.parse(text) == rule


@pytest.mark.parametrize("text", ["", "anyone", "polkit:", "public dry_run:public",
                                  "polkit:a.b dry_run:yes", "polkit:a.b dry_run:public extra"])
def test_a_rule_that_is_not_understood_is_refused_at_load(text: str) -> None:
    with pytest.raises(ContractError):
        Rule.parse(text)


def test_a_dry_run_needs_no_action_only_where_declared() -> None:
    sweep = Rule("x.sweep", dry_run_public=True)
    assert sweep.needs(dry_run=True) == "" and sweep.needs(dry_run=False) == "x.sweep"
    assert Rule("x.reload").needs(dry_run=True) == "x.reload"
    assert Rule().needs(dry_run=False) == ""


# -- signatures, arguments and properties come from the XML -----------------------------------

def test_the_interfaces_take_every_signature_from_the_xml() -> None:
    for interface, iface in ((ManagerInterface(None, manager_values()),  # type: ignore[arg-type]
                              contract.interface(MANAGER_INTERFACE)),
                             (GpuInterface({}), contract.interface(GPU_INTERFACE))):
        served = interface.introspect()
        assert {m.name: m.in_signature for m in served.methods} == \
            {m.name: m.in_signature for m in iface.methods.values()}
        assert {p.name: p.signature for p in served.properties} == \
            {p.name: p.signature for p in iface.properties.values()}


def test_a_python_member_must_match_the_xml() -> None:
    definition = Contract("""<node><interface name="org.gpuguard.GpuGuard1.Test">
      <method name="Do">
        <annotation name="org.gpuguard.GpuGuard1.Authorization" value="public"/>
        <arg name="count" type="u" direction="in"/>
      </method>
      <signal name="Done"><arg name="id" type="s"/></signal>
      <property name="Size" type="u" access="read"/>
    </interface></node>""")
    name = "org.gpuguard.GpuGuard1.Test"
    with pytest.raises(TypeError, match="Do is in the XML but not implemented"):
        class Missing(ContractInterface, interface=name, definition=definition):
            def Done(self, id_: str) -> None: ...
    with pytest.raises(TypeError, match=r"Do takes \(n\), the XML \(count\)"):
        class Renamed(ContractInterface, interface=name, definition=definition):
            async def Do(self, n: int) -> None: ...

            def Done(self, id_: str) -> None: ...
    with pytest.raises(TypeError, match="Undo is not a member of the XML"):
        class Extra(ContractInterface, interface=name, definition=definition):
            async def Do(self, count: int) -> None: ...

            def Done(self, id_: str) -> None: ...

            async def Undo(self) -> None: ...
    with pytest.raises(TypeError, match="Size is served from the table"):
        class Getter(ContractInterface, interface=name, definition=definition):
            async def Do(self, count: int) -> None: ...

            def Done(self, id_: str) -> None: ...

            def Size(self) -> int:
                return 1

    class Right(ContractInterface, interface=name, definition=definition):
        async def Do(self, count: int) -> None: ...

        def Done(self, id_: str) -> None: ...

    with pytest.raises(ValueError, match="no value for Size"):
        Right({})
    right = Right({"Size": 3})
    assert right._values["Size"] == 3
    assert right.Done("x") == "x"  # type: ignore[func-returns-value]  # what dbus-fast emits
    with pytest.raises(TypeError):
        right.Done("x", "y")  # type: ignore[call-arg]


def test_gpu_properties_are_the_xml_table_typed_from_an_engine_summary() -> None:
    gpu = GpuInterface({"index": 2, "uuid": "GPU-1", "memory_total": 5, "mig_mode": 1,
                        "mig_instances": [{"uuid": "MIG-1", "memory_used": 7}], "error": None})
    properties = contract.interface(GPU_INTERFACE).properties
    assert gpu._values["Index"] == 2 and gpu._values["Uuid"] == "GPU-1" and gpu._values["MemoryTotal"] == 5
    assert gpu._values["MigMode"] is True and gpu._values["Error"] == "" and gpu._values["Minor"] == 0
    assert gpu._values["MigInstances"] == [{"uuid": Variant("s", "MIG-1"), "memory_used": Variant("t", 7)}]
    assert set(gpu._values) == set(properties)


# -- the typed dictionaries: options checked and replies typed from the XML's keys ------------

def test_dictionaries_are_read_from_the_annotations() -> None:
    changed = XML.replace(" fresh:b", " fresh:b later:t|s").replace(" ppid:u", " ppid:u nice:x")
    definition = Contract(changed)
    assert definition.dictionaries["Filter"]["later"].signatures == ("t", "s")
    assert definition.dictionaries["Holder"]["nice"] == contract.KeyType(("x",))
    scope = definition.dictionaries["Report"]["scope"]
    assert scope.signatures == ("a{sv}",) and scope.dictionary is definition.dictionaries["Scope"]
    # marshal serves exactly the installed XML's dictionaries.
    assert contract.contract().dictionaries["Holder"] is marshal.HOLDER
    assert contract.contract().dictionaries["Report"] is marshal.REPORT


@pytest.mark.parametrize(("find", "replace", "message"), [
    ('value="Filter"', 'value="Nope"', "unknown dictionary 'Nope'"),
    ("scope:a{sv}=Scope", "scope:a{sv}", "name their dictionary"),
    (" dry_run:b", " dry_run:b dry_run:b", "bad or repeated key"),
    (" fresh:b", " fresh", "is not key:type"),
    ('<arg name="filter" type="a{sv}" direction="in">\n'
     '        <annotation name="org.gpuguard.GpuGuard1.Keys" value="Filter"/>',
     '<arg name="filter" type="a{sv}" direction="in">', "names its dictionary"),
])
def test_a_contract_that_is_not_understood_is_refused_at_load(find: str, replace: str, message: str) -> None:
    assert find in XML
    with pytest.raises(ContractError, match=re.escape(message)):
        Contract(XML.replace(find, replace, 1))


def test_options_are_checked_against_the_xml_keys() -> None:
    for dictionary in (marshal.FILTER, marshal.SWEEP):
        spec = contract.contract().dictionaries[dictionary]
        label = dictionary.removesuffix("Options").lower()
        with pytest.raises(InvalidArgument, match=f"unknown {label} option 'bogus'"):
            marshal.parse_options({"bogus": Variant("b", True)}, dictionary)
        for key, kind in spec.items():
            signatures = kind.signatures
            wrong = "d" if "d" not in signatures else "y"
            with pytest.raises(InvalidArgument, match=f"'{key}' must be of type {' or '.join(signatures)}"):
                marshal.parse_options({key: Variant(wrong, 1.0 if wrong == "d" else 1)}, dictionary)


def test_a_caller_sends_options_as_the_xml_types_them() -> None:
    assert marshal.option(marshal.SWEEP, "grace_ms", 5) == Variant(
        contract.contract().dictionaries[marshal.SWEEP]["grace_ms"].signatures[0], 5)
    assert marshal.option(marshal.SWEEP, "gpus", ["MIG-1"], "as").signature == "as"
    with pytest.raises(ValueError, match="not ai"):
        marshal.option(marshal.SWEEP, "gpus", [1], "ai")


def test_property_names_map_to_engine_keys_by_one_rule() -> None:
    assert marshal.snake_case("MemoryTotal") == "memory_total"
    assert marshal.snake_case("PciBusId") == "pci_bus_id"
    assert marshal.snake_case("Index") == "index"

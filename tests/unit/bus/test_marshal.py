"""The service's parts without a bus: the canonical form of introspection, typed variants, option checks,
who a sweep is recorded for, and the D-Bus/polkit files as installed.
"""

from __future__ import annotations

import logging

import pytest
from dbus_fast import Variant

from gpuguardd.bus import marshal
from gpuguardd.errors import InvalidArgument
from tests import dbusxml


def test_canonical_form_ignores_docs_but_not_types() -> None:
    text = dbusxml.INTERFACE_XML.read_text()
    reordered = text.replace("<!--", "<!-- changed docs ").replace("  ", " ")
    assert dbusxml.canonical(dbusxml.interfaces(reordered)) == dbusxml.canonical(dbusxml.contract())
    changed = text.replace('<property name="MemoryUsed" type="t"', '<property name="MemoryUsed" type="u"')
    assert dbusxml.canonical(dbusxml.interfaces(changed)) != dbusxml.canonical(dbusxml.contract())
    renamed = text.replace('<arg name="count" type="u"', '<arg name="n" type="u"')
    assert dbusxml.canonical(dbusxml.interfaces(renamed)) != dbusxml.canonical(dbusxml.contract())
    # Annotations count (keys and rules), their values' line breaks do not.
    rekeyed = text.replace('value="Filter"', 'value="SweepOptions"')
    assert dbusxml.canonical(dbusxml.interfaces(rekeyed)) != dbusxml.canonical(dbusxml.contract())
    retyped = text.replace(" fresh:b", " fresh:u")
    assert dbusxml.canonical(dbusxml.interfaces(retyped)) != dbusxml.canonical(dbusxml.contract())
    refolded = text.replace("mig_uuid:s\"/>", "\n  mig_uuid:s\n\"/>")
    assert refolded != text
    assert dbusxml.canonical(dbusxml.interfaces(refolded)) == dbusxml.canonical(dbusxml.contract())


def test_report_keys_get_the_contract_signatures() -> None:
    report = {"id": "abc", "started_usec": 1_700_000_000_000_000, "duration_ms": 12,
              "requested_by": "uid 0 (root) :1.4", "reason": "", "dry_run": False,
              "scope": {"gpus": [0, 1], "unit": "", "container": "", "include_management": False,
                        "grace_ms": 10000},
              "outcome": "freed", "verified": True, "targets": [],
              "terminated": [{"pid": 42, "comm": "python", "unit": "a.service", "signal": "SIGTERM",
                              "exited_after_ms": 3}],
              "survived": [], "spared": [],
              "gpus": [{"index": 0, "uuid": "GPU-1", "memory_used_before": 2**33,
                        "memory_used_after": 0, "memory_total": 2**36, "released": True}],
              "leaks": [{"gpu": 1, "uuid": "GPU-2", "bytes": 5}], "warnings": ["w"], "error": "",
              "new_key_from_a_later_engine": -3}
    typed = marshal.report(report)
    assert {k: v.signature for k, v in typed.items()} == {
        "id": "s", "started_usec": "t", "duration_ms": "u", "requested_by": "s", "reason": "s",
        "dry_run": "b", "scope": "a{sv}", "outcome": "s", "verified": "b", "targets": "aa{sv}",
        "terminated": "aa{sv}", "survived": "aa{sv}", "spared": "aa{sv}", "gpus": "aa{sv}",
        "leaks": "aa{sv}", "warnings": "as", "error": "s", "new_key_from_a_later_engine": "x"}
    assert {k: v.signature for k, v in typed["scope"].value.items()} == {
        "gpus": "au", "unit": "s", "container": "s", "include_management": "b", "grace_ms": "u"}
    terminated = typed["terminated"].value[0]
    assert terminated["pid"] == Variant("u", 42) and terminated["exited_after_ms"].signature == "u"
    gpu = typed["gpus"].value[0]
    assert gpu["memory_used_before"] == Variant("t", 2**33) and gpu["index"].signature == "u"
    assert typed["leaks"].value[0]["bytes"].signature == "t"
    assert marshal.unwrap(typed) == report


@pytest.mark.parametrize("adopted", [[], [4242, 4243]])
def test_a_unit_sweeps_adopted_pids_are_au_as_the_contract_says(adopted: list[int]) -> None:
    # docs/contract.md: the scope "carries ... adopted_pids au"; before the XML typed it, it went out
    # inferred: `at`, or `as` for an empty list.
    typed = marshal.scope({"gpus": [0], "unit": "a.service", "adopted_pids": adopted})
    assert typed["adopted_pids"] == Variant("au", adopted)


def test_a_value_that_does_not_fit_is_sent_inferred_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpuguard.marshal"):
        typed = marshal.holder({"pid": 2**40, "gpu_memory": None, "gpus": "0"})
    assert typed["pid"] == Variant("t", 2**40)
    assert "gpu_memory" not in typed
    assert typed["gpus"] == Variant("s", "0")
    assert "'pid'" in caplog.text and "'gpus'" in caplog.text


@pytest.mark.parametrize(("options", "message"), [
    ({"bogus": Variant("b", True)}, "unknown sweep option 'bogus'"),
    ({"gpus": Variant("ai", [0])}, "'gpus' must be of type au or as, got ai"),
    ({"reason": Variant("s", "a\x1b[2Jb")}, "control characters"),
    ({"unit": Variant("s", "x" * 2000)}, "too long"),
])
def test_options_are_checked(options: dict[str, Variant], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[")):
        marshal.parse_options(options, marshal.SWEEP)


def test_valid_options_become_plain_values() -> None:
    parsed = marshal.parse_options({"gpus": Variant("au", [1, 0]), "dry_run": Variant("b", True),
                                    "grace_ms": Variant("u", 500)}, marshal.SWEEP)
    assert parsed == {"gpus": [1, 0], "dry_run": True, "grace_ms": 500}


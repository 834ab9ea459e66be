"""The service's parts without a bus: the canonical form of introspection, typed variants, option checks,
who a sweep is recorded for, and the D-Bus/polkit files as installed.
"""

from __future__ import annotations

import asyncio
import configparser
import logging
import shutil
import subprocess
import threading
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Variant

from gpuguardd.bus import marshal
from gpuguardd.bus.auth import Caller
from gpuguardd.daemon import inventory as inv
from gpuguardd.daemon.notify import watchdog_interval
from gpuguardd.daemon.service import requester
from gpuguardd.errors import InvalidArgument
from gpuguardd.records.models import Holder, NvmlSnapshot, ScanResult
from tests import dbusxml

ROOT = Path(__file__).resolve().parents[3]
DBUS = ROOT / "dbus"


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


# -- typed variants --------------------------------------------------------------------------

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


def requested_by(caller: Caller, reason: str) -> str:
    return requester(caller, reason)[0]


def test_requested_by() -> None:
    root = Caller(sender=":1.42", uid=0, user="root", interactive=False)
    alice = Caller(sender=":1.43", uid=1000, user="alice", interactive=True)
    assert requested_by(alice, "") == "uid 1000 (alice) :1.43"
    assert requested_by(root, "hook:train.service result=exit-code") == "hook:train.service"
    # Only root is the hook; anyone else claiming to be is still named.
    assert requested_by(alice, "hook:train.service") == "hook:train.service via uid 1000 (alice) :1.43"
    assert requested_by(root, "cleanup after the outage") == "uid 0 (root) :1.42"


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None


# -- the files installed with the daemon -----------------------------------------------------

def xmllint(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("xmllint") is None:
        pytest.fail("xmllint is required (libxml2-utils)")
    return subprocess.run(["xmllint", "--noout", *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("name", ["org.gpuguard.GpuGuard1.xml", "org.gpuguard.GpuGuard1.conf",
                                  "org.gpuguard.GpuGuard1.policy"])
def test_xml_files_are_well_formed(name: str) -> None:
    result = xmllint(str(DBUS / name))
    assert result.returncode == 0, result.stderr


def test_polkit_policy_is_valid_and_has_the_actions() -> None:
    dtd = Path("/usr/share/polkit-1/policyconfig-1.dtd")
    if dtd.exists():
        result = xmllint("--dtdvalid", str(dtd), str(DBUS / "org.gpuguard.GpuGuard1.policy"))
        assert result.returncode == 0, result.stderr
    root = ET.parse(DBUS / "org.gpuguard.GpuGuard1.policy").getroot()
    actions = {a.get("id"): a for a in root.findall("action")}
    assert set(actions) == {"org.gpuguard.GpuGuard1.sweep", "org.gpuguard.GpuGuard1.view-details",
                            "org.gpuguard.GpuGuard1.reload", "org.gpuguard.GpuGuard1.reset-gpu"}
    for name, action in actions.items():
        defaults = action.find("defaults")
        assert defaults is not None
        assert defaults.findtext("allow_any") == "auth_admin"
        assert defaults.findtext("allow_inactive") == "auth_admin"
        # A reset asks every time: an authorization kept for minutes would let a second one
        # through unasked.
        assert defaults.findtext("allow_active") == (
            "auth_admin" if str(name).endswith(".reset-gpu") else "auth_admin_keep")


def test_bus_policy_lets_only_root_own_the_name() -> None:
    root = ET.parse(DBUS / "org.gpuguard.GpuGuard1.conf").getroot()
    owners = [(p.get("user"), p.get("context"), a.get("own"))
              for p in root.findall("policy") for a in p.findall("allow") if a.get("own")]
    assert owners == [("root", None, "org.gpuguard.GpuGuard1")]
    default = next(p for p in root.findall("policy") if p.get("context") == "default")
    callable_interfaces = {a.get("send_interface") for a in default.findall("allow")
                           if a.get("send_destination") == "org.gpuguard.GpuGuard1"}
    assert callable_interfaces == {
        "org.gpuguard.GpuGuard1.Manager", "org.gpuguard.GpuGuard1.Gpu",
        "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Introspectable",
        "org.freedesktop.DBus.Peer", "org.freedesktop.DBus.ObjectManager"}
    assert not default.findall("deny")


def test_activation_file_hands_over_to_systemd() -> None:
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(DBUS / "org.gpuguard.GpuGuard1.service")
    assert dict(parser["D-BUS Service"]) == {"Name": "org.gpuguard.GpuGuard1", "Exec": "/bin/false",
                                             "User": "root", "SystemdService": "gpuguardd.service"}


# -- ListHolders' freshness rule (inventory.Inventory.recent) --------------------------------------

class FakeEngine:
    """Counts scans; each lists the holders present when it ran."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"released_below_mib": 0})()
        self.pids: list[int] = []
        self.scans = 0

    def scan(self) -> ScanResult:
        self.scans += 1
        return ScanResult(holders=[Holder(pid=p) for p in self.pids],
                          nvml=NvmlSnapshot(available=False, error="fake"))


class Listener:
    def inventory_changed(self, snapshot: NvmlSnapshot, summaries: list[dict[str, Any]]) -> None:
        pass

    def leak_suspected(self, index: int, uuid: str, used: int) -> None:
        pass


Scenario = Callable[[inv.Inventory, FakeEngine, list[float]], Awaitable[None]]


def run_on_a_clock(monkeypatch: pytest.MonkeyPatch, scenario: Scenario) -> None:
    """scenario(inventory, its FakeEngine, now): now[0] is the freshness rule's clock."""
    now = [1000.0]
    monkeypatch.setattr(inv, "clock", lambda: now[0])
    engine = FakeEngine()

    async def run() -> None:
        with ThreadPoolExecutor(1) as executor:
            await scenario(inv.Inventory(engine, executor, Listener()),  # type: ignore[arg-type]
                           engine, now)

    asyncio.run(run())


def test_list_holders_reuses_a_fresh_scan_only(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(inventory: inv.Inventory, engine: FakeEngine, now: list[float]) -> None:
        engine.pids = [10]
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        assert engine.scans == 1
        engine.pids = [10, 11]  # a holder appears after the scan started
        now[0] += inv.LIST_MAX_AGE_SEC * 0.9
        assert [h.pid for h in (await inventory.recent()).holders] == [10]  # served again
        assert engine.scans == 1
        now[0] += inv.LIST_MAX_AGE_SEC * 0.2  # the scan is now too old: a new one
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        assert engine.scans == 2
        engine.pids = [10, 11, 12]
        inventory.invalidate()  # a sweep, a reload, NVML's lists changed: at once
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11, 12]
        assert engine.scans == 3
        # scan() (the unit watch, sweeps) never reuses: it starts after the call.
        await inventory.scan()
        assert engine.scans == 4

    run_on_a_clock(monkeypatch, scenario)


def test_list_holders_refreshes_ahead_so_callers_do_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call served a result about to expire starts the next scan in the background; the call
    after the old result's expiry is served the new one without a scan of its own. The rule of
    what may be served is unchanged: the early call still gets the old, fresh result."""
    async def scenario(inventory: inv.Inventory, engine: FakeEngine, now: list[float]) -> None:
        engine.pids = [10]
        await inventory.recent()
        inventory.scan_cost = 0.05  # lead: 4 x 50 ms = 200 ms
        engine.pids = [10, 11]
        now[0] += inv.LIST_MAX_AGE_SEC - 0.3  # outside the lead: nothing started
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        await asyncio.sleep(0.05)
        assert engine.scans == 1
        now[0] += 0.15  # 150 ms before expiry: served the old result, next scan started
        assert [h.pid for h in (await inventory.recent()).holders] == [10]
        for _ in range(200):  # the background scan (a thread) ends
            if inventory._running is None:
                break
            await asyncio.sleep(0.01)
        assert engine.scans == 2
        now[0] += 0.2  # the first result has expired; the second is fresh
        engine.pids = [10, 11, 12]
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        assert engine.scans == 2  # served without waiting for a scan
        # A slow scan (a big host) is not run ahead, back to back: callers wait, as before.
        inventory.scan_cost = inv.REFRESH_MAX_SCAN_SEC * 1.5
        now[0] += inv.LIST_MAX_AGE_SEC - 0.25  # within 4 scan durations of the expiry
        assert [h.pid for h in (await inventory.recent()).holders] == [10, 11]
        await asyncio.sleep(0.05)
        assert engine.scans == 2 and inventory._running is None

    run_on_a_clock(monkeypatch, scenario)


def test_a_scan_older_than_an_invalidation_is_never_served(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    engine = FakeEngine()
    plain_scan = engine.scan

    def slow_scan() -> ScanResult:
        release.wait(10)
        return plain_scan()

    monkeypatch.setattr(engine, "scan", slow_scan)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            inventory = inv.Inventory(engine, executor, Listener())  # type: ignore[arg-type]
            first = asyncio.ensure_future(inventory.scan())
            await asyncio.sleep(0)
            inventory.invalidate()  # while the first scan runs: it may have missed the change
            second = asyncio.ensure_future(inventory.recent())
            await asyncio.sleep(0.05)
            release.set()
            await first
            await second
            assert engine.scans == 2  # recent() waited for a scan started after the event
            assert inventory.last_result is second.result()

    asyncio.run(scenario())


def test_a_scan_queued_when_the_daemon_stops_is_cancelled_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuguardd shuts its executors down while a scan may still run; the scan queued behind it
    cannot start then, and its waiters are cancelled instead of the loop logging a traceback."""
    engine = FakeEngine()
    release = threading.Event()
    plain_scan = engine.scan

    def slow_scan() -> ScanResult:
        release.wait(10)
        return plain_scan()

    monkeypatch.setattr(engine, "scan", slow_scan)
    errors: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        executor = ThreadPoolExecutor(1)
        inventory = inv.Inventory(engine, executor, Listener())  # type: ignore[arg-type]
        first = asyncio.ensure_future(inventory.scan())
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(inventory.scan())  # behind the running one
        await asyncio.sleep(0)
        executor.shutdown(wait=False)
        release.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await queued

    asyncio.run(scenario())
    assert errors == []

"""The shipped D-Bus files in dbus/ as files: well-formed XML, the polkit policy, the bus policy
and the activation file."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


DBUS = ROOT / "dbus"


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


"""The supported dbus-fast range is stated once in compat.py and repeated, the same, in
setup.cfg and docs/architecture.md; the installed dbus-fast is inside it."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from gpuguardd.bus import compat

ROOT = Path(__file__).resolve().parents[3]


def test_setup_cfg_and_docs_state_the_range() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = [line.strip() for line in config["options"]["install_requires"].splitlines()]
    assert f"dbus-fast{compat.supported_range()}" in requires, requires
    assert f"supported versions {compat.supported_range()}" in (ROOT / "docs" / "architecture.md").read_text()


def test_the_installed_dbus_fast_is_supported() -> None:
    assert not compat.version_warning(), compat.VERSION


@pytest.mark.parametrize(("text", "version"), [
    ("1.84.2", (1, 84, 2)), ("5.2.0", (5, 2, 0)), ("2.11.1rc1", (2, 11, 1)), ("1.84.2+ds", (1, 84, 2)),
    ("6", (6,)), ("dev", ())])
def test_parse_version(text: str, version: tuple[int, ...]) -> None:
    assert compat.parse_version(text) == version


def test_gates_follow_the_fixed_versions() -> None:
    # What each gate is for is in compat.py; the bus tests check them against the library.
    assert compat.STRING_LENGTHS_IN_CHARACTERS is (compat.VERSION < (2, 11, 1))
    assert compat.WRITER_TAKES_NEWEST is (compat.VERSION < (1, 91, 3))


@pytest.mark.parametrize(("version", "warned"), [
    ((1, 84, 2), False), ((5, 2, 0), False), ((5, 99), False), ((1, 83, 9), True), ((6,), True),
    ((0,), True)])
def test_daemon_warns_outside_the_range(version: tuple[int, ...], warned: bool) -> None:
    text = compat.version_warning(version)
    assert bool(text) is warned
    if warned:
        assert ".".join(map(str, version)) in text and compat.supported_range() in text

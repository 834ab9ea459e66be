"""The man pages cannot drift from the code: every CLI verb and option, daemon option, exit
status, configuration key and D-Bus member is documented where a reader looks for it, nothing
documented is gone from the code, and each page renders without a warning.

The checks read the scdoc sources in man/ (where each item's section is explicit) and render
what `make man` builds from them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguardd import __version__, config
from gpuguardd.bus import marshal
from gpuguardd.bus.contract import Dictionary, contract
from gpuguardd.cli import exits
from gpuguardd.cli import main as cli
from tests.packages import require_tools

ROOT = Path(__file__).resolve().parents[2]
MAN = ROOT / "man"
DBUS_XML = ROOT / "dbus" / "org.gpuguard.GpuGuard1.xml"
POLKIT_POLICY = ROOT / "dbus" / "org.gpuguard.GpuGuard1.policy"
PAGES = ("gpuguardctl.1", "gpuguardd.8", "gpuguard.conf.5", "gpuguard-dbus.7")


def source(page: str) -> str:
    return (MAN / f"{page}.scd").read_text()


def sections(text: str, level: int) -> dict[str, str]:
    """Heading (markup removed) -> body, for the scdoc headings of `level` (1: #, 2: ##)."""
    marker = "#" * level + " "
    found: dict[str, str] = {}
    title = ""
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith(marker):
            title = plain(line[len(marker):])
            found[title] = ""
        elif title:
            found[title] += line + "\n"
    return found


def plain(text: str) -> str:
    return re.sub(r"[*_]", "", text).replace("\\", "").strip()


def bold_items(body: str) -> set[str]:
    """The *terms* that start an indented definition list entry, split at ', '."""
    items: set[str] = set()
    for line in body.splitlines():
        if line.startswith("*"):
            for part in line.split(", "):
                match = re.match(r"\*([^*]+)\*", part.strip())
                if match:
                    items.add(match.group(1))
    return items


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if not isinstance(a, argparse._SubParsersAction)
            for s in a.option_strings}


def subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
               ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subparsers(sub, (*path, name))


def exit_codes(module: object) -> dict[str, int]:
    return {name: value for name, value in vars(module).items()
            if name.startswith("EXIT_") and isinstance(value, int)}


# -- rendering -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """`make man`, then each page through man(1) as a reader sees it, warnings checked."""
    require_tools()
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "man"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    pages: dict[str, str] = {}
    for page in PAGES:
        path = ROOT / "build" / "man" / page
        assert path.is_file(), f"make man did not build {path}"
        result = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True,
                                text=True, check=False, timeout=60,
                                env={**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "",
                                     "LANG": "C.UTF-8"})
        assert result.returncode == 0, f"{page}: {result.stderr}"
        assert result.stderr == "", f"{page} renders with warnings:\n{result.stderr}"
        # Undo hyphenation at line ends so words can be searched for.
        pages[page] = re.sub(r"[\u2010-]\n\s+", "", result.stdout)
    return pages


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_with_name_and_version(rendered: dict[str, str], page: str) -> None:
    text = rendered[page]
    name, section = page.rsplit(".", 1)
    assert text.startswith(f"{name}({section})"), text[:200]
    assert "\nNAME\n" in text and "\nSEE ALSO\n" in text
    assert f"gpuguard {__version__}" in text, "the footer names the version (@VERSION@)"
    assert "@VERSION@" not in text


def test_rendered_cli_page_shows_every_option(rendered: dict[str, str]) -> None:
    text = rendered["gpuguardctl.1"]
    parser = cli.build_parser()
    for _, sub in subparsers(parser):
        for option in option_strings(sub):
            assert option in text, f"{option} missing from the rendered gpuguardctl(1)"


# -- gpuguardctl(1) ------------------------------------------------------------------------

def test_every_verb_and_its_options_are_documented() -> None:
    text = source("gpuguardctl.1")
    top = sections(text, 1)
    commands = sections(top["COMMANDS"], 2)
    parser = cli.build_parser()
    common = option_strings(parser)
    synopsis = top["SYNOPSIS"]
    documented_paths = {}
    for title in commands:
        words = [w for w in title.split() if re.fullmatch(r"[a-z-]+", w)]
        documented_paths[tuple(words)] = title
    for path, sub in subparsers(parser):
        has_children = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
        if has_children:
            # `hook`: documented through its actions, `hook install` and so on.
            assert any(p[:len(path)] == path and len(p) > len(path) for p in documented_paths), path
            continue
        assert path in documented_paths, f"gpuguardctl {' '.join(path)} has no section in COMMANDS"
        title = documented_paths[path]
        body = commands[title]
        specific = option_strings(sub) - common
        items = bold_items(body)
        for option in specific:
            assert option in items, f"gpuguardctl {' '.join(path)}: {option} is not documented"
        for item in items:
            if item.startswith("-"):
                assert item in option_strings(sub), \
                    f"gpuguardctl {' '.join(path)}: documents {item}, which it does not take"
        for action in sub._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                metavar = str(action.metavar or action.dest.upper())
                assert metavar in title, f"{path}: positional {metavar} not in the heading {title!r}"
        assert f"*{path[0]}*" in synopsis, f"{path[0]} missing from SYNOPSIS"
    for path in documented_paths:
        assert any(p == path for p, _ in subparsers(parser)), f"documented verb {path} does not exist"


def test_common_options_are_documented() -> None:
    top = sections(source("gpuguardctl.1"), 1)
    items = bold_items(top["OPTIONS"])
    parser = cli.build_parser()
    assert option_strings(parser) <= items, option_strings(parser) - items
    for item in items:
        assert item in option_strings(parser), f"OPTIONS documents {item}, which does not exist"


def test_cli_exit_codes_are_documented() -> None:
    items = bold_items(sections(source("gpuguardctl.1"), 1)["EXIT STATUS"])
    codes = {str(v) for v in exit_codes(exits).values()}
    assert codes == items


# -- gpuguardd(8) --------------------------------------------------------------------------

def test_daemon_options_and_exit_codes_are_documented() -> None:
    from gpuguardd.daemon import main as daemon
    top = sections(source("gpuguardd.8"), 1)
    items = bold_items(top["OPTIONS"])
    options = option_strings(daemon.build_parser())
    assert options == items, f"undocumented: {options - items}, stale: {items - options}"
    assert {str(v) for v in exit_codes(daemon).values()} == bold_items(top["EXIT STATUS"])
    for option in options:
        assert f"*{option}*" in top["SYNOPSIS"] or option in ("-h", "--help", "--version")


# -- gpuguard.conf(5) ----------------------------------------------------------------------

def conf_entries() -> dict[tuple[str, str], str]:
    """(section, key) -> the entry's text, from the OPTIONS section of gpuguard.conf(5)."""
    entries: dict[tuple[str, str], str] = {}
    options = sections(sections(source("gpuguard.conf.5"), 1)["OPTIONS"], 2)
    for title, body in options.items():
        section = title.strip("[]")
        current = ""
        for line in body.splitlines():
            match = re.match(r"\*(\w+)=\*", line)
            if match:
                current = match.group(1)
                entries[(section, current)] = ""
            elif current and line.startswith("\t"):
                entries[(section, current)] += line.strip() + " "
    return entries


def test_every_config_key_is_documented_in_its_section() -> None:
    documented = set(conf_entries())
    known = set(config._KEYS)
    assert known - documented == set(), f"undocumented keys: {sorted(known - documented)}"
    assert documented - known == set(), f"documented keys that do not exist: {sorted(documented - known)}"


def shipped_defaults() -> dict[tuple[str, str], str]:
    """(section, key) -> value of the commented-out `#Key=value` lines of config/gpuguard.conf."""
    values: dict[tuple[str, str], str] = {}
    section = ""
    for line in (ROOT / "config" / "gpuguard.conf").read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        match = re.match(r"#(\w+)=(.*)$", line)
        if match:
            assert (section, match.group(1)) not in values, f"{match.group(1)} shown twice"
            values[(section, match.group(1))] = match.group(2)
    return values


def test_documented_defaults_match_the_shipped_config() -> None:
    shipped = shipped_defaults()
    compared = 0
    for key, text in conf_entries().items():
        match = re.search(r"Default: _(.+?)_\.", text)
        if match:
            assert match.group(1).replace("\\", "").split() == shipped[key].split(), key
            compared += 1
    assert compared >= 9, "most keys state a literal default"


def test_shipped_config_shows_every_key_with_its_default(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """config/gpuguard.conf loads to the defaults as shipped, and still with every key uncommented."""
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    shipped = ROOT / "config" / "gpuguard.conf"
    assert set(shipped_defaults()) == set(config._KEYS)
    assert config.load_config([str(shipped)]) == config.Config()
    uncommented = tmp_path / "gpuguard.conf"
    uncommented.write_text(re.sub(r"(?m)^#(?=\w+=)", "", shipped.read_text()))
    assert config.load_config([str(uncommented)]) == config.Config()
    # Each key has its one-line explanation right above it.
    lines = shipped.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"#\w+=", line):
            assert lines[number - 1].startswith("# "), f"no explanation above {line}"


# -- gpuguard-dbus(7) ----------------------------------------------------------------------

def dbus_interfaces() -> list[ET.Element]:
    return [i for i in ET.parse(DBUS_XML).getroot().iter("interface")
            if i.get("name", "").startswith("org.gpuguard.")]


def expected_entries(interface: ET.Element) -> set[str]:
    """The definition-list headings gpuguard-dbus(7) must have, as scdoc source."""
    wanted: set[str] = set()
    for method in interface.iter("method"):
        args = ", ".join(f"{a.get('direction', 'in')} _{a.get('type')}_ {a.get('name')}"
                         for a in method.iter("arg"))
        wanted.add(f"*{method.get('name')}*({args})")
    for signal in interface.iter("signal"):
        args = ", ".join(f"_{a.get('type')}_ {a.get('name')}" for a in signal.iter("arg"))
        wanted.add(f"*{signal.get('name')}*({args})")
    for prop in interface.iter("property"):
        assert prop.get("access") == "read", "the page says all properties are read-only"
        wanted.add(f"*{prop.get('name')}* _{prop.get('type')}_")
    return wanted


def test_every_dbus_member_is_documented_with_its_signature() -> None:
    top = sections(source("gpuguard-dbus.7"), 1)
    interfaces = dbus_interfaces()
    assert len(interfaces) >= 2
    for interface in interfaces:
        name = interface.get("name")
        title = f"INTERFACE {name}"
        assert title in top, f"no section {title!r}"
        headings = {line for line in top[title].splitlines() if line.startswith("*")}
        wanted = expected_entries(interface)
        assert wanted - headings == set(), f"{name}: undocumented or wrong signature: {wanted - headings}"
        assert headings - wanted == set(), f"{name}: documented but not in the XML: {headings - wanted}"
    documented = {t.split(" ", 1)[1] for t in top if t.startswith("INTERFACE ")}
    assert documented == {i.get("name") for i in interfaces}


def entry(body: str, member: str) -> str:
    """The text of one member's entry, from its heading to the next heading."""
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"*{member}*"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("*")), len(lines))
    return "\n".join(lines[start:end])


def schema_keys(dictionary: Dictionary) -> set[str]:
    keys = set(dictionary)
    for field in dictionary.values():
        if field.dictionary is not None:
            keys |= schema_keys(field.dictionary)
    return keys


def test_dictionary_keys_are_documented() -> None:
    manager = sections(source("gpuguard-dbus.7"), 1)["INTERFACE org.gpuguard.GpuGuard1.Manager"]
    options = contract().dictionaries
    cases = (("ListHolders", set(options[marshal.FILTER]) | set(marshal.HOLDER)),
             ("Sweep", set(options[marshal.SWEEP]) | schema_keys(marshal.REPORT)))
    for member, keys in cases:
        text = entry(manager, member)
        for key in keys:
            assert f"_{key}_" in text, f"{member}: key {key!r} is not documented"


def test_errors_outcomes_and_polkit_actions_are_documented() -> None:
    top = sections(source("gpuguard-dbus.7"), 1)
    errors = set(re.findall(r"org\.gpuguard\.GpuGuard1\.Error\.\w+", DBUS_XML.read_text()))
    assert errors, "the XML names its errors"
    documented = {plain(line) for line in top["ERRORS"].splitlines() if line.startswith("_")}
    assert errors == documented
    actions = {a.get("id") for a in ET.parse(POLKIT_POLICY).getroot().iter("action")}
    documented_actions = {plain(line) for line in top["AUTHORIZATION"].splitlines()
                          if line.startswith("_org.")}
    assert actions == documented_actions
    from gpuguardd.records.enums import Outcome
    outcomes = {outcome.value for outcome in Outcome}
    documented_outcomes = {plain(line) for line in top["OUTCOMES"].splitlines() if line.startswith("_")}
    assert outcomes == documented_outcomes


def test_busctl_examples_use_the_real_interface() -> None:
    """Each example calls a member that exists, with its argument signature."""
    examples = sections(source("gpuguard-dbus.7"), 1)["EXAMPLES"]
    members = {(i.get("name"), m.get("name")): "".join(a.get("type", "") for a in m.iter("arg")
                                                        if a.get("direction", "in") == "in")
               for i in dbus_interfaces() for m in i.iter("method")}
    properties = {(i.get("name"), p.get("name")) for i in dbus_interfaces() for p in i.iter("property")}
    calls = 0
    for line in examples.splitlines():
        words = line.replace("'", "").split()
        if not words or words[0] != "busctl":
            continue
        words = [w for w in words if not w.startswith("--")]
        if words[1] == "call":
            interface, method = words[4], words[5]
            assert (interface, method) in members, line
            assert (words[6] if len(words) > 6 else "") == members[(interface, method)], line
            calls += 1
        elif words[1] == "get-property":
            for prop in words[5:]:
                assert (words[4], prop) in properties, line
    assert calls >= 4


def test_see_also_references_exist() -> None:
    for page in PAGES:
        for ref, section in re.findall(r"\*(gpuguard[\w.-]*)\*\((\d)\)", source(page)):
            assert f"{ref}.{section}" in PAGES, f"{page} refers to {ref}({section})"

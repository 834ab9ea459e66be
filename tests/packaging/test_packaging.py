"""Packaging: bash completion, the list of files, `make install`/`uninstall`, the .deb and the .rpm.

The layout asserted here is the one packaging/README.md documents; the packages are built
once per session by the Makefile's own targets (tests/packages.py), from the release tarball.
What goes where outside the Python package is packaging/files.txt, the one list `make install`,
`make uninstall` and the .rpm's %files are made from: `make install`, the .deb and the .rpm
are held to it, and it to the tree (every file of the tree that ships is on it).
"""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuguardd import __version__
from gpuguardd.cli import main as cli
from tests.packages import ROOT, build, build_dir, make, release_tree, require_tools, tarball
from tests.shipped import shipped, units

COMPLETION = ROOT / "completion" / "gpuguardctl"
DBUS_NAME = "org.gpuguard.GpuGuard1"
# The Python modules and their package data: the D-Bus interface XML the daemon serves, which
# the build copies from dbus/ (setup.py, make install).
INTERFACE_XML = "gpuguardd/bus/org.gpuguard.GpuGuard1.xml"
MODULES = sorted([str(p.relative_to(ROOT)) for p in (ROOT / "gpuguardd").rglob("*.py")] + [INTERFACE_XML])
if TYPE_CHECKING:
    from tests.conftest import GpuHost

EXTENSION = "usr/share/gnome-shell/extensions/gpuguard@gpuguard.org"
# The GNOME Shell extension's files, in either layout (gnome-shell-extension/build.py).
EXTENSION_FILES = ("client.js", "compat.js", "escape.js", "extension.js", "indicator.js", "metadata.json",
                   "org.gpuguard.GpuGuard1.xml", "resetDialog.js", "state.js", "stylesheet.css",
                   "sweepDialog.js")

# packaging/files.py by path: the name `packaging` is also PyPI's packaging.
_spec = importlib.util.spec_from_file_location("gpuguard_files", ROOT / "packaging" / "files.py")
assert _spec is not None and _spec.loader is not None
files_py = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # for its dataclass
_spec.loader.exec_module(files_py)
# The Makefile's directories as packaging/README.md documents them: `make install`'s defaults
# (PREFIX=/usr), which are Debian's and Fedora's (the .deb has its units in /lib/systemd/system).
DIRS = {"UNITS": "build/units", "BINDIR": "/usr/bin", "LIBEXECDIR": "/usr/libexec", "DATADIR": "/usr/share",
        "MANDIR": "/usr/share/man", "SYSCONFDIR": "/etc", "UNITDIR": "/usr/lib/systemd/system",
        "SYSUSERSDIR": "/usr/lib/sysusers.d", "USERUNITDIR": "/usr/lib/systemd/user",
        "DBUS_POLICYDIR": "/usr/share/dbus-1/system.d", "DBUS_SERVICEDIR": "/usr/share/dbus-1/system-services",
        "DBUS_INTERFACEDIR": "/usr/share/dbus-1/interfaces", "POLKIT_ACTIONDIR": "/usr/share/polkit-1/actions",
        "COMPLETIONDIR": "/usr/share/bash-completion/completions"}


def listed(unitdir: str = "usr/lib/systemd/system") -> dict[str, Any]:
    """packaging/files.txt filled in with DIRS: the destination, relative to /, of each entry."""
    dirs = {**DIRS, "UNITDIR": f"/{unitdir}"}
    return {files_py.fill(e.destination, dirs).removeprefix("/"): e for e in files_py.read()}


def owned_dirs(unitdir: str = "usr/lib/systemd/system") -> set[str]:
    """The directories packaging/files.txt makes gpuguard's own, relative to /."""
    return {d.removeprefix("/") for d in files_py.owned_dirs(files_py.read(), {**DIRS, "UNITDIR": f"/{unitdir}"})}


def data_files(unitdir: str = "usr/lib/systemd/system") -> set[str]:
    """Everything but the Python modules, relative to /, as `make install` and the packages lay it out."""
    return set(listed(unitdir))


def config_files() -> set[str]:
    """The admin's files: kept by make install and uninstall, conffiles, %config(noreplace)."""
    return {path for path, entry in listed().items() if entry.config}


def cockpit_files(datadir: str = "usr/share") -> set[str]:
    """The built Cockpit page (make cockpit), as `make install` and cockpit-gpuguard install it."""
    return {f"{datadir}/cockpit/gpuguard/{f}" for f in tree(ROOT / "cockpit" / "dist")}


def extension_files(datadir: str = "usr/share") -> set[str]:
    """The GNOME Shell extension as `make install` and gnome-shell-extension-gpuguard install it."""
    return {f"{datadir}/gnome-shell/extensions/gpuguard@gpuguard.org/{f}" for f in EXTENSION_FILES}


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if not p.is_dir() and "__pycache__" not in p.parts}


# -- bash completion -----------------------------------------------------------------------

def complete(*words: str, env: dict[str, str] | None = None) -> set[str]:
    """Source the completion, call it as bash would for `words` (the last one being completed)."""
    script = (f"source {COMPLETION}\n"
              "COMP_WORDS=(\"$@\"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMPREPLY=()\n"
              "_gpuguardctl\n"
              "printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", script, "bash", *words],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    return {line for line in done.stdout.splitlines() if line}


def parser_tree() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {(): cli.build_parser()}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    sub_path = (*path, name)
                    found[sub_path] = sub
                    walk(sub, sub_path)

    walk(found[()], ())
    return found


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def children(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for name in a.choices}


def test_completion_offers_every_verb() -> None:
    assert complete("gpuguardctl", "") == children(cli.build_parser())
    assert complete("gpuguardctl", "sw") == {"sweep"}
    assert complete("gpuguardctl", "--json", "h") == {"holders", "history", "hook"}


def test_completion_offers_each_verbs_options_exactly() -> None:
    """For every verb (and hook action) the options offered are the parser's, no more, no less."""
    for path, parser in parser_tree().items():
        if children(parser) and path:
            assert complete("gpuguardctl", *path, "") == children(parser), path
        offered = complete("gpuguardctl", *path, "-")
        assert offered == options(parser), f"gpuguardctl {' '.join(path)}: {offered ^ options(parser)}"


def test_completion_knows_which_options_take_a_value() -> None:
    # After an option that takes a value, the next word is that value, not the verb.
    assert complete("gpuguardctl", "--config", "/etc/x.conf", "sweep", "--dry") == {"--dry-run"}
    assert complete("gpuguardctl", "history", "-n", "3", "--j") == {"--json"}
    assert complete("gpuguardctl", "sweep", "--grace", "") >= {"10s", "30s"}


def test_completion_lists_units_from_systemctl(tmp_path: Path) -> None:
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\n"
                    "[ \"$*\" = 'list-units --all --plain --no-legend --full' ] || exit 1\n"
                    "echo '  dbus.service          loaded active running D-Bus System Message Bus'\n"
                    "echo '● sglang-qwen.service   loaded failed failed  SGLang Qwen'\n"
                    "echo '  session-4.scope       loaded active running Session 4 of user llm'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    units = {"dbus.service", "sglang-qwen.service", "session-4.scope"}
    assert complete("gpuguardctl", "sweep", "--unit", "", env=env) == units
    assert complete("gpuguardctl", "holders", "--unit", "sg", env=env) == {"sglang-qwen.service"}
    assert complete("gpuguardctl", "sweep", "--unit", "=", "", env=env) == units


def test_completion_asks_gpuguardctl_for_gpus(gpu_host: GpuHost, tmp_path: Path) -> None:
    """--gpu offers the indices and UUIDs that `gpuguardctl gpus --json` reports, using the
    --local/--config options already typed."""
    ctl = tmp_path / "gpuguardctl"
    ctl.write_text(f"#!/bin/sh\nexec {sys.executable} -m gpuguardd.cli.main \"$@\"\n")
    ctl.chmod(0o755)
    config = str(gpu_host.config_path)
    listed = subprocess.run([str(ctl), "--local", "--config", config, "gpus", "--json"],
                            env=gpu_host.env, capture_output=True, text=True, check=True)
    gpus = json.loads(listed.stdout)
    expected = {str(g["index"]) for g in gpus} | {g["uuid"] for g in gpus}
    assert len(expected) == 4, expected
    offered = complete(str(ctl), "--local", "--config", config, "sweep", "--gpu", "", env=gpu_host.env)
    assert offered == expected
    uuids = {str(g["uuid"]) for g in gpus}
    assert complete(str(ctl), "--local", "--config", config, "holders", "--gpu", "GPU-",
                    env=gpu_host.env) == uuids


# -- the list of files (packaging/files.txt) -------------------------------------------------

def test_the_list_holds_every_file_of_the_tree_that_ships() -> None:
    """Each template (packaging/units.py fills them in), man page, D-Bus and polkit file, the
    completion, the configuration, the other systemd files and a program for each console
    script, once: a file added to the tree and not to the list fails here."""
    sources = [e.source for e in files_py.read()]
    expected = [f"$(UNITS)/{t.relative_to(ROOT).with_suffix('')}" for t in units.templates()]
    expected += [f"build/man/{p.stem}" for p in (ROOT / "man").glob("*.scd")]
    expected += [str(p.relative_to(ROOT)) for folder in ("dbus", "completion", "config")
                 for p in (ROOT / folder).iterdir()]
    expected += [str(p.relative_to(ROOT)) for p in (ROOT / "systemd").rglob("*") if p.is_file() and p.suffix != ".in"]
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = dict(line.replace(" ", "").split("=") for line in
                   setup["options.entry_points"]["console_scripts"].strip().splitlines())
    expected += [f"program:{target.removesuffix(':main')}" for target in scripts.values()]
    assert sorted(sources) == sorted(expected)
    programs = {Path(e.destination).name: e.module for e in files_py.read() if e.module}
    assert programs == {name: target.removesuffix(":main") for name, target in scripts.items()}


def test_the_list_is_the_documented_layout() -> None:
    files = listed()
    assert files["usr/lib/systemd/system/gpuguardd.service"].source == "$(UNITS)/systemd/gpuguardd.service"
    assert files["usr/libexec/gpuguard/gpuguardd"].module == "gpuguardd.daemon.main", "the daemon is not on PATH"
    assert files["usr/share/man/man8/gpuguardd.8"].source == "build/man/gpuguardd.8"
    assert {p: e.mode for p, e in files.items() if e.mode != "644"} == {
        "usr/bin/gpuguardctl": "755", "usr/bin/gpuguard-notify": "755", "usr/libexec/gpuguard/gpuguardd": "755",
        "usr/libexec/gpuguard/gpuguard-exporter": "755", "usr/share/gpuguard/slurm/epilog.d/50-gpuguard": "755",
        "usr/share/gpuguard/slurm/prolog.d/50-gpuguard": "755", "usr/share/gpuguard/slurm/unkillable-step": "755"}
    assert config_files() == {"etc/gpuguard/gpuguard.conf"}
    # Drop-ins for other units are the admin's choice: none where systemd would read it.
    assert not [f for f in files if re.match(r"(usr/)?lib/systemd/system/.+\.service\.d/", f)]
    # gpuguard's own directories, which uninstall removes and the .rpm owns; never a shared one.
    dirs = owned_dirs()
    assert {"etc/gpuguard", "usr/libexec/gpuguard", "usr/share/gpuguard", "usr/share/gpuguard/slurm/epilog.d",
            "usr/share/gpuguard/dropins/vllm-.service.d"} <= dirs
    assert all(re.match(r"(etc|usr/libexec|usr/share)/gpuguard(/|$)", d) for d in dirs), dirs


@pytest.mark.parametrize(("line", "error"), [
    ("644 a $(BINDIR)/x\n644 b $(BINDIR)/x", "installed twice"),
    ("64x a $(BINDIR)/x", "is not octal"),
    ("644 a /usr/bin/x", "below one of the Makefile's directories"),
    ("644 a $(DATADIR)/gpuguard/../x", "below one of the Makefile's directories"),
    ("644 a $(BINDIR)/x conf", "expected MODE SOURCE DESTINATION"),
    ("755 program:gpuguardd/cli $(BINDIR)/x", "names no module"),
])
def test_a_bad_line_is_refused_with_its_number(line: str, error: str) -> None:
    with pytest.raises(files_py.ListError, match=re.escape(error)) as raised:
        files_py.parse(f"# comment\n\n{line}\n", "files.txt")
    assert str(raised.value).startswith(("files.txt:3: ", "files.txt:4: ")), raised.value


def test_files_py_wants_every_directory_the_list_names() -> None:
    """A directory the Makefile does not pass (a new $(NAME) in the list) is an error, not an
    empty path: `make uninstall` would otherwise remove /gpuguardctl."""
    script = [sys.executable, str(ROOT / "packaging" / "files.py")]
    values = [f"{name}={value}" for name, value in DIRS.items() if name != "COMPLETIONDIR"]
    done = subprocess.run([*script, "remove", *values], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert "no value for COMPLETIONDIR" in done.stderr, done.stderr
    done = subprocess.run([*script, "remove", *values, "COMPLETIONDIR=/usr/share/bash completion"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "one word" in done.stderr, done.stderr
    done = subprocess.run([*script, "remove", *values, f"COMPLETIONDIR={DIRS['COMPLETIONDIR']}"],
                          capture_output=True, text=True, check=True)
    assert set(done.stdout.split()) == {f"/{f}" for f in data_files() - config_files()}


# -- make install / uninstall --------------------------------------------------------------

@pytest.fixture(scope="module")
def tools() -> None:
    require_tools()


def test_make_install_destdir_layout_and_uninstall(tools: None, tmp_path: Path) -> None:
    dest = tmp_path / "root"
    make("install", f"DESTDIR={dest}")
    python = {f"usr/lib/gpuguard/python/{m}" for m in MODULES}
    assert tree(dest) == data_files() | python | cockpit_files() | extension_files()
    assert (dest / "usr/share/cockpit/gpuguard/manifest.json").read_bytes() == \
        (ROOT / "cockpit/src/manifest.json").read_bytes()
    assert (dest / "usr/lib/gpuguard/python/gpuguardd/__pycache__").is_dir(), "byte-compiled"
    for program in ("usr/bin/gpuguardctl", "usr/libexec/gpuguard/gpuguardd",
                    "usr/libexec/gpuguard/gpuguard-exporter", "usr/bin/gpuguard-notify"):
        assert os.access(dest / program, os.X_OK)
        text = (dest / program).read_text()
        assert text.startswith("#!/usr/bin/python3\n")
        assert 'sys.path.insert(0, "/usr/lib/gpuguard/python")' in text
    unit = (dest / "usr/lib/systemd/system/gpuguardd.service").read_text()
    assert "ExecStart=/usr/libexec/gpuguard/gpuguardd\n" in unit
    assert (dest / "etc/gpuguard/gpuguard.conf").read_bytes() == (ROOT / "config/gpuguard.conf").read_bytes()
    # Each file of the list as it says: its mode, and its source's contents; every template
    # (packaging/units.py) filled in with the default paths, as the tests read it.
    for target, entry in listed().items():
        assert (dest / target).stat().st_mode & 0o7777 == int(entry.mode, 8), target
        if entry.source.startswith("$(UNITS)/"):
            assert (dest / target).read_text() == shipped(entry.source.removeprefix("$(UNITS)/")), target
        elif entry.module is None:
            assert (dest / target).read_bytes() == (ROOT / entry.source).read_bytes(), target

    make("uninstall", f"DESTDIR={dest}")
    assert tree(dest) == set(), "make uninstall left files behind"
    assert not (dest / "usr/lib/gpuguard").exists()
    left = {d for d in owned_dirs() if (dest / d).exists()}
    assert left == set(), f"make uninstall left gpuguard's directories {sorted(left)}"


def test_make_install_keeps_the_admins_config(tools: None, tmp_path: Path) -> None:
    dest = tmp_path / "root"
    conf = dest / "etc/gpuguard/gpuguard.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[Sweep]\nGraceSec=3s\n")
    make("install", f"DESTDIR={dest}")
    assert conf.read_text() == "[Sweep]\nGraceSec=3s\n"
    done = make("uninstall", f"DESTDIR={dest}")
    assert conf.read_text() == "[Sweep]\nGraceSec=3s\n", "a changed configuration survives uninstall"
    assert "keeping the changed" in done.stdout
    assert tree(dest) == {"etc/gpuguard/gpuguard.conf"}


def test_make_install_honours_prefix_and_runs_on_the_system_python(tools: None, tmp_path: Path) -> None:
    """PREFIX moves everything but /etc; the installed programs run on /usr/bin/python3 with
    Debian's python3-dbus-fast, python3-sdnotify and python3-prometheus-client, no venv."""
    prefix = tmp_path / "opt"
    make("install", f"PREFIX={prefix}", f"SYSCONFDIR={tmp_path}/etc")
    python = {f"lib/gpuguard/python/{m}" for m in MODULES}
    expected = {f.removeprefix("usr/") for f in data_files() if not f.startswith("etc/")} | python
    expected |= cockpit_files("share") | extension_files("share")
    assert tree(prefix) == expected
    unit = (prefix / "lib/systemd/system/gpuguardd.service").read_text()
    assert f"ExecStart={prefix}/libexec/gpuguard/gpuguardd\n" in unit
    dropin = (prefix / "share/gpuguard/dropins/vllm-.service.d/gpuguard.conf").read_text()
    assert f" {prefix}/bin/gpuguardctl sweep --unit %n" in dropin
    clean = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    version = subprocess.run([str(prefix / "bin/gpuguardctl"), "--version"], env=clean,
                             capture_output=True, text=True, check=False)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"gpuguardctl {__version__}"
    config = tmp_path / "gpuguard.conf"
    config.write_text("[Devices]\nPaths=/nonexistent/nvidia*\n")
    status = subprocess.run([str(prefix / "bin/gpuguardctl"), "--local", "--config", str(config),
                             "status", "--json"], env=clean, capture_output=True, text=True, check=False)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["version"] == __version__
    daemon = subprocess.run([str(prefix / "libexec/gpuguard/gpuguardd"), "--version"], env=clean,
                            capture_output=True, text=True, check=False)
    assert daemon.returncode == 0, daemon.stderr
    assert daemon.stdout.strip() == f"gpuguardd {__version__}"
    # The exporter imports prometheus_client: Debian's python3-prometheus-client here.
    exporter = subprocess.run([str(prefix / "libexec/gpuguard/gpuguard-exporter"), "--version"],
                              env=clean, capture_output=True, text=True, check=False)
    assert exporter.returncode == 0, exporter.stderr
    assert exporter.stdout.strip() == f"gpuguard-exporter {__version__}"
    unit = (prefix / "lib/systemd/system/gpuguard-exporter.service").read_text()
    assert f"ExecStart={prefix}/libexec/gpuguard/gpuguard-exporter --idle-exit 60s\n" in unit
    notifier = subprocess.run([str(prefix / "bin/gpuguard-notify"), "--version"], env=clean,
                              capture_output=True, text=True, check=False)
    assert notifier.stdout.strip() == f"gpuguard-notify {__version__}", notifier.stderr
    user_unit = (prefix / "lib/systemd/user/gpuguard-notify.service").read_text()
    assert f"ExecStart={prefix}/bin/gpuguard-notify\n" in user_unit
    make("uninstall", f"PREFIX={prefix}", f"SYSCONFDIR={tmp_path}/etc")
    assert tree(prefix) == set()


# -- the .deb --------------------------------------------------------------------------------

def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_deb_version_and_relationships() -> None:
    deb = build("deb")
    assert deb_field(deb, "Package") == "gpuguard"
    assert deb_field(deb, "Version") == __version__
    assert deb_field(deb, "Architecture") == "all"
    depends = deb_field(deb, "Depends")
    for dep in ("python3-dbus-fast (>= 1.84)", "python3-sdnotify",
                "python3-prometheus-client (>= 0.16)", "python3:any"):
        assert dep in depends, depends
    assert "psutil" not in depends, "no module of gpuguard imports psutil"
    assert "nvidia" not in depends, "nvidia-ml-py is not in Debian: suggested, never required"
    assert "python3-pip" in deb_field(deb, "Suggests")
    assert "polkitd" in deb_field(deb, "Recommends")


def test_deb_layout() -> None:
    deb = build("deb")
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    files = {line.split()[5].removeprefix("./") for line in listing.splitlines()
             if not line.startswith("d")}
    expected = {f + ".gz" if f.startswith("usr/share/man/") else f
                for f in data_files(unitdir="lib/systemd/system")}
    assert expected <= files, expected - files
    modules = {f"usr/lib/python3/dist-packages/{m}" for m in MODULES}
    assert modules <= files, modules - files
    assert "usr/bin/gpuguardd" not in files, "the daemon is not on PATH"
    # Drop-ins for other units are the admin's choice (gpuguardctl hook install): never active
    # by installing the package.
    assert not [f for f in files if re.match(r"(usr/)?lib/systemd/system/.+\.service\.d/", f)]
    unexpected = files - expected - modules - {"usr/share/doc/gpuguard/README.md.gz",
                                               "usr/share/doc/gpuguard/changelog.gz",
                                               "usr/share/doc/gpuguard/copyright"}
    assert all(f.startswith(f"usr/lib/python3/dist-packages/gpuguard-{__version__}.dist-info/")
               for f in unexpected), unexpected


def cockpit_package(kind: str) -> Path:
    """cockpit-gpuguard's .deb or .rpm, built beside gpuguard's by the same make target."""
    main = build(kind)
    name = f"cockpit-gpuguard_{__version__}_all.deb" if kind == "deb" else \
        f"cockpit-gpuguard-{__version__}-1.noarch.rpm"
    return main.with_name(name)


def test_cockpit_deb_ships_the_built_page_and_depends_on_cockpit_and_gpuguard(tmp_path: Path) -> None:
    deb = cockpit_package("deb")
    assert deb_field(deb, "Package") == "cockpit-gpuguard"
    assert deb_field(deb, "Version") == __version__
    assert deb_field(deb, "Architecture") == "all"
    depends = [d.strip() for d in deb_field(deb, "Depends").split(",")]
    assert "cockpit-bridge (>= 287)" in depends, depends
    assert f"gpuguard (= {__version__})" in depends, depends
    assert not [d for d in depends if "node" in d], "the installed page needs no node"
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    files = {line.split()[5].removeprefix("./") for line in listing.splitlines() if not line.startswith("d")}
    docs = {"usr/share/doc/cockpit-gpuguard/README.md.gz", "usr/share/doc/cockpit-gpuguard/changelog.gz",
            "usr/share/doc/cockpit-gpuguard/copyright"}
    assert files == cockpit_files() | docs, files ^ (cockpit_files() | docs)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    for name in ("manifest.json", "index.html"):
        assert (tmp_path / "usr/share/cockpit/gpuguard" / name).read_bytes() == \
            (ROOT / "cockpit/src" / name).read_bytes(), name
    assert (tmp_path / "usr/share/cockpit/gpuguard/gpuguard.js").read_bytes() == \
        (ROOT / "cockpit/dist/gpuguard.js").read_bytes(), "the page make cockpit built"
    main = subprocess.run(["dpkg-deb", "-c", str(build("deb"))], capture_output=True, text=True, check=True).stdout
    assert "usr/share/cockpit" not in main, "the page is cockpit-gpuguard's alone"


def test_deb_conffile_and_maintainer_scripts(tmp_path: Path) -> None:
    deb = build("deb")
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    assert sorted((control / "conffiles").read_text().split()) == sorted(f"/{f}" for f in config_files())
    postinst = (control / "postinst").read_text()
    assert "deb-systemd-helper enable 'gpuguardd.service'" in postinst
    assert "systemd-sysusers gpuguard-exporter.conf" in postinst
    assert "_dh_action=restart" in postinst and "_dh_action=start" in postinst
    assert "deb-systemd-invoke stop 'gpuguardd.service'" in (control / "prerm").read_text()
    postrm = (control / "postrm").read_text()
    assert "rm -rf /var/lib/gpuguard" in postrm
    assert "deb-systemd-helper purge 'gpuguardd.service'" in postrm
    # The purge finds hook drop-ins by the header systemd/dropins.py writes.
    from gpuguardd.systemd import dropins as hooks
    assert hooks.HEADER in postrm


def test_gnome_shell_extension_deb(tmp_path: Path) -> None:
    deb = build("deb").with_name(f"gnome-shell-extension-gpuguard_{__version__}_all.deb")
    assert deb_field(deb, "Package") == "gnome-shell-extension-gpuguard"
    depends = [d.strip() for d in deb_field(deb, "Depends").split(",")]
    for dep in ("gnome-shell (>= 43)", "gnome-shell (<< 45)", f"gpuguard (= {__version__})"):
        assert dep in depends, depends
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    files = {line.split()[5].removeprefix("./") for line in listing.splitlines() if not line.startswith("d")}
    docs = {f"usr/share/doc/gnome-shell-extension-gpuguard/{f}" for f in ("changelog.gz", "copyright")}
    assert files == {f"{EXTENSION}/{f}" for f in EXTENSION_FILES} | docs, files
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True)
    metadata = json.loads((tmp_path / EXTENSION / "metadata.json").read_text())
    assert metadata["shell-version"] == ["43", "44"] and metadata["uuid"] == "gpuguard@gpuguard.org"
    assert "function init(metadata)" in (tmp_path / EXTENSION / "extension.js").read_text(), "the 43 layout"
    # The user service ships with gpuguard, never enabled for everyone.
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(build("deb")), str(control)], check=True)
    postinst = (control / "postinst").read_text()
    assert "deb-systemd-helper --quiet --user was-enabled 'gpuguard-notify.service'" in postinst
    assert "deb-systemd-helper --user enable 'gpuguard-notify.service'" in postinst.split("was-enabled", 1)[1], \
        "enabled only where a user had it enabled before (an upgrade)"


def lintian_tags() -> list[tuple[str, str]]:
    changes = next(build_dir("deb").glob("gpuguard_*.changes"))
    done = subprocess.run(["lintian", "--pedantic", "--info", "--display-experimental",
                           "--tag-display-limit", "0", str(changes)],
                          capture_output=True, text=True, check=False, timeout=300,
                          # lintian leaves mldbm-elf-* caches in TMPDIR: not in the host's /tmp.
                          env={**os.environ, "TMPDIR": str(changes.parent)})
    tags = re.findall(r"^([EWIPX]): (?:cockpit-|gnome-shell-extension-)?gpuguard(?: source)?(?: \(\w+\))?: (\S+)",
                      done.stdout, re.M)
    assert done.returncode == 0 or tags, done.stdout + done.stderr
    return tags


def test_lintian_has_no_errors_and_every_tag_left_is_explained() -> None:
    tags = lintian_tags()
    errors = [tag for level, tag in tags if level == "E"]
    assert errors == [], f"lintian errors: {errors}"
    readme = (ROOT / "packaging" / "README.md").read_text()
    explained = set(re.findall(r"^\* `([a-z0-9.+-]+)`", readme, re.M))
    unexplained = {tag for _, tag in tags} - explained
    assert unexplained == set(), f"lintian tags not explained in packaging/README.md: {unexplained}"


# -- the .rpm --------------------------------------------------------------------------------

def rpm_query(*args: str) -> str:
    return subprocess.run(["rpm", "-qp", *args, str(build("rpm"))], capture_output=True,
                          text=True, check=True).stdout


def test_rpm_version_layout_and_config() -> None:
    """The .rpm's %files is made from packaging/files.txt (make rpm-files): it holds exactly the
    list's files, the Python package and the docs, owns gpuguard's own directories, and marks
    the list's configuration %config(noreplace)."""
    assert rpm_query("--qf", "%{NAME} %{VERSION} %{ARCH}") == f"gpuguard {__version__} noarch"
    files = set(rpm_query("-l").split())
    sitelib = next(f for f in files if f.endswith("/gpuguardd/__init__.py")).rsplit("/gpuguardd/", 1)[0]
    assert re.fullmatch(r"/usr/lib/python3\.\d+/site-packages", sitelib), sitelib
    assert {f"{sitelib}/{m}" for m in MODULES} <= files
    assert "/usr/bin/gpuguardd" not in files
    docs = (f"{sitelib}/", f"/usr/share/doc/gpuguard-{__version__}", f"/usr/share/licenses/gpuguard-{__version__}")
    ours = {re.sub(r"(/usr/share/man/.*)\.gz$", r"\1", f) for f in files if not f.startswith(docs)}
    expected = {f"/{f}" for f in data_files() | owned_dirs()}
    assert ours == expected, ours ^ expected
    flags = dict(line.split(" ", 1) for line in
                 rpm_query("--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]").splitlines())
    assert {f for f, flag in flags.items() if "c" in flag} == {f"/{f}" for f in config_files()}
    assert flags["/etc/gpuguard/gpuguard.conf"] == "cn", "%config(noreplace)"


def test_rpm_requirements_and_scriptlets() -> None:
    requires = rpm_query("-R")
    assert "python3dist(dbus-fast) >= 1.84" in requires
    assert "nvidia-ml-py" not in requires, "excluded from the generated requirements"
    assert "python3dist(nvidia-ml-py)" in rpm_query("--recommends")
    scripts = rpm_query("--scripts")
    for needed in ("preset gpuguardd.service", "disable --now gpuguardd.service",
                   "try-restart gpuguardd.service"):
        assert needed in scripts, scripts


def test_rpm_cockpit_subpackage() -> None:
    rpm = str(cockpit_package("rpm"))

    def query(*args: str) -> str:
        return subprocess.run(["rpm", "-qp", *args, rpm], capture_output=True, text=True, check=True).stdout

    assert query("--qf", "%{NAME} %{VERSION} %{ARCH}") == f"cockpit-gpuguard {__version__} noarch"
    files = set(query("-l").split())
    page = {"/" + f for f in cockpit_files()}
    assert page <= files, page - files
    assert not {f for f in files if f.startswith("/usr/share/cockpit/")} - page - {"/usr/share/cockpit/gpuguard",
                                                                              "/usr/share/cockpit/gpuguard/assets"}
    requires = query("-R")
    assert "cockpit-bridge >= 287" in requires, requires
    assert f"gpuguard = {__version__}-1" in requires, requires
    assert "/usr/share/cockpit/" not in rpm_query("-l"), "the page is the subpackage's alone"


def test_rpm_gnome_shell_extension_subpackage() -> None:
    rpm = str(build("rpm").with_name(f"gnome-shell-extension-gpuguard-{__version__}-1.noarch.rpm"))

    def query(*args: str) -> str:
        return subprocess.run(["rpm", "-qp", *args, rpm], capture_output=True, text=True, check=True).stdout

    files = set(query("-l").split())
    assert {f"/{EXTENSION}/{f}" for f in EXTENSION_FILES} <= files, files
    requires = query("-R")
    assert "gnome-shell >= 45" in requires and f"gpuguard = {__version__}-1" in requires, requires
    assert "/usr/share/gnome-shell/" not in rpm_query("-l"), "the extension is the subpackage's alone"


def test_spec_default_version_is_the_package_version() -> None:
    spec = (ROOT / "packaging" / "rpm" / "gpuguard.spec").read_text()
    match = re.search(r"%\{!\?gpuguard_version:%global gpuguard_version (\S+)\}", spec)
    assert match and match.group(1) == __version__


# -- the release tarball (make dist) ---------------------------------------------------------

def tarball_files(path: Path) -> set[str]:
    """The tarball's files and links, relative to its one top folder gpuguard-<version>/."""
    top = f"gpuguard-{__version__}/"
    with tarfile.open(path) as archive:
        members = archive.getmembers()
    outside = [m.name for m in members if not (m.name + "/").startswith(top)]
    assert outside == [], f"outside {top}: {outside}"
    return {m.name.removeprefix(top) for m in members if not m.isdir()}


def test_dist_packs_the_committed_tree_and_the_built_page(tools: None, tmp_path: Path) -> None:
    """In a checkout `make dist` is `git archive HEAD` (the working tree's changes are not a
    release), plus the Cockpit page a package build cannot make without node and the network."""
    make("dist", f"DIST={tmp_path}")
    committed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", "-z", "HEAD"],
                               capture_output=True, text=True, check=True).stdout.split("\0")
    page = {f"cockpit/dist/{f}" for f in tree(ROOT / "cockpit" / "dist")}
    assert tarball_files(tmp_path / f"gpuguard-{__version__}.tar.gz") == {f for f in committed if f} | page
    assert os.listdir(tmp_path) == [f"gpuguard-{__version__}.tar.gz"], "only the tarball is left"


def test_the_unpacked_tarball_makes_the_same_tarball_and_carries_the_interface(tools: None) -> None:
    """`make dist` in the tree a distribution unpacks (no .git) packs that tree again, and
    the tree holds the one interface definition, no link (which a copy can lose)."""
    unpacked = release_tree()
    dist = unpacked.parent / "again"
    try:
        make("dist", f"DIST={dist}", cwd=unpacked)
        assert tarball_files(dist / f"gpuguard-{__version__}.tar.gz") == tarball_files(tarball())
    finally:
        shutil.rmtree(dist, ignore_errors=True)
    links = [str(p.relative_to(unpacked)) for p in unpacked.rglob("*") if p.is_symlink()]
    assert links == [], f"links in the release tree: {links}"
    assert (unpacked / "dbus/org.gpuguard.GpuGuard1.xml").read_bytes() == \
        (ROOT / "dbus/org.gpuguard.GpuGuard1.xml").read_bytes()
    # `make deps` in the release tree, as a distribution's CI may run it.
    assert os.access(unpacked / "packaging/deps.sh", os.X_OK)


def test_sdist_and_its_wheel_carry_the_interface(tools: None, tmp_path: Path) -> None:
    """What pip and pybuild build: the sdist holds dbus/, and the wheel built from it has the
    XML where gpuguardd.bus.contract reads it."""
    source = tmp_path / "src"
    shutil.copytree(release_tree(), source, symlinks=True)
    clean = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path)}
    done = subprocess.run(["/usr/bin/python3", "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "out"),
                           str(source)], env=clean, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    with tarfile.open(tmp_path / f"out/gpuguard-{__version__}.tar.gz") as sdist:
        assert f"gpuguard-{__version__}/dbus/org.gpuguard.GpuGuard1.xml" in sdist.getnames()
    with zipfile.ZipFile(tmp_path / f"out/gpuguard-{__version__}-py3-none-any.whl") as wheel:
        assert wheel.read(INTERFACE_XML) == (ROOT / "dbus/org.gpuguard.GpuGuard1.xml").read_bytes()


def test_deb_and_rpm_carry_the_interface_where_the_code_reads_it(tmp_path: Path) -> None:
    """Built from the tarball: without it the installed daemon stops at ContractError."""
    xml = (ROOT / "dbus/org.gpuguard.GpuGuard1.xml").read_bytes()
    subprocess.run(["dpkg-deb", "-x", str(build("deb")), str(tmp_path / "deb")], check=True)
    assert (tmp_path / "deb/usr/lib/python3/dist-packages" / INTERFACE_XML).read_bytes() == xml
    files = rpm_query("-l").split()
    assert [f for f in files if f.endswith("/site-packages/" + INTERFACE_XML)], files

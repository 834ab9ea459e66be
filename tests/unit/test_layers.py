"""The layers of gpuguardd, enforced: which package may import which.

Every module of the package is parsed (never imported) and every import in it counts, also
one inside a function (the CLI's lazy imports) or under `if TYPE_CHECKING:`: a layer that
reaches another only lazily still depends on it. An AST walk needs no new dependency and
sees exactly what import-linter would for these rules.

The layers (docs/architecture.md, "The layers"):
  records   the typed records every layer shares (models, report, codec, enums, selectors)
  engine    finds, attributes and ends GPU holders; no D-Bus, no daemon
  bus       the daemon's D-Bus face (connection, names, interfaces, marshalling, auth)
  systemd   unit rules, the systemd client, the watcher, the drop-in writer
  daemon    the service: live state, runner, history, entry point
  cli       gpuguardctl
  exporter  gpuguard-exporter (a bus client, like the CLI)
  notify    gpuguard-notify (a bus client: the Manager's signals as desktop notifications)
  leaves    errors, config, log, escaping, safetext, safefiles, numbers: shared by all, import no layer
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuguardd

PACKAGE = "gpuguardd"
ROOT = Path(gpuguardd.__file__).resolve().parent
LAYERS = ("records", "engine", "bus", "systemd", "daemon", "cli", "exporter", "notify")
LEAVES = ("errors", "config", "log", "escaping", "safetext", "safefiles", "numbers")
ALL_LAYERS = frozenset(f"{PACKAGE}.{name}" for name in LAYERS)

# importer layer -> what it may not import (a layer, or a third-party top-level package).
FORBIDDEN: dict[str, frozenset[str]] = {
    # Records are what every layer hands every other: they depend on the leaves alone.
    "records": ALL_LAYERS - {f"{PACKAGE}.records"},
    "engine": frozenset({"dbus_fast", "gpuguardd.daemon", "gpuguardd.bus", "gpuguardd.systemd",
                         "gpuguardd.cli", "gpuguardd.exporter"}),
    "leaves": ALL_LAYERS,
    "daemon": frozenset({"gpuguardd.cli"}),
    "bus": frozenset({"gpuguardd.daemon", "gpuguardd.cli"}),
    "exporter": frozenset({"gpuguardd.daemon", "gpuguardd.engine"}),
    "systemd": frozenset({"gpuguardd.daemon", "gpuguardd.cli"}),
    "notify": frozenset({"gpuguardd.daemon", "gpuguardd.engine", "gpuguardd.systemd",
                         "gpuguardd.exporter"}),
}


# Modules that are pure rules within their layer: no D-Bus, so they are tested without a bus
# and the D-Bus side (client, watcher) stays thin.
PURE: dict[str, frozenset[str]] = {
    "gpuguardd.systemd.rules": frozenset({"dbus_fast", "gpuguardd.bus"}),
    "gpuguardd.systemd.adoption": frozenset({"dbus_fast", "gpuguardd.bus"}),
    "gpuguardd.notify.events": frozenset({"dbus_fast", "gpuguardd.bus"}),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer a gpuguardd module belongs to: a subpackage's name, "leaves", or "" for the
    package itself (gpuguardd/__init__.py: the version only)."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    if parts[1] in LAYERS:
        return parts[1]
    if len(parts) == 2 and parts[1] in LEAVES:
        return "leaves"
    return "?" + module


def imported(module: str, path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything `module` imports, relative imports resolved;
    `from gpuguardd.x import y` names gpuguardd.x.y where y is a module, else gpuguardd.x."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield node.lineno, full if full in known else base
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            # importlib.import_module("gpuguardd.cli...") or __import__(...) with a literal
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in ("import_module", "__import__") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def within(name: str, target: str) -> bool:
    return name == target or name.startswith(target + ".")


def violations(root: Path = ROOT) -> list[str]:
    found = modules(root)
    known = set(found)
    problems = []
    for module, path in found.items():
        layer = layer_of(module)
        if layer.startswith("?"):
            problems.append(f"{module}: in no layer (add it to LAYERS or LEAVES)")
            continue
        for line, name in imported(module, path, known):
            for target in FORBIDDEN.get(layer, frozenset()) | PURE.get(module, frozenset()):
                if within(name, target):
                    who = f"pure {module}" if module in PURE else layer
                    problems.append(f"{path.relative_to(root.parent)}:{line}: {who} imports {name}")
    return problems


def test_every_module_is_in_a_layer_and_every_layer_has_modules() -> None:
    found = modules()
    layers = {layer_of(module) for module in found}
    assert not {layer for layer in layers if layer.startswith("?")}
    # A renamed package must not leave a rule guarding nothing.
    assert layers >= set(LAYERS) | {"leaves"}
    for leaf in LEAVES:
        assert f"{PACKAGE}.{leaf}" in found, leaf


def test_layer_rules_hold() -> None:
    assert violations() == []


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: a broken rule in each form an import takes is reported."""
    package = tmp_path / PACKAGE
    for sub in (*LAYERS, ""):
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "cli" / "output.py").write_text("")
    (package / "daemon" / "models.py").write_text("")
    cases = {
        "engine/a.py": "import dbus_fast.aio\n",
        "engine/b.py": "def f():\n    from gpuguardd.daemon import models\n",
        "engine/c.py": "from ..bus import names\n",
        "daemon/d.py": "from gpuguardd import cli\n",
        "daemon/e.py": "from gpuguardd.cli.output import x\n",
        "bus/f.py": "import importlib\nimportlib.import_module('gpuguardd.daemon.models')\n",
        "exporter/g.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gpuguardd.engine\n",
        "systemd/h.py": "from ..cli.output import x\n",
        "config.py": "from gpuguardd.engine import models\n",
        "cli/i.py": "from gpuguardd.daemon import models\n",  # allowed: the CLI may
        "engine/j.py": "from . import k\nfrom gpuguardd.errors import E\n",  # allowed
        "engine/k.py": "",
        "records/l.py": "from gpuguardd.engine import holders\n",
        "systemd/rules.py": "from gpuguardd.bus.connection import add_match\n",  # pure
        "systemd/client.py": "from gpuguardd.bus.connection import add_match\n",  # allowed
        "stray.py": "",
    }
    for name, text in cases.items():
        (package / name).write_text(text)
    problems = violations(package)
    for name in ("engine/a.py", "engine/b.py", "engine/c.py", "daemon/d.py", "daemon/e.py",
                 "bus/f.py", "exporter/g.py", "systemd/h.py", "config.py", "systemd/rules.py",
                 "records/l.py"):
        assert any(p.startswith(f"{PACKAGE}/{name}:") for p in problems), (name, problems)
    assert any(p.startswith(f"{PACKAGE}.stray: in no layer") for p in problems), problems
    assert len(problems) == 12, problems


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_rules_name_real_packages(layer: str) -> None:
    found = modules()
    for target in FORBIDDEN[layer]:
        if target.startswith(PACKAGE):
            assert target in found, target


def test_pure_modules_exist() -> None:
    found = modules()
    for module, targets in PURE.items():
        assert module in found, module
        assert all(t in found for t in targets if t.startswith(PACKAGE)), targets


def test_the_layer_table_names_every_module_of_its_layer() -> None:
    """docs/architecture.md "The layers" is how a newcomer finds a module: a module added to a
    layer, or moved, must show in that layer's row."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}  # layer -> the row's "what is in it" cell
    for line in doc.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().strip("`").rstrip("/") in LAYERS \
                and cells[1].strip().endswith("/`"):
            rows[cells[1].strip().strip("`").rstrip("/")] = cells[2]
        elif line.startswith("| shared leaves") and len(cells) > 3:
            rows["leaves"] = cells[2]
    missing = [module for module in modules()
               if layer_of(module) in rows and module != f"{PACKAGE}.{layer_of(module)}"
               and f"`{module.rsplit('.', 1)[-1]}`" not in rows[layer_of(module)]]
    assert set(rows) == set(LAYERS) | {"leaves"}, sorted(rows)
    assert not missing, f"docs/architecture.md's layer table does not name: {missing}"

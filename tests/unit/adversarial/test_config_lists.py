"""An assignment to a list key appends to the built-in default; only an empty
assignment resets it. `ProtectedExecutables=/opt/foo` must not strip nvidia-persistenced, the
fabric manager and Xorg of their protection."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuguardd import config as config_module
from gpuguardd.config import Config, load_config

# Every list key, with a value it accepts.
LIST_KEYS = [(section, key, name, value)
             for (section, key), (name, _) in config_module._KEYS.items()
             if isinstance(getattr(Config(), name), tuple)
             for value in ({"allow_majors": "120"}.get(name, "/opt/foo/bar"),)]


def test_every_list_key_is_covered() -> None:
    names = {name for _, _, name, _ in LIST_KEYS}
    assert {"protected_executables", "protected_units", "device_paths", "watch_units",
            "allow_majors"} <= names


def test_protected_executables_keep_the_default(tmp_path: Path) -> None:
    path = tmp_path / "local.conf"
    path.write_text("[Sweep]\nProtectedExecutables=/opt/foo\n")
    config = load_config([str(path)])
    for daemon in ("/usr/bin/nvidia-persistenced", "/usr/bin/nv-fabricmanager", "/usr/lib/xorg/Xorg"):
        assert daemon in config.protected_executables
    assert config.protected_executables[-1] == "/opt/foo"


@pytest.mark.parametrize(("section", "key", "name", "value"), LIST_KEYS,
                         ids=[f"{s}.{k}" for s, k, _, _ in LIST_KEYS])
def test_each_list_key_appends_to_its_default(tmp_path: Path, section: str, key: str, name: str,
                                              value: str) -> None:
    default = getattr(Config(), name)
    parsed = config_module._KEYS[(section, key)][1](value)
    path = tmp_path / "local.conf"
    path.write_text(f"[{section}]\n{key}={value}\n")
    assert getattr(load_config([str(path)]), name) == tuple(default) + tuple(parsed)
    # Two files: the drop-in appends to what the main file left (a repeated value counts once).
    other = "121" if name == "allow_majors" else "/opt/foo/baz"
    dropin = tmp_path / "50-more.conf"
    dropin.write_text(f"[{section}]\n{key}={other} {value}\n{key}={other}\n")
    assert getattr(load_config([str(path), str(dropin)]), name) == \
        tuple(default) + tuple(parsed) + tuple(config_module._KEYS[(section, key)][1](other))
    # Only an empty assignment resets, after which the list is exactly what follows.
    path.write_text(f"[{section}]\n{key}=\n{key}={value}\n")
    assert getattr(load_config([str(path)]), name) == tuple(parsed)
    path.write_text(f"[{section}]\n{key}={value}\n{key}=\n")
    assert getattr(load_config([str(path)]), name) == ()


def test_docs_say_lists_append_to_the_default() -> None:
    root = Path(__file__).resolve().parents[3]
    man = " ".join((root / "man" / "gpuguard.conf.5.scd").read_text().split())
    assert "the first one to the built-in default" in man
    readme = " ".join((root / "README.md").read_text().split())
    assert "each list assignment appends to the built-in default" in readme
    shipped = (root / "config" / "gpuguard.conf").read_text()
    assert "the first appends to the built-in default" in " ".join(shipped.replace("#", " ").split())


def test_no_field_is_forgotten_by_the_loader() -> None:
    # A list field the loader did not know would silently keep its default.
    list_fields = {f.name for f in dataclasses.fields(Config) if f.type.startswith("tuple")} - {
        "sources", "origins"}
    assert list_fields == {name for _, _, name, _ in LIST_KEYS}

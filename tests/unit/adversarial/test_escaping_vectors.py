"""The one display-escaping rule, as a table: tests/escaping_vectors.json lists inputs and
what a person is shown. gpuguardd/escaping.py (CLI, journal) is held to it here, the Cockpit
page's cockpit/src/escape.js in tests/cockpit/adversarial/test_cockpit_escaping.py, so the two
cannot drift."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from gpuguardd.escaping import escape_text

VECTORS_FILE = Path(__file__).resolve().parents[2] / "escaping_vectors.json"


def vectors() -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vectors"]
    return data


@pytest.mark.parametrize("vector", vectors(), ids=lambda v: str(v["name"]))
def test_the_cli_rule_meets_every_vector(vector: dict[str, Any]) -> None:
    assert escape_text(vector["input"]) == vector["expected"]
    # Escaping twice changes nothing: layers may each apply it.
    assert escape_text(vector["expected"]) == vector["expected"]


def test_the_table_covers_what_the_issue_names() -> None:
    """Bidi controls, other format characters (Cf) and controls (Cc), each made visible."""
    shown = "".join(v["input"] for v in vectors())
    for category in ("Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Cn"):
        assert any(unicodedata.category(ch) == category for ch in shown), category
    for ch in ("\u202e", "\u2066", "\u200f", "\x1b", "\x07"):
        assert ch in shown
        assert all(ch not in v["expected"] for v in vectors())

"""The size gpuguardd/ may have: at most 12,500 lines, no module over 450.

A newcomer should be able to follow a stop to "freed" in an afternoon. Lines are counted as
`wc -l` counts them, over every .py file of the package; ruff keeps the line length at 120,
so the count cannot be won by packing.
"""

from __future__ import annotations

import re
from pathlib import Path

# The tree's own sources, not whatever copy of the package is installed.
TREE = Path(__file__).resolve().parents[2]
ROOT = TREE / "gpuguardd"
PACKAGE_BUDGET = 12_500
MODULE_BUDGET = 450


def _lines() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): path.read_bytes().count(b"\n") for path in sorted(ROOT.rglob("*.py"))}


def test_the_package_is_within_its_line_budget() -> None:
    total = sum(_lines().values())
    assert total <= PACKAGE_BUDGET, f"gpuguardd/ has {total} lines, over the budget of {PACKAGE_BUDGET}"


def test_no_module_is_over_its_line_budget() -> None:
    over = {name: count for name, count in _lines().items() if count > MODULE_BUDGET}
    assert not over, f"modules over {MODULE_BUDGET} lines: {over}"


def test_the_line_length_is_not_raised_to_fit() -> None:
    ruff = (TREE / "pyproject.toml").read_text().split("[tool.ruff]", 1)[1].split("\n[", 1)[0]
    assert re.findall(r"^line-length = (\d+)$", ruff, re.MULTILINE) == ["120"]

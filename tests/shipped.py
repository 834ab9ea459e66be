"""The shipped files that call gpuguard's programs by their path (the units, the example
drop-ins, the Slurm scripts) are templates, FILE.in; the tests read them as the packages
install them, filled in by packaging/units.py with the default paths (/usr/bin,
/usr/libexec). Never the template itself: a test of a unit's contents or of a script's
behaviour is a test of what gets installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# By path: the name `packaging` is also PyPI's packaging.
_spec = importlib.util.spec_from_file_location("gpuguard_units", ROOT / "packaging" / "units.py")
assert _spec is not None and _spec.loader is not None
units = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(units)

shipped: Callable[[str], str] = units.shipped


def shipped_file(relative: str, folder: Path) -> Path:
    """`relative` (e.g. "systemd/gpuguardd.service") filled in, as a file of the same name in
    `folder`, with the template's permissions, for the tools that read a file."""
    path = folder / Path(relative).name
    path.write_text(shipped(relative))
    path.chmod((ROOT / f"{relative}.in").stat().st_mode & 0o777)
    return path

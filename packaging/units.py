"""Fill in where gpuguard's programs are installed, in the files that name them.

The unit files, gpuguard-notify's user unit, the example drop-ins and the Slurm scripts call
gpuguardd, gpuguard-exporter, gpuguardctl or gpuguard-notify by their full path, which
follows the installation's BINDIR and LIBEXECDIR. Each such file is kept as a template,
FILE.in under systemd/ or slurm/, with @BINDIR@ and @LIBEXECDIR@ where the directory goes.
This module is the one place that knows those placeholders and their default values: `make
units` (and through `make install-data` the .deb and the .rpm) runs it, and the tests read
the files it fills in.

    python3 packaging/units.py OUTDIR BINDIR=/usr/bin LIBEXECDIR=/usr/libexec

writes each template to OUTDIR under its path without .in (OUTDIR/systemd/gpuguardd.service,
OUTDIR/slurm/epilog.d/50-gpuguard, ...), with the template's permissions.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The placeholders, with their values on Debian and Fedora (and for make install's PREFIX=/usr).
DEFAULTS: Mapping[str, str] = {"BINDIR": "/usr/bin", "LIBEXECDIR": "/usr/libexec"}
FOLDERS = ("systemd", "slurm")
PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


class TemplateError(Exception):
    pass


def templates(root: Path = ROOT) -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (root / folder).rglob("*.in"))


def fill(text: str, paths: Mapping[str, str] = DEFAULTS) -> str:
    def value(match: re.Match[str]) -> str:
        if match.group(1) not in paths:
            raise TemplateError(f"unknown placeholder {match.group(0)}")
        return paths[match.group(1)]

    return PLACEHOLDER.sub(value, text)


def shipped(relative: str, paths: Mapping[str, str] = DEFAULTS) -> str:
    """The file installed from `relative` + ".in" (e.g. "systemd/gpuguardd.service")."""
    template = ROOT / f"{relative}.in"
    try:
        return fill(template.read_text(), paths)
    except TemplateError as e:
        raise TemplateError(f"{template}: {e}") from None


def parse_paths(assignments: Sequence[str]) -> dict[str, str]:
    """NAME=DIRECTORY for every placeholder, each once, absolute, and nothing else."""
    paths: dict[str, str] = {}
    for assignment in assignments:
        name, equals, directory = assignment.partition("=")
        if not equals or name not in DEFAULTS or name in paths:
            raise TemplateError(f"{assignment!r}: expected each of {', '.join(DEFAULTS)} once, as NAME=DIRECTORY")
        if not directory.startswith("/") or "\n" in directory:
            raise TemplateError(f"{assignment!r}: the directory must be an absolute path")
        paths[name] = directory
    missing = [name for name in DEFAULTS if name not in paths]
    if missing:
        raise TemplateError(f"no value for {', '.join(missing)}")
    return paths


def write_all(outdir: Path, paths: Mapping[str, str]) -> list[Path]:
    written = []
    for template in templates():
        relative = template.relative_to(ROOT).with_suffix("")
        target = outdir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(shipped(str(relative), paths))
        target.chmod(template.stat().st_mode & 0o777)
        written.append(target)
    return written


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: units.py OUTDIR " + " ".join(f"{name}=DIRECTORY" for name in DEFAULTS), file=sys.stderr)
        return 2
    try:
        write_all(Path(argv[0]), parse_paths(argv[1:]))
    except TemplateError as e:
        print(f"units.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

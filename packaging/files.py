"""The one list of the files `make install` puts outside the Python package: packaging/files.txt.

`make install-python` writes its programs, `make install-data` installs the rest, `make
uninstall` removes them, `make rpm-files` writes the .rpm's %files from it, and the tests hold
`make install`, the .deb and the .rpm to it. Each line is MODE SOURCE DESTINATION [config],
with the Makefile's directories as $(NAME) (files.txt's header says more). The Makefile
passes every directory it knows:

    python3 packaging/files.py data UNITS=build/units BINDIR=/usr/bin ...

data      MODE SOURCE DESTINATION FLAG, a line per file to install (FLAG: config or -)
programs  MODE MODULE DESTINATION, a line per program (install-python writes them)
remove    DESTINATION of every file uninstall removes unasked (all but the configuration)
config    SOURCE DESTINATION of the configuration (installed only where missing, removed
          only while unchanged)
dirs      gpuguard's own directories, deepest first (uninstall removes them once empty)
rpm       the %files lines of all of it
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

LIST = Path(__file__).resolve().parent / "files.txt"
PROGRAM = "program:"
CONFIG = "config"
VARIABLE = re.compile(r"\$\(([A-Z_]+)\)")
DESTINATION = re.compile(r"\$\(([A-Z_]+)\)/(.+)")
MODE = re.compile(r"[0-7]{3,4}")
MODULE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")
MANDIR = "$(MANDIR)/"


class ListError(Exception):
    pass


@dataclass(frozen=True)
class Entry:
    """One line of files.txt, its $(NAME)s not filled in."""

    mode: str
    source: str
    destination: str
    config: bool

    @property
    def module(self) -> str | None:
        """The module whose main() the program runs; None for a file installed as it is."""
        return self.source.removeprefix(PROGRAM) if self.source.startswith(PROGRAM) else None

    def owned_dirs(self) -> list[str]:
        """The directories of the destination that are gpuguard's own, shallowest first:
        those below the Makefile's directory, when the first of them starts with gpuguard."""
        match = DESTINATION.fullmatch(self.destination)
        assert match is not None, self.destination
        parts = match.group(2).split("/")[:-1]
        if not parts or not parts[0].startswith("gpuguard"):
            return []
        return [f"$({match.group(1)})/" + "/".join(parts[:n]) for n in range(1, len(parts) + 1)]


def parse_line(fields: Sequence[str]) -> Entry:
    if len(fields) not in (3, 4) or (len(fields) == 4 and fields[3] != CONFIG):
        raise ListError(f"expected MODE SOURCE DESTINATION [{CONFIG}]")
    mode, source, destination = fields[:3]
    if not MODE.fullmatch(mode):
        raise ListError(f"the mode {mode!r} is not octal")
    if source.startswith(PROGRAM) and not MODULE.fullmatch(source.removeprefix(PROGRAM)):
        raise ListError(f"{source!r} names no module")
    if not DESTINATION.fullmatch(destination) or "/../" in f"/{destination}/" or "//" in destination:
        raise ListError("the destination must be below one of the Makefile's directories, as $(NAME)/...")
    return Entry(mode, source, destination, len(fields) == 4)


def parse(text: str, where: str = str(LIST)) -> list[Entry]:
    entries: list[Entry] = []
    destinations: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        try:
            entry = parse_line(fields)
            if entry.destination in destinations:
                raise ListError("installed twice")
        except ListError as e:
            raise ListError(f"{where}:{number}: {e}: {line.strip()!r}") from None
        destinations.add(entry.destination)
        entries.append(entry)
    return entries


def read(path: Path = LIST) -> list[Entry]:
    return parse(path.read_text(), str(path))


def variables(entries: Iterable[Entry]) -> set[str]:
    return {name for e in entries for name in VARIABLE.findall(f"{e.source} {e.destination}")}


def fill(text: str, values: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        if match.group(1) not in values:
            raise ListError(f"no value for $({match.group(1)}) in {text}")
        return values[match.group(1)]

    return VARIABLE.sub(value, text)


def parse_values(assignments: Sequence[str]) -> dict[str, str]:
    """NAME=VALUE, each name once; a value is one word (the Makefile splits the lines on blanks)."""
    values: dict[str, str] = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        if not equals or not re.fullmatch(r"[A-Z_]+", name) or name in values:
            raise ListError(f"{assignment!r}: expected NAME=VALUE, each name once")
        if not value or re.search(r"\s", value):
            raise ListError(f"{assignment!r}: the value must be one word")
        values[name] = value
    return values


def owned_dirs(entries: Iterable[Entry], values: Mapping[str, str]) -> list[str]:
    """gpuguard's own directories, filled in, deepest first."""
    found = {fill(d, values) for e in entries for d in e.owned_dirs()}
    return sorted(found, key=lambda d: (-d.count("/"), d))


def rpm_files(entries: Sequence[Entry], values: Mapping[str, str]) -> list[str]:
    """%files lines: the directories owned, the configuration %config(noreplace), and the man
    pages with a * for the compression the package build adds."""
    lines = [f"%dir {d}" for d in sorted(owned_dirs(entries, values))]
    for e in entries:
        path = fill(e.destination, values)
        if e.config:
            lines.append(f"%config(noreplace) {path}")
        elif e.destination.startswith(MANDIR):
            lines.append(f"{path}*")
        else:
            lines.append(path)
    return lines


def report(command: str, entries: Sequence[Entry], values: Mapping[str, str]) -> list[str]:
    files = [(e, fill(e.source, values), fill(e.destination, values)) for e in entries]
    for _, _, destination in files:
        if not destination.startswith("/"):
            raise ListError(f"{destination}: not an absolute path")
    if command == "data":
        return [f"{e.mode} {s} {d} {CONFIG if e.config else '-'}" for e, s, d in files if e.module is None]
    if command == "programs":
        return [f"{e.mode} {e.module} {d}" for e, _, d in files if e.module is not None]
    if command == "remove":
        return [d for e, _, d in files if not e.config]
    if command == "config":
        return [f"{s} {d}" for e, s, d in files if e.config]
    if command == "dirs":
        return owned_dirs(entries, values)
    if command == "rpm":
        return rpm_files(entries, values)
    raise ListError(f"unknown command {command!r}")


COMMANDS = ("data", "programs", "remove", "config", "dirs", "rpm")


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: files.py {{{','.join(COMMANDS)}}} NAME=VALUE...", file=sys.stderr)
        return 2
    try:
        entries = read()
        values = parse_values(argv[1:])
        missing = sorted(variables(entries) - values.keys())
        if missing:
            raise ListError(f"no value for {', '.join(missing)}")
        lines = report(argv[0], entries, values)
    except ListError as e:
        print(f"files.py: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The project's documents are its own: nothing in the tree points at a file outside it (a
contract kept elsewhere, notes on another machine) or at a tracker's issue number that a
reader of the tree cannot look up, and every relative link in a Markdown file reaches a file
of the tree. The reference lives in docs/, the man pages and bench/README.md; a link left
behind by a move fails here."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", ".venv-nobody", "node_modules", "build", "dist", "__pycache__",
             ".pytest_cache", ".mypy_cache", ".ruff_cache"}
TEXT_SUFFIXES = {".py", ".md", ".scd", ".xml", ".c", ".h", ".js", ".jsx", ".mjs", ".css", ".html",
                 ".cfg", ".toml", ".in", ".sh", ".conf", ".service", ".socket", ".policy", ".spec",
                 ".txt", ".yml", ".yaml"}
TEXT_NAMES = {"Makefile", "NEWS", "rules", "control", "run", "50-gpuguard", "unkillable-step"}
# Outside the tree: the contract and the e2e notes as they once were kept beside it.
OUTSIDE = re.compile(r"\.\./shared/|/work/shared|\bAPI\.md\b|E2E-NOTES")
# Upstream projects whose bug reports the code and docs cite by number ("sglang issue 31746",
# named at most a few words before): those are looked up on the project's own tracker. Any
# other "issue N" is this project's.
UPSTREAM = {"cupy", "nvitop", "nvtop", "open-gpu-kernel-modules", "go-nvml", "dcgm-exporter",
            "sglang", "vllm", "cosmic-ext-applet-system-monitor", "btop", "roc-smi",
            "legacy-rocm-build", "radeontop"}
ISSUE = re.compile(r"\b[Ii]ssues?\s+\d")
CONTINUATION = re.compile(r"\s*\n\s*(?:#|\*|//)?\s*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def text_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder, name)
            if (path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES) and path != Path(__file__).resolve():
                yield path


def test_the_scan_sees_the_tree() -> None:
    names = {str(p.relative_to(ROOT)) for p in text_files()}
    assert {"README.md", "NEWS", "docs/contract.md", "gpuguardd/records/report.py",
            "dbus/org.gpuguard.GpuGuard1.xml", "man/gpuguard-dbus.7.scd"} <= names


def test_nothing_points_outside_the_tree() -> None:
    found = []
    for path in text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_no_issue_numbers_of_our_own() -> None:
    found = []
    for path in text_files():
        # One line of prose: a reference wrapped over two lines ("(nvitop" / "# issues 75")
        # still has its project before it.
        text = CONTINUATION.sub(" ", path.read_text(errors="replace"))
        for match in ISSUE.finditer(text):
            if not any(project in text[max(0, match.start() - 40):match.start()].lower()
                       for project in UPSTREAM):
                found.append(f"{path.relative_to(ROOT)}: ...{text[match.start():match.end() + 40]}")
    assert not found, ("say what the test or code is about, not which issue asked for it "
                       "(an upstream project's report: add the project to UPSTREAM):\n"
                       + "\n".join(found))


def test_relative_links_in_markdown_reach_a_file() -> None:
    broken = []
    for path in text_files():
        if path.suffix != ".md":
            continue
        for target in LINK.findall(path.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            if not (path.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken

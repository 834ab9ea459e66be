"""The commit-msg hook CONTRIBUTING.md asks for (.githooks/commit-msg): the house's subject and
body rules, checked before a commit is made rather than found in review."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"


@pytest.mark.parametrize(("message", "ok"), [
    ("Exporter: serve scrapes side by side\n\nA slow scraper held the rest.\n", True),
    ("x" * 72 + "\n\nwhy\n", True),
    ("x" * 73 + "\n\nwhy\n", False),  # one character over
    ("é" * 72 + "\n\nwhy\n", True),  # characters, not bytes
    ("Subject\nbody on the second line\n", False),
    ("Subject only\n", False),
    ("Subject\n\n\n# a comment git strips\n", False),
    ("# Please enter the commit message\nSubject\n\nwhy\n", True),
])
def test_commit_msg_hook(tmp_path: Path, message: str, ok: bool) -> None:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    result = subprocess.run([str(HOOK), str(path)], check=False, capture_output=True, text=True,
                            env={"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
    assert (result.returncode == 0) == ok, result.stderr
    assert bool(result.stderr) != ok

"""packaging/deps.sh, what `make deps` runs: it installs only the Debian packages that are
missing, the desktop's without their recommends, and asks for root only when one is.

Each test runs a copy of the script with a package no machine has added to one of its groups;
--dry-run prints the apt-get command instead of running it. dpkg-query is the real one."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "deps.sh"
FAKE = "gpuguard-no-such-package"
# As nobody when the tests run as root, so that the script cannot install anything.
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []


def with_lists(tmp_path: Path, packages: str, no_recommends: str) -> Path:
    """A copy of the script whose two groups are exactly these."""
    text = SCRIPT.read_text()
    text, plain = re.subn(r"^PACKAGES\+?=\([^)]*\)\n", "", text, flags=re.M)
    text, lean = re.subn(r"^NO_RECOMMENDS=\([^)]*\)$", f"PACKAGES=({packages})\nNO_RECOMMENDS=({no_recommends})",
                         text, flags=re.M)
    assert plain >= 1 and lean == 1, "the script's package groups moved"
    copy = tmp_path / "deps.sh"
    copy.write_text(text)
    return copy


def run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The text on the command line: nobody may not reach tmp_path.
    return subprocess.run([*NOBODY, "bash", "-c", script.read_text(), "deps.sh", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def commands(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("apt-get ")
            and not line.endswith(" npm")]


def test_installs_only_what_is_missing(tmp_path: Path) -> None:
    # dpkg and bash are on every Debian machine: only the fake one is missing.
    done = run(with_lists(tmp_path, f"dpkg {FAKE}", "bash"), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert commands(done) == [f"apt-get install -y -qq {FAKE}"], done.stdout


def test_the_desktop_group_goes_without_recommends(tmp_path: Path) -> None:
    done = run(with_lists(tmp_path, "dpkg", f"bash {FAKE}"), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert commands(done) == [f"apt-get install -y -qq --no-install-recommends {FAKE}"], done.stdout


def test_nothing_missing_needs_no_root(tmp_path: Path) -> None:
    done = run(with_lists(tmp_path, "dpkg", "bash"))
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stdout + done.stderr


def test_something_missing_needs_root_and_says_what(tmp_path: Path) -> None:
    done = run(with_lists(tmp_path, f"dpkg {FAKE}", "bash"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"run as root to install: {FAKE}" in done.stderr


def test_the_makefile_runs_the_script_and_keeps_no_list() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^deps:\n\tpackaging/deps\.sh\n", makefile, flags=re.M), "make deps runs the script"
    assert "APT_" not in makefile and "dpkg-query" not in makefile, "the packages are listed once, in deps.sh"
    assert os.access(SCRIPT, os.X_OK)

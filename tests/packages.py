"""Build the .deb and the .rpm once per test session, through the Makefile's targets.

tests/packaging/test_packaging.py inspects them; tests/e2e/test_package_install.py installs the .deb in
a throwaway systemd. Both ask here, so each package is built once however many tests use it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpuguardd import __version__
from tests.leftovers import at_session_end

ROOT = Path(__file__).resolve().parent.parent
# Tools of `make deb`/`make rpm`/`make man`, installed by `make deps` (APT_PACKAGES).
TOOLS = ("dpkg-buildpackage", "dh", "lintian", "rpmbuild", "scdoc", "man")

_built: dict[str, Path] = {}
_workdir: list[Path] = []


def require_tools() -> None:
    """Fail in CI (make deps installs them), skip on a developer machine without them."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (dpkg-buildpackage and install tests)")
    if missing:
        message = f"missing for the packaging tests: {', '.join(missing)} (run make deps as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _remove_workdir() -> None:
    shutil.rmtree(_workdir.pop(), ignore_errors=True)
    _built.clear()


def workdir() -> Path:
    if not _workdir:
        _workdir.append(Path(tempfile.mkdtemp(prefix="gpuguard-packages.")))
        # Removed when the session ends, before tests/leftovers.py looks (atexit comes later).
        at_session_end(_remove_workdir)
    return _workdir[0]


def make(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"make {' '.join(args)} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done


def build(kind: str) -> Path:
    """dist/gpuguard_<version>_all.deb or dist/gpuguard-<version>-1.noarch.rpm, built once."""
    if kind not in _built:
        require_tools()
        dist = workdir() / kind
        make(kind, f"DIST={dist}")
        name = f"gpuguard_{__version__}_all.deb" if kind == "deb" else f"gpuguard-{__version__}-1.noarch.rpm"
        path = dist / name
        assert path.is_file(), f"make {kind} did not produce {path}"
        _built[kind] = path
    return _built[kind]


def build_dir(kind: str) -> Path:
    """Where `make deb`/`make rpm` left its intermediate files (the .changes for lintian)."""
    build(kind)
    return workdir() / kind / f"{kind}-build"

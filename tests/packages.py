"""Build the release tarball, the .deb and the .rpm once per test session, through the
Makefile's targets, as a distribution does: the packages come from the unpacked tarball, with
no .git (`make dist`, packaging/README.md).

tests/packaging/test_packaging.py inspects them; tests/e2e/test_package_install.py installs the .deb in
a throwaway systemd. Both ask here, so each package is built once however many tests use it.
The tarball packs the working tree (DIST_REF=worktree: what `git archive` of it would hold,
plus the built Cockpit page), so uncommitted work is what gets tested.
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
# Tools of `make deb`/`make rpm`/`make man`, installed by `make deps` (packaging/deps.sh).
TOOLS = ("dpkg-buildpackage", "dh", "lintian", "rpmbuild", "scdoc", "man")

_built: dict[str, Path] = {}
_workdir: list[Path] = []


def require_tools() -> None:
    """Fail in CI (make deps installs them), skip on a developer machine without them."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (dpkg-buildpackage and install tests)")
    if missing:
        pytest.skip(f"missing for the packaging tests: {', '.join(missing)} (run make deps as root)")


def _remove_workdir() -> None:
    shutil.rmtree(_workdir.pop(), ignore_errors=True)
    _built.clear()


def workdir() -> Path:
    if not _workdir:
        _workdir.append(Path(tempfile.mkdtemp(prefix="gpuguard-packages.")))
        # Removed when the session ends, before tests/leftovers.py looks (atexit comes later).
        at_session_end(_remove_workdir)
    return _workdir[0]


def make(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["make", "--no-print-directory", "-C", str(cwd), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"make {' '.join(args)} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done


def tarball() -> Path:
    """gpuguard-<version>.tar.gz, as `make dist` makes it of the working tree; built once."""
    if "dist" not in _built:
        require_tools()
        dist = workdir() / "dist"
        make("dist", "DIST_REF=worktree", f"DIST={dist}")
        path = dist / f"gpuguard-{__version__}.tar.gz"
        assert path.is_file(), f"make dist did not produce {path}"
        _built["dist"] = path
    return _built["dist"]


def release_tree(version: str = __version__) -> Path:
    """The tarball unpacked: gpuguard-<version>/, no .git. Another `version` is the same tree
    with gpuguardd.__version__ set to it (a release after this one, for upgrades)."""
    key = f"tree-{version}"
    if key not in _built:
        top = workdir() / key
        top.mkdir()
        subprocess.run(["tar", "-xzf", str(tarball()), "-C", str(top)], check=True)
        tree = top / f"gpuguard-{__version__}"
        assert not (tree / ".git").exists()
        if version != __version__:
            init = tree / "gpuguardd" / "__init__.py"
            text = init.read_text()
            assert f'__version__ = "{__version__}"\n' in text
            init.write_text(text.replace(f'__version__ = "{__version__}"', f'__version__ = "{version}"'))
            tree = tree.rename(top / f"gpuguard-{version}")
        _built[key] = tree
    return _built[key]


def build(kind: str, version: str = __version__) -> Path:
    """gpuguard_<version>_all.deb or gpuguard-<version>-1.noarch.rpm, built once from the
    unpacked release tarball (release_tree)."""
    key = f"{kind}-{version}"
    if key not in _built:
        require_tools()
        dist = workdir() / key
        make(kind, f"DIST={dist}", cwd=release_tree(version))
        name = f"gpuguard_{version}_all.deb" if kind == "deb" else f"gpuguard-{version}-1.noarch.rpm"
        path = dist / name
        assert path.is_file(), f"make {kind} did not produce {path}"
        _built[key] = path
    return _built[key]


def build_dir(kind: str) -> Path:
    """Where `make deb`/`make rpm` left its intermediate files (the .changes for lintian)."""
    return build(kind).parent / f"{kind}-build"

"""The files that call gpuguard's programs by their path are templates (FILE.in) that
packaging/units.py fills in with the installation's BINDIR and LIBEXECDIR: `make install`,
the .deb and the .rpm all install what it writes (tests/packaging checks the installed
files)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shipped import ROOT, units

SCRIPT = ROOT / "packaging" / "units.py"
# A program's path written out: it would not follow BINDIR or LIBEXECDIR.
HARD_CODED = re.compile(r"/usr/(?:local/)?(?:bin|libexec)/gpuguard")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_no_shipped_file_names_a_program_path_of_its_own() -> None:
    files = [p for folder in units.FOLDERS for p in (ROOT / folder).rglob("*") if p.is_file()]
    assert len(files) > 10
    hard = [str(p.relative_to(ROOT)) for p in files if HARD_CODED.search(p.read_text())]
    assert hard == [], "write @BINDIR@ or @LIBEXECDIR@ in a FILE.in template"
    loose = [str(p.relative_to(ROOT)) for p in files if p.suffix != ".in" and units.PLACEHOLDER.search(p.read_text())]
    assert loose == [], "a file with placeholders is a template, FILE.in"


def test_every_template_is_filled_in_with_the_given_directories(tmp_path: Path) -> None:
    done = run(str(tmp_path), "BINDIR=/opt/gg/bin", "LIBEXECDIR=/opt/gg/libexec")
    assert done.returncode == 0, done.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(str(t.relative_to(ROOT).with_suffix("")) for t in units.templates())
    assert {"systemd/gpuguardd.service", "systemd/gpuguard-exporter.service",
            "systemd/user/gpuguard-notify.service", "slurm/epilog.d/50-gpuguard",
            "slurm/prolog.d/50-gpuguard", "slurm/unkillable-step",
            "systemd/dropins/vllm-.service.d/gpuguard.conf"} <= set(written)
    for name in written:
        text = (tmp_path / name).read_text()
        assert not units.PLACEHOLDER.search(text), name
        assert "/opt/gg/" in text, name
        assert (tmp_path / name).stat().st_mode & 0o777 == (ROOT / f"{name}.in").stat().st_mode & 0o777, name
    unit = (tmp_path / "systemd/gpuguardd.service").read_text()
    assert "\nExecStart=/opt/gg/libexec/gpuguard/gpuguardd\n" in unit
    epilog = (tmp_path / "slurm/epilog.d/50-gpuguard").read_text()
    assert "GPUGUARDCTL=${GPUGUARDCTL:-/opt/gg/bin/gpuguardctl}\n" in epilog


def test_the_defaults_are_debians_and_fedoras() -> None:
    assert units.DEFAULTS == {"BINDIR": "/usr/bin", "LIBEXECDIR": "/usr/libexec"}
    assert "\nExecStart=/usr/libexec/gpuguard/gpuguardd\n" in units.shipped("systemd/gpuguardd.service")


@pytest.mark.parametrize("args, error", [
    (["BINDIR=/usr/bin"], "no value for LIBEXECDIR"),
    (["BINDIR=/usr/bin", "LIBEXECDIR=/usr/libexec", "DATADIR=/usr/share"], "'DATADIR=/usr/share'"),
    (["BINDIR=/usr/bin", "BINDIR=/opt/bin", "LIBEXECDIR=/usr/libexec"], "'BINDIR=/opt/bin'"),
    (["BINDIR=bin", "LIBEXECDIR=/usr/libexec"], "must be an absolute path"),
])
def test_every_placeholder_is_given_once_and_nothing_else(tmp_path: Path, args: list[str], error: str) -> None:
    done = run(str(tmp_path / "out"), *args)
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_placeholder_in_a_template_is_an_error() -> None:
    with pytest.raises(units.TemplateError, match="@DATADIR@"):
        units.fill("ExecStart=@DATADIR@/x\n")

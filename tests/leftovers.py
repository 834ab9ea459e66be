"""A test run leaves nothing behind: no files in /tmp, no processes, no mounts.

tests/conftest.py takes these hooks, so every run (make check, make test, one file) is held
to it:

* Files. The run gets a temporary directory of its own and points TMPDIR (and `tempfile`) at
  it, with pytest's tmp_path base inside it, so everything that honours TMPDIR (tempfile, the
  dbus-daemon's socket, chromium, mktemp, the helpers' subprocesses) lands there, apart from
  other runs on a shared machine. At the end pytest's base is removed and anything else left
  in the directory fails the run (and is removed, so that even a failing run leaves nothing).
  It is world-writable and sticky like /tmp: the tests run programs as nobody too.
* Mounts. A mount point left under the run's directory (the e2e machine's root is there)
  fails the run.
* By name. Something that writes to /tmp, /var/tmp or /dev/shm by name, a cgroup left in a
  hierarchy (the tests make them like systemd's, the e2e machines one each), and other mounts
  are caught by comparing them before and after. Other runs on a shared machine (several
  engineers, or one engineer's two checkouts) make them too, so these fail the run only with
  GPUGUARD_LEFTOVERS=strict, which .ci/run sets (CI has the machine to itself), and are
  listed as warnings otherwise.
* Processes. Each process the run starts inherits GPUGUARD_TEST_RUN=<token> from this one
  (unless a test hands it a made-up environment); at the end any live process that still
  carries the token is reported, killed, and fails the run.

`--basetemp` given on the command line is the developer's to keep: then pytest's base stays.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOKEN_VARIABLE = "GPUGUARD_TEST_RUN"
# Processes the teardowns ended may take a moment to be reaped or to exit after their bus went.
PROCESS_GRACE_SEC = 5.0
WARNINGS_SHOWN = 5
SHARED_DIRS = (Path("/var/tmp"), Path("/dev/shm"))
CGROUP_HIERARCHIES = tuple(Path("/sys/fs/cgroup") / name for name in ("", "systemd", "unified", "freezer"))


@dataclass
class Snapshot:
    token: str
    run_dir: Path
    basetemp: Path | None
    by_name_before: set[str]
    mounts_before: set[str]
    cleanups: list[Callable[[], None]] = field(default_factory=list)


_snapshot: Snapshot | None = None


def at_session_end(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` at the end of the session, before the leftover check (not at exit, which
    comes after it): for helpers that keep a directory for the whole session."""
    if _snapshot is None:
        raise RuntimeError("at_session_end outside a test session")
    _snapshot.cleanups.append(cleanup)


def _strict() -> bool:
    return os.environ.get("GPUGUARD_LEFTOVERS") == "strict"


def _tmp_entries(root: Path) -> set[str]:
    try:
        return set(os.listdir(root))
    except OSError:
        return set()


def _by_name(system_tmp: Path) -> set[str]:
    """Entries of the shared temporary directories, and cgroups two levels deep (where the
    tests and the e2e machines make theirs), as paths."""
    found = {str(root / name) for root in (system_tmp, *SHARED_DIRS) for name in _tmp_entries(root)}
    for hierarchy in CGROUP_HIERARCHIES:
        for top in _tmp_entries(hierarchy):
            if (hierarchy / top).is_dir():
                found.add(str(hierarchy / top))
                found.update(str(hierarchy / top / name) for name in _tmp_entries(hierarchy / top)
                             if (hierarchy / top / name).is_dir())
    return found


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            return {line.split()[4] for line in mounts if len(line.split()) > 4}
    except OSError:
        return set()


def _carriers(token: str) -> dict[int, str]:
    """Live processes (not this one, not zombies) whose environment carries the run's token."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found[int(entry)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue  # gone meanwhile, or another user's that we may not read
    return found


def pytest_configure(config: pytest.Config) -> None:
    global _snapshot
    if _snapshot is not None or hasattr(config, "workerinput"):
        return
    token = uuid.uuid4().hex
    system_tmp = Path(tempfile.gettempdir())
    run_dir = Path(tempfile.mkdtemp(prefix="gpuguard-tests-", dir=system_tmp))
    os.chmod(run_dir, 0o1777)
    by_name_before = _by_name(system_tmp) - {str(run_dir)}
    basetemp: Path | None = None
    if config.option.basetemp is None:
        basetemp = run_dir / "pytest"
        config.option.basetemp = str(basetemp)
        # The tmpdir plugin reads the option when it is configured, which may be before this.
        factory = getattr(config, "_tmp_path_factory", None)
        if factory is not None:
            factory._given_basetemp = basetemp
    os.environ["TMPDIR"] = str(run_dir)
    tempfile.tempdir = str(run_dir)
    os.environ[TOKEN_VARIABLE] = token
    _snapshot = Snapshot(token=token, run_dir=run_dir, basetemp=basetemp,
                         by_name_before=by_name_before, mounts_before=_mount_points())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _check(snap: Snapshot) -> tuple[list[str], list[str]]:
    """(failures, warnings) for what the run left; removes what it can of what it finds."""
    failures: list[str] = []
    warnings: list[str] = []

    deadline = time.monotonic() + PROCESS_GRACE_SEC
    carriers = _carriers(snap.token)
    while carriers and time.monotonic() < deadline:
        time.sleep(0.1)
        carriers = _carriers(snap.token)
    for pid, cmdline in sorted(carriers.items()):
        failures.append(f"process {pid} still running: {cmdline}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    mounts = _mount_points()
    ours = sorted(point for point in mounts - snap.mounts_before
                  if Path(point).is_relative_to(snap.run_dir))
    for point in ours:
        failures.append(f"mount left: {point}")
    if ours:
        # rmtree crosses mount points: under the e2e machine's root lies the host's /.
        failures.append(f"{snap.run_dir} kept: unmount the above, then remove it")
    else:
        if snap.basetemp is not None:
            shutil.rmtree(snap.basetemp, ignore_errors=True)
        for name in sorted(_tmp_entries(snap.run_dir)):
            failures.append(f"left in TMPDIR: {snap.run_dir / name}")
            _remove(snap.run_dir / name)
        try:
            snap.run_dir.rmdir()
        except OSError as err:
            failures.append(f"cannot remove the run's TMPDIR {snap.run_dir}: {err}")

    system_tmp = snap.run_dir.parent
    found = (failures if _strict() else warnings)
    for path in sorted(_by_name(system_tmp) - snap.by_name_before):
        found.append(f"new (written by name, not through TMPDIR?): {path}")
    for point in sorted(mounts - snap.mounts_before):
        if not Path(point).is_relative_to(snap.run_dir):
            found.append(f"mount left: {point}")
    return failures, warnings


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _snapshot
    snap = _snapshot
    if snap is None:
        return
    _snapshot = None
    for cleanup in reversed(snap.cleanups):
        cleanup()
    failures, warnings = _check(snap)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    if (warnings or failures) and reporter is not None:
        reporter.write("\n")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)

    if warnings:
        say(f"leftovers check: {len(warnings)} new in /tmp, /var/tmp, /dev/shm, cgroups or mounts, maybe another run's "
            "(fails with GPUGUARD_LEFTOVERS=strict, as in CI):")
        for line in warnings[:WARNINGS_SHOWN]:
            say(f"  {line}")
        if len(warnings) > WARNINGS_SHOWN:
            say(f"  ... and {len(warnings) - WARNINGS_SHOWN} more")
    if failures:
        say("leftovers check FAILED: a test run must leave nothing behind")
        for line in failures:
            say(f"  {line}")
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

"""The unit watch's pure rules: which units are watched, a unit's state, which change is a stop
to sweep, how automatic sweeps name who asked. No D-Bus, no I/O: the CLI's hook verbs import it."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuguardd.records.enums import RequesterKind

STOPPED_STATES = frozenset({"inactive", "failed"})
# A unit in these states runs (or is about to): its GPUs are its own.
RUNNING_STATES = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})

# requested_by of automatic sweeps: the ExecStopPost drop-in's (only root may be recorded as it,
# service.py), the watcher's (one stop's two share one sweep), a Slurm epilog's asked by root, and
# the one a daemon runs at its start for a unit that stopped while none ran (daemon/units.py).
HOOK_PREFIX = "hook:"
WATCH_PREFIX = "watch:"
SLURM_PREFIX = "slurm:"
RECOVERED_PREFIX = "recovered:"
_LEGACY_KINDS = ((HOOK_PREFIX, RequesterKind.HOOK), (WATCH_PREFIX, RequesterKind.WATCH),
                 (SLURM_PREFIX, RequesterKind.SLURM), (RECOVERED_PREFIX, RequesterKind.RECOVERED))


def legacy_requester_kind(requested_by: str) -> RequesterKind:
    """The kind for an older daemon's in-flight record (daemon/inflight.py), from its requested_by:
    only the daemon's own forms are bare ("hook:<unit>", "watch:<unit>"...); every other caller
    is named with its uid ("uid 1000 (alice) :1.4", "hook:x via uid 65534 ..."): a space."""
    if " " in requested_by:
        return RequesterKind.HOOK_NONROOT if requested_by.startswith(HOOK_PREFIX) else RequesterKind.MANUAL
    return next((kind for prefix, kind in _LEGACY_KINDS
                 if requested_by.startswith(prefix) and len(requested_by) > len(prefix)), RequesterKind.MANUAL)


# A unit's object path: this prefix, then its name with each byte outside [A-Za-z0-9] as _xx (sd_bus_path_encode).
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"

_ESCAPE = re.compile(r"_([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class UnitState:
    unit: str
    active_state: str  # "" when systemd does not know the unit (not loaded)
    invocation_id: str = ""
    result: str = ""

    @property
    def stopped(self) -> bool:
        return self.active_state in STOPPED_STATES or not self.active_state

    @property
    def running(self) -> bool:
        return self.active_state in RUNNING_STATES


def unit_name_from_path(path: str) -> str:
    if not path.startswith(UNIT_PATH_PREFIX):
        return ""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), path.removeprefix(UNIT_PATH_PREFIX))


def matches(unit: str, patterns: Iterable[str]) -> bool:
    """fnmatch over unit names; a pattern without a suffix means a .service ("sglang-*")."""
    return any(fnmatch.fnmatchcase(unit, pattern)
               or ("." not in pattern.rsplit("*", 1)[-1] and unit.endswith(".service")
                   and fnmatch.fnmatchcase(unit, pattern + ".service"))
               for pattern in patterns)


def is_stop_to_sweep(previous: str, state: UnitState, job_done: bool) -> bool:
    """Stopped (or unloaded) after a job on it finished or after it was seen running: a
    daemon-reload re-announcing an inactive unit is neither, and must not sweep every watched unit."""
    return state.stopped and (job_done or not (previous in STOPPED_STATES or previous == ""))

"""The unit watch's pure rules (daemon/units.py has the map): which units are watched, a unit's
state, which change is a stop to sweep, how automatic sweeps name who asked. No D-Bus, no
I/O, nothing heavy: the CLI's hook verbs import it."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuguardd.records.enums import RequesterKind

STOPPED_STATES = frozenset({"inactive", "failed"})
# A unit in these states runs (or is about to): its GPUs are its own.
RUNNING_STATES = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})

# requested_by of automatic sweeps: the ExecStopPost drop-in's (dropins.py; only root may be
# recorded as it, service.py) and the watcher's. One stop's automatic sweeps share one sweep.
HOOK_PREFIX = "hook:"
WATCH_PREFIX = "watch:"
# requested_by of a Slurm epilog's sweep asked for by root (service.requested_by).
SLURM_PREFIX = "slurm:"
# requested_by of a unit sweep the daemon ran at its start for a unit that stopped while no
# daemon ran (daemon/units.py).
RECOVERED_PREFIX = "recovered:"
_LEGACY_KINDS = ((HOOK_PREFIX, RequesterKind.HOOK), (WATCH_PREFIX, RequesterKind.WATCH),
                 (SLURM_PREFIX, RequesterKind.SLURM), (RECOVERED_PREFIX, RequesterKind.RECOVERED))


def legacy_requester_kind(requested_by: str) -> RequesterKind:
    """The kind of a request an older daemon's in-flight record (daemon/inflight.py) left
    without one, from the requested_by that daemon wrote. Only the daemon's own forms are bare
    ("hook:<unit>" and "slurm:<job>" for root, "watch:<unit>", "recovered:<unit>"); every other
    caller is named with its uid ("uid 1000 (alice) :1.4", "hook:x via uid 65534 ..."): a space."""
    if " " in requested_by:
        return RequesterKind.HOOK_NONROOT if requested_by.startswith(HOOK_PREFIX) \
            else RequesterKind.MANUAL
    for prefix, kind in _LEGACY_KINDS:
        if requested_by.startswith(prefix) and len(requested_by) > len(prefix):
            return kind
    return RequesterKind.MANUAL


# systemd's object path of a unit: this prefix, then the name with every byte outside
# [A-Za-z0-9] written as _xx (sd_bus_path_encode).
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
    """systemd's unit object path back to the unit name ("sglang_2ddemo_2eservice")."""
    if not path.startswith(UNIT_PATH_PREFIX):
        return ""
    label = path[len(UNIT_PATH_PREFIX):]
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), label)


def matches(unit: str, patterns: Iterable[str]) -> bool:
    """fnmatch over unit names; a pattern without a suffix means a .service ("sglang-*")."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(unit, pattern):
            return True
        if "." not in pattern.rsplit("*", 1)[-1] and unit.endswith(".service") \
                and fnmatch.fnmatchcase(unit, pattern + ".service"):
            return True
    return False


def became_active(previous: str, state: UnitState) -> bool:
    """The unit has just started (for its CUDA_VISIBLE_DEVICES hint and first holdings)."""
    return state.active_state == "active" and previous != "active"


def is_stop_to_sweep(previous: str, state: UnitState, job_done: bool) -> bool:
    """A stop of a unit seen by the watcher: it is stopped (or unloaded), and either a job on
    it finished or it was seen running before. A daemon-reload re-announcing an inactive unit
    is neither, and must not sweep every watched unit."""
    if not state.stopped:
        return False
    return job_done or not (previous in STOPPED_STATES or previous == "")

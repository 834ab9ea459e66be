"""Sweeps in flight, on disk: what a gpuguardd that dies mid-sweep was doing, for the next one.

A crash, an OOM kill or a SIGKILL gives the daemon no chance to finish or record a sweep, and
the caller (the ExecStopPost hook) is left with a bus error while the unit's leftovers keep
their GPU memory. So before a real sweep signals anything, its request is written here, one
file per sweep (`<RuntimeDirectory>/sweeps/<report id>.json`, replaced atomically), and the
file is removed once the sweep's report is in the history. Each process the sweep ends is
added to it as it goes, so the record of a sweep cut short lists what it had done. What the
next daemon finds here was cut short; daemon/resume.py finishes it.

No fsync: a crash of the daemon keeps what it wrote (the kernel has it); only a power loss
would not, and after the reboot that follows there is nothing left to finish.

The runtime directory is the right home: it outlives the daemon's restarts (the unit keeps
it with RuntimeDirectoryPreserve=yes) but not a reboot, after which there is nothing left
to finish. Dry runs are not written: there is nothing to finish.

The files are the daemon's own, in a root-owned directory, but are still read strictly: a
file that is not exactly what this module writes is reported and removed, never acted on.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Terminated
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.rules import legacy_requester_kind

log = logging.getLogger("gpuguard.inflight")

DIRECTORY = "sweeps"
FORMAT = 1
MAX_FILE = 256 * 1024
_ID = re.compile(r"[0-9a-f]{32}")
# Sweeps finished, remembered so that a late update cannot bring their record back.
_REMEMBER = 1024
_U32 = 2**32 - 1


@dataclass
class InFlightSweep:
    request: SweepRequest
    started_usec: int
    terminated: list[Terminated] = field(default_factory=list)

    @property
    def report_id(self) -> str:
        return self.request.report_id


def _encode(sweep: InFlightSweep) -> bytes:
    r = sweep.request
    data = {"format": FORMAT, "started_usec": sweep.started_usec, "report_id": r.report_id,
            "resumes": r.resumes, "gpus": list(r.gpus), "unit": r.unit, "container": r.container,
            "grace_ms": r.grace_ms, "dry_run": r.dry_run,
            "include_management": r.include_management, "reason": r.reason,
            "requested_by": r.requested_by, "requester_kind": r.requester_kind.value,
            "adopted": [list(p) for p in r.adopted],
            "slurm_job": r.slurm_job, "slurm_uid": r.slurm_uid, "audited": r.audited,
            "terminated": [t.to_dict() for t in sweep.terminated]}
    return json.dumps(data, ensure_ascii=True, sort_keys=True).encode("ascii")


def _field(data: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    # bool is an int in Python: a count or a PID must not be true or false.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key}: {value!r} is not a {kind.__name__}")
    return value


def _uint(data: dict[str, Any], key: str, top: int, optional: bool = False) -> int | None:
    value = _field(data, key, int, optional)
    if value is not None and not 0 <= value <= top:
        raise ValueError(f"{key}: {value} is out of range")
    return value  # type: ignore[no-any-return]


def _decode(text: bytes, name: str) -> InFlightSweep:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not an in-flight record of this version")
    report_id = _field(data, "report_id", str)
    if not _ID.fullmatch(report_id) or name != f"{report_id}.json":
        raise ValueError(f"report_id {report_id!r} does not name this file")
    resumes = _field(data, "resumes", str)
    if resumes and not _ID.fullmatch(resumes):
        raise ValueError(f"resumes: {resumes!r} is not a report id")
    gpus = _field(data, "gpus", list)
    adopted = _field(data, "adopted", list)
    if not all(isinstance(g, str) for g in gpus):
        raise ValueError("gpus: not a list of strings")
    pairs: list[tuple[int, int]] = []
    for pair in adopted:
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)):
            raise ValueError(f"adopted: {pair!r} is not a (pid, start time) pair")
        pairs.append((pair[0], pair[1]))
    slurm_uid = _field(data, "slurm_uid", int)
    if not -1 <= slurm_uid <= _U32:
        raise ValueError(f"slurm_uid: {slurm_uid} is out of range")
    requested_by = _field(data, "requested_by", str)
    kind = _field(data, "requester_kind", str, optional=True)
    try:
        # A record written before the codes (a daemon upgraded mid-sweep) has none: the words
        # that daemon wrote say it, by the rule it kept them by (rules.legacy_requester_kind).
        requester_kind = legacy_requester_kind(requested_by) if kind is None else RequesterKind(kind)
    except ValueError:
        raise ValueError(f"requester_kind: {kind!r} is not a requester kind") from None
    request = SweepRequest(
        gpus=gpus, unit=_field(data, "unit", str), container=_field(data, "container", str),
        grace_ms=_uint(data, "grace_ms", _U32, optional=True),
        dry_run=_field(data, "dry_run", bool, optional=True),
        include_management=_field(data, "include_management", bool),
        reason=_field(data, "reason", str), requested_by=requested_by, requester_kind=requester_kind,
        adopted=pairs, slurm_job=_field(data, "slurm_job", str), slurm_uid=slurm_uid,
        audited=_field(data, "audited", bool), report_id=report_id, resumes=resumes)
    started = _uint(data, "started_usec", 2**63 - 1)
    assert started is not None
    ended = [Terminated.from_dict(t) for t in _field(data, "terminated", list, optional=True) or []]
    if any(t.unread for t in ended):
        raise ValueError("terminated: an entry of another shape")
    return InFlightSweep(request, started, ended)


class InFlightSweeps:
    """The directory of in-flight records. Called from the daemon's I/O executor."""

    def __init__(self, runtime_directory: str) -> None:
        self.directory = os.path.join(runtime_directory, DIRECTORY)
        # Writes come from several I/O threads: the lock keeps a stale update from replacing
        # a newer one, or from bringing back the record of a sweep that is over.
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._over: collections.OrderedDict[str, None] = collections.OrderedDict()

    def _path(self, report_id: str) -> str:
        if not _ID.fullmatch(report_id):
            raise ValueError(f"not a report id: {report_id!r}")
        return os.path.join(self.directory, f"{report_id}.json")

    def add(self, sweep: InFlightSweep) -> bool:
        """Write the record before the sweep signals anything. False (logged) when it cannot
        be written, a full or read-only disk: the sweep still runs, it just could not be
        finished by a successor."""
        with self._lock:
            if sweep.report_id in self._over \
                    or self._written.get(sweep.report_id, -1) > len(sweep.terminated):
                return True
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                write_atomic(self._path(sweep.report_id), [_encode(sweep)], prefix=".sweep.",
                             mode=0o600, fsync=False)
                self._written[sweep.report_id] = len(sweep.terminated)
                return True
            except OSError as exc:
                error = exc
        if error is not None:
            log.error("sweep %s: cannot keep its in-flight record in %s (%s): if gpuguardd "
                      "dies during it, its successor cannot finish it", sweep.report_id[:8],
                      self.directory, error.strerror or error)
        return False

    def remove(self, report_id: str) -> None:
        with self._lock:
            self._written.pop(report_id, None)
            self._over[report_id] = None
            while len(self._over) > _REMEMBER:
                self._over.popitem(last=False)
            try:
                os.unlink(self._path(report_id))
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                error = exc
        if error is not None:
            log.error("sweep %s: cannot remove its in-flight record (%s): the next gpuguardd "
                      "will sweep its scope again", report_id[:8], error.strerror or error)

    def load(self) -> list[InFlightSweep]:
        """Every readable record, oldest first; unreadable ones are logged and removed."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.error("cannot read the in-flight sweeps in %s: %s", self.directory, exc)
            return []
        found: list[InFlightSweep] = []
        for name in names:
            if name.startswith("."):  # a temporary that a crash left behind
                self._discard(name, "an unfinished write")
                continue
            try:
                fd = open_nofollow(os.path.join(self.directory, name), os.O_RDONLY)
                try:
                    text = os.read(fd, MAX_FILE + 1)
                finally:
                    os.close(fd)
                if len(text) > MAX_FILE:
                    raise ValueError("too large")
                found.append(_decode(text, name))
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                self._discard(name, str(exc))
        found.sort(key=lambda sweep: sweep.started_usec)
        return found

    def _discard(self, name: str, why: str) -> None:
        log.warning("in-flight record %s/%s not used: %s", self.directory, name, why)
        try:
            os.unlink(os.path.join(self.directory, name))
        except OSError:
            pass

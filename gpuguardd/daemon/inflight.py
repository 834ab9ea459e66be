"""Sweeps in flight, on disk: what a gpuguardd that dies mid-sweep was doing, for the next one.

Before a real sweep signals anything its request is written to
`<RuntimeDirectory>/sweeps/<report id>.json` (replaced atomically), each process ended added as
it goes, and removed once the report is in the history; daemon/units.py finishes what the next
daemon finds. No fsync: the runtime directory outlives a crash (the kernel keeps the writes)
but not a reboot, after which nothing is left to finish. Files are read strictly: one that is
not exactly what this module writes is reported and removed, never acted on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from gpuguardd.numbers import is_digits
from gpuguardd.records.enums import Outcome
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.report import Report, ReportScope, Terminated
from gpuguardd.safefiles import open_nofollow, write_atomic
from gpuguardd.systemd.rules import legacy_requester_kind

log = logging.getLogger("gpuguard.inflight")

DIRECTORY = "sweeps"
FORMAT = 1
MAX_FILE = 256 * 1024
_ID = re.compile(r"[0-9a-f]{32}")
# Sweeps finished, remembered so that a late update cannot bring their record back.
_REMEMBER = 1024
_OVER = 2**63
_U32 = 2**32 - 1


@dataclass
class InFlightSweep:
    """A sweep in flight; `budget_sec` and `scope` are the running daemon's, not on disk."""

    request: SweepRequest
    started_usec: int = field(default_factory=lambda: time.time_ns() // 1000)
    terminated: list[Terminated] = field(default_factory=list)
    budget_sec: float = 0.0
    scope: ReportScope | None = None

    @property
    def report_id(self) -> str:
        return self.request.report_id

    def report(self, why: str, outcome: Outcome = Outcome.INTERRUPTED,
               scope: ReportScope | None = None, finished_by: str = "") -> Report:
        request = self.request
        if scope is None:
            scope = ReportScope(gpus=[int(g) for g in request.gpus if is_digits(g) and len(g) < 10],
                                unit=request.unit, container=request.container,
                                include_management=request.include_management,
                                adopted_pids=[pid for pid, _ in request.adopted],
                                slurm_job=request.slurm_job,
                                slurm_uid=request.slurm_uid if request.slurm_job else None,
                                grace_ms=request.grace_ms)
        return Report(id=self.report_id, started_usec=self.started_usec,
                      duration_ms=max(0, time.time_ns() // 1000 - self.started_usec) // 1000,
                      requested_by=request.requested_by, reason=request.reason, scope=scope,
                      requester_kind=request.requester_kind, dry_run=bool(request.dry_run),
                      outcome=outcome, finished_by=finished_by,
                      terminated=list(self.terminated), error=why)


def _encode(sweep: InFlightSweep) -> bytes:
    data = {"format": FORMAT, "started_usec": sweep.started_usec, **sweep.request.to_dict(),
            "terminated": [t.to_dict() for t in sweep.terminated]}
    return json.dumps(data, ensure_ascii=True, sort_keys=True).encode("ascii")


def _decode(text: bytes, name: str) -> InFlightSweep:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not an in-flight record of this version")
    request = SweepRequest.from_dict(data)
    # A record from before requester_kind (upgraded mid-sweep): its words say the kind.
    legacy = "requester_kind" not in data
    unread = request.unread - ({"requester_kind"} if legacy else set())
    if unread:
        raise ValueError(f"{', '.join(sorted(unread))}: not of an in-flight record's types")
    if legacy:
        request.requester_kind = legacy_requester_kind(request.requested_by)
    if not _ID.fullmatch(request.report_id) or name != f"{request.report_id}.json":
        raise ValueError(f"report_id {request.report_id!r} does not name this file")
    if request.resumes and not _ID.fullmatch(request.resumes):
        raise ValueError(f"resumes: {request.resumes!r} is not a report id")
    if any(v < 0 for pair in request.adopted for v in pair):
        raise ValueError(f"adopted: {request.adopted!r} are not (pid, start time) pairs")
    started, ended = data.get("started_usec", -1), data.get("terminated") or []
    for key, value, low, top in (("slurm_uid", request.slurm_uid, -1, _U32),
                                 ("grace_ms", request.grace_ms or 0, 0, _U32),
                                 ("started_usec", started, 0, 2**63 - 1)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= top:
            raise ValueError(f"{key}: {value!r} is out of range")
    terminated = [Terminated.from_dict(t) for t in ended] if isinstance(ended, list) else None
    if terminated is None or any(t.unread for t in terminated):
        raise ValueError("terminated: an entry of another shape")
    return InFlightSweep(request, started, terminated)


class InFlightSweeps:
    """Called from the daemon's I/O executor."""

    def __init__(self, runtime_directory: str) -> None:
        self.directory = os.path.join(runtime_directory, DIRECTORY)
        # Writes come from several I/O threads: never a stale update over a newer one or an ended sweep.
        self._lock = threading.Lock()
        # Per sweep, the processes its record on disk lists; _OVER once the sweep is over.
        self._written: collections.OrderedDict[str, int] = collections.OrderedDict()

    def _path(self, report_id: str) -> str:
        if not _ID.fullmatch(report_id):
            raise ValueError(f"not a report id: {report_id!r}")
        return os.path.join(self.directory, f"{report_id}.json")

    def add(self, sweep: InFlightSweep) -> bool:
        """False (logged) when it cannot be written: the sweep still runs."""
        with self._lock:
            if self._written.get(sweep.report_id, -1) > len(sweep.terminated):
                return True
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                write_atomic(self._path(sweep.report_id), [_encode(sweep)], prefix=".sweep.", mode=0o600, fsync=False)
                self._written[sweep.report_id] = len(sweep.terminated)
                return True
            except OSError as exc:
                error = exc
        log.error("sweep %s: cannot keep its in-flight record in %s (%s): if gpuguardd "
                  "dies during it, its successor cannot finish it", sweep.report_id[:8],
                  self.directory, error.strerror or error)
        return False

    def remove(self, report_id: str) -> None:
        with self._lock:
            self._written[report_id] = _OVER
            self._written.move_to_end(report_id)
            while len(self._written) > _REMEMBER:
                self._written.popitem(last=False)
            try:
                os.unlink(self._path(report_id))
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                error = exc
        log.error("sweep %s: cannot remove its in-flight record (%s): the next gpuguardd "
                  "will sweep its scope again", report_id[:8], error.strerror or error)

    def load(self) -> list[InFlightSweep]:
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
                with os.fdopen(open_nofollow(os.path.join(self.directory, name), os.O_RDONLY), "rb") as handle:
                    text = handle.read(MAX_FILE + 1)
                if len(text) > MAX_FILE:
                    raise ValueError("too large")
                found.append(_decode(text, name))
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                self._discard(name, str(exc))
        found.sort(key=lambda sweep: sweep.started_usec)
        return found

    def _discard(self, name: str, why: str) -> None:
        log.warning("in-flight record %s/%s not used: %s", self.directory, name, why)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, name))

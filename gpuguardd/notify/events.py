"""Which of gpuguardd's signals become a notification, and their text, by the GNOME Shell
extension's rules (gnome-shell-extension/src/state.js): a leak, a sweep that left something
behind, a sweep that ended this user's processes. An ended process the report gives no uid for
is this user's if one of this uid had its pid and command when the sweep started. Texts from
the bus are anyone's: escaped (escaping.py), and as markup too where the server renders it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape as markup_escape

from gpuguardd.cli.output import human_bytes
from gpuguardd.escaping import escape_text
from gpuguardd.numbers import is_digits

# org.freedesktop.Notifications urgency hint values (the spec's "Urgency Levels").
NORMAL, CRITICAL = 1, 2
_SHOWN = 5  # processes named in one notification; the rest are counted


@dataclass(frozen=True)
class Notice:
    summary: str
    body: str
    urgency: int = NORMAL

    def for_server(self, markup: bool) -> tuple[str, str]:
        """The summary is plain text by the spec; the body is markup where the server says so."""
        return self.summary, markup_escape(self.body) if markup else self.body


def _names(entries: list[dict[str, Any]]) -> str:
    shown = [f"{escape_text(e.get('comm', ''))} ({int(e.get('pid', 0))})" for e in entries[:_SHOWN]]
    more = len(entries) - _SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def own_processes(uid: int, proc: str = "/proc") -> dict[int, str]:
    """{pid: comm} of the processes of `uid` now (those it may read)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return found
    for name in filter(is_digits, names):
        try:
            if os.stat(f"{proc}/{name}").st_uid != uid:
                continue
            with open(f"{proc}/{name}/comm", "rb") as handle:
                found[int(name)] = handle.read(64).decode("utf-8", "replace").rstrip("\n")
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


class Events:
    def __init__(self, uid: int, proc: str = "/proc") -> None:
        self.uid = uid
        self.proc = proc
        # sweep id -> this user's {pid: comm} when it started
        self._mine_at_start: dict[str, dict[int, str]] = {}
        # GPU index -> gpu_title, unescaped: main.py reads them from the daemon as it subscribes.
        self.titles: dict[int, str] = {}

    def signal(self, member: str, fields: dict[str, Any]) -> list[Notice]:
        if member == "SweepStarted":
            # Bounded: a sweep whose end we never hear of (gpuguardd died) is dropped later.
            if len(self._mine_at_start) >= 64:
                self._mine_at_start.pop(next(iter(self._mine_at_start)))
            self._mine_at_start[str(fields["id"])] = own_processes(self.uid, self.proc)
            return []
        if member == "LeakSuspected":
            title = self.titles.get(int(fields["gpu"]), "")
            which = f" ({escape_text(title)})" if title else ""
            return [Notice(f"GPU {int(fields['gpu'])}: memory leaked", f"{human_bytes(int(fields['bytes']))} in use "
                           f"with no process holding the GPU{which}.", CRITICAL)]
        if member == "SweepFinished":
            return self._finished(str(fields["id"]), fields["report"])
        return []

    def _finished(self, sweep_id: str, report: dict[str, Any]) -> list[Notice]:
        mine = self._mine_at_start.pop(sweep_id, {})
        if report.get("dry_run"):
            return []
        notices = []
        outcome = report.get("outcome", "")
        if outcome == "survivors":
            notices.append(Notice("A GPU sweep left something behind",
                                  f"Still running: {_names(report.get('survived', []))}", CRITICAL))
        elif outcome == "memory-not-released":
            notices.append(Notice("A GPU sweep left something behind",
                                  "The processes are gone, but the GPU memory was not released.", CRITICAL))
        ended = [t for t in report.get("terminated", [])
                 if (t["uid"] == self.uid if "uid" in t
                     else mine.get(int(t.get("pid", 0))) == t.get("comm"))]
        if ended:
            asker = escape_text(report.get("requested_by", "") or "unknown")
            notices.append(Notice("Your GPU processes were ended", f"{_names(ended)}, by a sweep asked by {asker}"))
        return notices

"""What one caller can make the daemon do, bounded: fresh holder scans and log lines.

Any local user may call gpuguardd. Unbounded, 2,000 ListHolders(fresh=true) calls by `nobody`
kept a core at 95 % (a full /proc walk each) and wrote 6,895 "denied" lines to the journal.
`RateLimit` lets a key (a uid, or a uid and what it was refused) through at most once per
interval and counts what it held back; it remembers a bounded number of keys, the least
recently seen going first, so no caller can grow the daemon's memory with it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# A caller's fresh=true ListHolders scans: at most one per this, per uid. A second one sooner
# is served from the last scan when that one is fresh by inventory.py's rule (or joins the next).
FRESH_SCAN_INTERVAL_SEC = 1.0
# A caller's refusals (the same uid, the same action): logged at most once per this, with the
# number held back since.
DENIAL_LOG_INTERVAL_SEC = 600.0
MAX_KEYS = 4096


@dataclass(frozen=True)
class Admission:
    """Whether a key was let through and, when it was, how many were held back before it."""

    allowed: bool
    held_back: int = 0


class RateLimit:
    def __init__(self, interval: float, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        # key -> (when it was last let through, how many times it was held back since)
        self._seen: collections.OrderedDict[Hashable, tuple[float, int]] = collections.OrderedDict()

    def admit(self, key: Hashable) -> Admission:
        """Held back when `key` was let through less than `interval` ago (this one is
        counted); else let through, with how many were held back since the last one."""
        now = self.clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.interval:
            self._seen[key] = (last[0], last[1] + 1)
            self._seen.move_to_end(key)
            return Admission(False)
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return Admission(True, last[1] if last is not None else 0)

    def __len__(self) -> int:
        return len(self._seen)


def held_back(count: int) -> str:
    """The suffix a rate-limited log line carries: how many like it were not written."""
    return f" (and {count} more time(s) since, not logged)" if count else ""

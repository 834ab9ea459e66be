"""What one caller can make the daemon do, bounded: fresh holder scans and log lines.

Any local user may call gpuguardd: unbounded, 2,000 ListHolders(fresh=true) calls by `nobody`
kept a core at 95 % and wrote 6,895 "denied" lines to the journal. RateLimit lets a key through
once per interval, counting what it held back, and forgets the least recently seen keys first.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
from typing import NamedTuple

# A uid's fresh=true ListHolders scans (sooner: served from the last scan, or joins the next).
FRESH_SCAN_INTERVAL_SEC = 1.0
# A uid's refusals of one action: logged at most once per this, with the number held back.
DENIAL_LOG_INTERVAL_SEC = 600.0
MAX_KEYS = 4096


class Admission(NamedTuple):
    allowed: bool
    held_back: int = 0


class RateLimit:
    def __init__(self, interval: float, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.clock = clock
        # key -> (when it was last let through, how many were held back since)
        self._seen: collections.OrderedDict[Hashable, tuple[float, int]] = collections.OrderedDict()

    def admit(self, key: Hashable) -> Admission:
        now = self.clock()
        last = self._seen.pop(key, None)  # put back below, as the most recently seen
        if last is not None and now - last[0] < self.interval:
            self._seen[key] = (last[0], last[1] + 1)
            return Admission(False)
        self._seen[key] = (now, 0)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return Admission(True, last[1] if last is not None else 0)


def held_back(count: int) -> str:
    """A rate-limited log line's suffix: how many like it were not written."""
    return f" (and {count} more time(s) since, not logged)" if count else ""

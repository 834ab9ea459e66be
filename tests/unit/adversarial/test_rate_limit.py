"""The rate limiter's bounds and counts (the daemon under a flood:
tests/bus/adversarial/test_rate_limit.py)."""

from __future__ import annotations

from gpuguardd.bus.auth import Admission, RateLimit, held_back


def test_rate_limit_bounds_and_counts() -> None:
    now = [100.0]
    limit = RateLimit(1.0, max_keys=3, clock=lambda: now[0])
    assert limit.admit("a") == Admission(True, 0)
    assert limit.admit("a") == Admission(False) and not limit.admit("a").allowed
    now[0] += 1.0
    assert limit.admit("a") == Admission(True, 2)  # let through again, with the two held back
    for key in range(10):
        limit.admit(key)
    assert len(limit._seen) == 3  # bounded: the least recently seen went
    assert held_back(0) == "" and "3 more" in held_back(3)

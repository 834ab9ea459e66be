"""The rate limiter's bounds and counts (the daemon under a flood:
tests/bus/adversarial/test_rate_limit.py)."""

from __future__ import annotations

from gpuguardd.bus.ratelimit import PerKey, held_back


def test_per_key_bounds_and_counts() -> None:
    now = [100.0]
    limit = PerKey(1.0, max_keys=3, clock=lambda: now[0])
    assert limit.admit("a") == 0
    assert limit.admit("a") is None and limit.admit("a") is None
    now[0] += 1.0
    assert limit.admit("a") == 2  # let through again, with the two held back
    for key in range(10):
        limit.admit(key)
    assert len(limit) == 3  # bounded: the least recently seen went
    assert held_back(0) == "" and "3 more" in held_back(3)

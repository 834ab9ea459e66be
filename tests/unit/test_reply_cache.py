"""Replies sent from bytes marshalled once (bus/replycache.py, compat.ReusedBody) are the bytes
dbus-fast would have marshalled, and only ever for the very same values."""

from __future__ import annotations

from typing import Any

from dbus_fast import Message, MessageType, Variant

from gpuguardd.bus import marshal
from gpuguardd.bus.compat import ReusedBody
from gpuguardd.bus.replycache import ReplyCache, Shared


def typed_report(n: int) -> dict[str, Variant]:
    target = {"pid": n, "comm": "café", "unit": "a.service", "kind": "compute", "gpus": [0],
              "gpu_memory": 1 << 30, "exe": "/usr/bin/python3"}
    return marshal.report({"id": f"{n:032x}", "targets": [target] * 5, "warnings": ["ü"]})


def reply(serial: int, body: list[Any], signature: str = "aa{sv}") -> Message:
    return Message(destination=":1.42", message_type=MessageType.METHOD_RETURN,
                   reply_serial=serial, signature=signature, body=[body], serial=1000 + serial)


def test_reused_bytes_are_what_dbus_fast_marshals() -> None:
    cache = ReplyCache()
    reports = [typed_report(n) for n in range(4)]
    sent = []
    for serial in range(1, 6):
        msg = cache.reply(reply(serial, Shared(reports)))
        sent.append(type(msg))
        assert msg._marshall(False) == reply(serial, list(reports))._marshall(False)
    # Not kept the first time, marshalled and kept the second, reused from then on.
    assert sent[0] is Message and all(kind is ReusedBody for kind in sent[1:])
    assert (cache.hits, cache.misses, len(cache)) == (3, 2, 1)


def test_other_values_are_never_served_from_a_kept_body() -> None:
    cache = ReplyCache()
    reports = [typed_report(n) for n in range(3)]
    for serial in range(1, 4):
        cache.reply(reply(serial, Shared(reports)))._marshall(False)
    # Equal values in new objects (a new scan, a new history entry): marshalled afresh.
    again = [typed_report(n) for n in range(3)]
    newer = [typed_report(9), *reports[:2]]
    for body in (again, newer, reports[:2], [*reports, reports[0]]):
        msg = cache.reply(reply(7, Shared(body)))
        assert getattr(msg, "body_bytes", None) is None
        assert msg._marshall(False) == reply(7, list(body))._marshall(False)


def test_only_shared_method_returns_are_touched() -> None:
    cache = ReplyCache()
    reports = [typed_report(1)]
    plain = reply(1, list(reports))
    for _ in range(3):
        assert cache.reply(plain) is plain  # an untagged body: the service made it fresh
    error = Message(destination=":1.42", message_type=MessageType.ERROR, reply_serial=1,
                    error_name="org.gpuguard.GpuGuard1.Error.Failed", signature="s", body=["x"])
    assert cache.reply(error) is error
    assert cache.hits == 0 and len(cache) == 0


def test_kept_bodies_are_bounded() -> None:
    cache = ReplyCache(keep=2)
    bodies = [[typed_report(n)] for n in range(4)]
    for body in bodies:
        for serial in range(1, 4):
            cache.reply(reply(serial, Shared(body)))._marshall(False)
    assert len(cache) == 2
    # The oldest went first; the newest two are still reused.
    assert getattr(cache.reply(reply(9, Shared(bodies[3]))), "body_bytes", None) is not None
    assert getattr(cache.reply(reply(9, Shared(bodies[0]))), "body_bytes", None) is None

"""Replies that many callers get alike are marshalled once (compat.ReusedBody sends the bytes).

A GetHistory(10) reply is thousands of typed values, identical for every caller until the
history changes; a ListHolders reply is identical for every caller served from one scan (with
the same filter and redaction). Marshalling one costs the daemon more than anything else the
call does, so under a dashboard's load the bytes of such bodies are kept and reused.

What makes two bodies "the same" is identity, not equality: a reply body tagged Shared is a
list of values (typed reports, typed holders) that are never changed once made and are shared
by the replies that send them (ManagerInterface._typed_reports, Service._typed_holders). Two
Shared bodies holding the same objects in the same order marshal to the same bytes. A kept
entry holds its objects, so their ids cannot be reused by others while it lives; a new
history entry or a new scan makes new objects, so a stale body is never sent. Nothing is
compared by value, and no time-based expiry is needed.

A body is kept only the second time its objects are sent (a per-caller redacted ListHolders
makes fresh objects every call and would only push useful entries out), and only KEEP of them,
least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from dbus_fast import Message, MessageType

from gpuguardd.bus.compat import ReusedBody

KEEP = 16  # bodies kept (a GetHistory(n) per n a dashboard asks, ListHolders per filter)
SEEN = 256  # keys remembered, without their objects, until their second sighting


class Shared(list):  # type: ignore[type-arg]
    """A reply body's items, never changed once made and shared between replies (see above)."""


Key = tuple[str, tuple[int, ...]]


class ReplyCache:
    def __init__(self, keep: int = KEEP, seen: int = SEEN) -> None:
        self._keep = keep
        self._seen_max = seen
        self._bodies: OrderedDict[Key, tuple[tuple[Any, ...], bytes]] = OrderedDict()
        self._seen: OrderedDict[Key, None] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._bodies)

    def reply(self, msg: Message) -> Message:
        """`msg`, or a message that sends the same bytes from the kept body when it has one."""
        if msg.message_type != MessageType.METHOD_RETURN or len(msg.body) != 1 \
                or type(msg.body[0]) is not Shared:
            return msg
        items = tuple(msg.body[0])
        key = (msg.signature, tuple(map(id, items)))
        kept = self._bodies.get(key)
        if kept is not None:
            self._bodies.move_to_end(key)
            self.hits += 1
            return ReusedBody.of(msg, kept[1])
        self.misses += 1
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > self._seen_max:
                self._seen.popitem(last=False)
            return msg

        def keep(body: bytes) -> None:
            self._bodies[key] = (items, body)  # the objects: their ids stay theirs
            if len(self._bodies) > self._keep:
                self._bodies.popitem(last=False)

        return ReusedBody.of(msg, None, keep)

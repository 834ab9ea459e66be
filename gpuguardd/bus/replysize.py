"""Every reply and signal stays far below the bus's message limit, whatever the host holds.

dbus-daemon disconnects the sender of a message over its max_message_size (32 MiB on the
system bus). Each field is bounded where it is read (safetext); here, how many go into one
message. A report past REPORT_BUDGET has its lists cut, with a warning saying so (the history
file keeps it whole); a reply past REPLY_BUDGET has its holders' texts cut to COMPACT_TEXT and
then leaves entries out, the last one sent carrying `omitted_after`: how many.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dbus_fast.signature import Variant

from gpuguardd import safetext
from gpuguardd.bus import marshal, names

log = logging.getLogger("gpuguard.replysize")

MiB = 1024 * 1024
# A quarter of dbus-daemon's default max_message_size: room for headers and a bus set lower.
REPLY_BUDGET = 8 * MiB
REPORT_BUDGET = 1 * MiB
COMPACT_TEXT = 256

# warning_codes is cut as warnings is, so the codes kept still match the warnings kept.
_REPORT_LISTS = ("targets", "terminated", "survived", "spared", "gpus", "leaks", "warnings", "warning_codes")

# Keys of report entries that docs/contract.md does not list, left out when empty ("" unit: none),
# which says no more than their absence: GetHistory(10) of 20-target reports, 58.6 -> 47.6 KiB.
OMITTED_WHEN_EMPTY: Mapping[str, tuple[str, ...]] = {
    "targets": ("unit", "container", "mig", "exe"), "survived": ("unit",), "spared": ("unit",),
    "gpus": ("mig_uuid",), "leaks": ("mig_uuid",)}


def wire_report(data: Mapping[str, Any]) -> dict[str, Any]:
    """The report as sent: entries without their empty optional keys (OMITTED_WHEN_EMPTY)."""
    out = dict(data)
    for key, optional in OMITTED_WHEN_EMPTY.items():
        entries = data.get(key)
        if isinstance(entries, list):
            out[key] = [{k: v for k, v in entry.items() if k not in optional or v not in ("", [])}
                        if isinstance(entry, Mapping) else entry for entry in entries]
    return out


def wire_size(value: Any) -> int:
    """An upper bound of `value`'s marshalled size (with the padding before it), not marshalling it."""
    if isinstance(value, Variant):
        return 8 + len(value.signature) + wire_size(value.value)
    if isinstance(value, str):
        return 9 + (len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass")))
    if isinstance(value, (bool, int, float)):
        return 16
    if isinstance(value, Mapping):
        return 8 + sum(8 + wire_size(k) + wire_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 8 + sum(wire_size(item) for item in value)
    return 8 + len(str(value))


def _compact(holder: dict[str, Variant]) -> dict[str, Variant]:
    return {key: Variant("s", safetext.cut(variant.value, COMPACT_TEXT))
            if variant.signature == "s" and len(variant.value) > COMPACT_TEXT // 4 else variant
            for key, variant in holder.items()}


def _fit(items: list[dict[str, Variant]], sizes: list[int], budget: int) -> list[dict[str, Variant]]:
    """The items that fit in `budget`, the last marked with how many were left out."""
    used = 8
    for count, size in enumerate(sizes):
        if used + size > budget:
            kept = items[:count]
            if kept:
                kept[-1] = {**kept[-1], names.OMITTED_KEY: Variant("u", len(items) - count)}
            return kept
        used += size
    return items


def bound_holders(holders: list[dict[str, Variant]], budget: int = REPLY_BUDGET,
                  sizes: list[int] | None = None) -> list[dict[str, Variant]]:
    sizes = [wire_size(h) for h in holders] if sizes is None else sizes
    if sum(sizes) + 8 <= budget:
        return holders
    compact = [_compact(h) for h in holders]
    kept = _fit(compact, [wire_size(h) for h in compact], budget)
    log.warning("ListHolders: %d holders make %d bytes; sent %d of them with their text cut to %d bytes "
                "(reply limit %d bytes)", len(holders), sum(sizes), len(kept), COMPACT_TEXT, budget)
    return kept


def bound_reports(sized: list[tuple[dict[str, Variant], int]]) -> list[dict[str, Variant]]:
    """Typed reports with their sizes, newest first: as many as fit, the last saying how many were left out."""
    kept = _fit([report for report, _ in sized], [size for _, size in sized], REPLY_BUDGET)
    if len(kept) < len(sized):
        log.info("GetHistory: sent %d of %d reports (reply limit %d bytes)", len(kept), len(sized), REPLY_BUDGET)
    return kept


def bound_report(data: Mapping[str, Any]) -> tuple[dict[str, Variant], int]:
    """The typed report as sent (wire_report), its lists cut to fit REPORT_BUDGET, and its size."""
    data = wire_report(data)
    first = marshal.report(data)
    size = wire_size(first)
    if size <= REPORT_BUDGET:
        return first, size
    lists = {k: v for k, v in data.items() if k in _REPORT_LISTS and isinstance(v, list)}
    keep = max((len(v) for v in lists.values()), default=0)
    while True:
        keep //= 2
        left = sum(max(0, len(v) - keep) for v in lists.values())
        note = (f"{left} entries of this report's lists ({', '.join(sorted(lists))}) were left out of this copy to "
                "keep it under the bus's message size; gpuguardd's history file keeps the whole report")
        trimmed = {**data, **{k: v[:keep] for k, v in lists.items()}}
        trimmed["warnings"] = [*trimmed.get("warnings", [])[:keep], note]
        result = marshal.report(trimmed)
        size = wire_size(result)
        if size <= REPORT_BUDGET or keep == 0:
            log.warning("report %s: %s", str(data.get("id", ""))[:8], note)
            return result, size

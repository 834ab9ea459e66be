"""A dry run must never stand for the stop hook's sweep: the unit sweep's
rules, with a stand-in engine and systemd (the daemon on the bus:
tests/bus/adversarial/test_hook_reuse.py)."""

from __future__ import annotations

import asyncio

import pytest

from gpuguardd.records.enums import RequesterKind
from gpuguardd.records.models import SweepRequest
from gpuguardd.systemd.rules import UnitState
from tests.unit.daemon.test_units import Harness

UNIT = "gg-hook.service"


def request(requested_by: str, dry_run: bool | None) -> SweepRequest:
    # The kind as the service decides it (service.requester): root's hook, or nobody's.
    kind = RequesterKind.HOOK if requested_by == f"hook:{UNIT}" else RequesterKind.HOOK_NONROOT
    return SweepRequest(unit=UNIT, requested_by=requested_by, reason=f"hook:{UNIT} result=x",
                        dry_run=dry_run, requester_kind=kind)


NOBODY_HOOK = f"hook:{UNIT} via uid 65534 (nobody) :1.9"


@pytest.mark.parametrize("default_dry_run", [False, True])
def test_a_dry_run_is_never_the_stops_sweep(default_dry_run: bool) -> None:
    h = Harness([], {UNIT: UnitState(UNIT, "deactivating", invocation_id="i1")})
    h.engine.config.dry_run = default_dry_run
    h.release.set()

    async def scenario() -> list[str]:
        ids = []
        # nobody's dry run, named like the hook: its own sweep, remembered for nobody.
        first = await h.watch.sweep_unit(request(NOBODY_HOOK, True))
        # Leaving dry_run open means [Sweep] DryRun: with DryRun=yes a dry run too.
        second = await h.watch.sweep_unit(request(NOBODY_HOOK, None))
        # The real hook: a sweep of its own, not the dry run's report.
        real = await h.watch.sweep_unit(request(f"hook:{UNIT}", False))
        # A later dry run does not get the real report either; the watcher's real one does.
        later = await h.watch.sweep_unit(request(NOBODY_HOOK, True))
        h.watch.systemd.states[UNIT] = UnitState(UNIT, "inactive", invocation_id="i1")  # type: ignore[attr-defined]
        watch = await h.watch.sweep_unit(SweepRequest(unit=UNIT, requested_by=f"watch:{UNIT}",
                                                      requester_kind=RequesterKind.WATCH,
                                                      dry_run=False))
        for report in (first, second, real, later, watch):
            assert report is not None
            ids.append(report.id)
        return ids

    ids = asyncio.run(scenario())
    if default_dry_run:
        assert ids == ["r1", "r2", "r3", "r4", "r3"], ids
        assert [r.dry_run for r in h.requests] == [True, None, False, True]
    else:
        # dry_run left open under DryRun=no is a real sweep (the service required polkit's
        # sweep authorisation for it): that one does stand for the stop.
        assert ids == ["r1", "r2", "r2", "r3", "r2"], ids
        assert [r.dry_run for r in h.requests] == [True, None, True]


def test_a_dry_run_does_not_join_the_running_real_sweep() -> None:
    h = Harness([], {UNIT: UnitState(UNIT, "deactivating", invocation_id="i1")})

    async def scenario() -> int:
        real = asyncio.ensure_future(h.watch.sweep_unit(request(f"hook:{UNIT}", False)))
        await asyncio.sleep(0.01)
        dry = asyncio.ensure_future(h.watch.sweep_unit(request(NOBODY_HOOK, True)))
        await asyncio.sleep(0.01)
        h.release.set()
        reports = await asyncio.gather(real, dry)
        return len({id(r) for r in reports})

    assert asyncio.run(scenario()) == 2  # two sweeps, two reports
    assert [r.dry_run for r in h.requests] == [False, True]

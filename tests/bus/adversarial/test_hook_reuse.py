"""A dry run must never stand for the stop hook's sweep.

Anyone may ask for a dry run, with any reason. `nobody` called SweepUnit(dry_run, reason
"hook:<unit> ...") while the unit stopped; when the real hook (root) came, the daemon said
"this stop was already swept" and handed it the dry-run report: exit 0, holder alive. Only a
real sweep (root's, or a polkit-authorised caller's) may be the stop's sweep or be shared.
"""

from __future__ import annotations

import json

from tests.bus.adversarial.fake_systemd import FakeSystemd
from tests.dbus_harness import GuardDaemon, wait_until
from tests.unit.adversarial.test_hook_reuse import UNIT

pytest_plugins = ["tests.dbus_harness"]


# -- on the bus, as the issue saw it ----------------------------------------------------------


def test_nobodys_dry_run_is_not_handed_to_the_hook(guard: GuardDaemon,
                                                   systemd: FakeSystemd) -> None:
    wait_until(lambda: "watching systemd units" in guard.stderr(), 15, "the unit watch on")
    reason = f"hook:{UNIT} result=exit-code"
    dry = guard.manager("SweepUnit", "sa{sv}", UNIT, "2", "reason", "s", reason,
                        "dry_run", "b", "true", as_nobody=True)[0]
    assert dry["dry_run"] is True and dry["requested_by"].startswith(f"hook:{UNIT} via uid 65534")
    # The hook, as the drop-in runs it (root, same stop: same InvocationID from systemd).
    hook = guard.ctl("sweep", "--unit", UNIT, "--reason", reason, "--json")
    assert hook.returncode == 0, hook.stderr
    report = json.loads(hook.stdout)
    assert report["id"] != dry["id"] and report["dry_run"] is False, report
    assert report["requested_by"] == f"hook:{UNIT}"
    assert "already swept" not in guard.stderr()

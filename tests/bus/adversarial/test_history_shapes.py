"""history.jsonl is untrusted input to every reader: records an older version wrote, or that
someone edited by hand, may lack keys or hold odd types. GetHistory still answers, and
`gpuguardctl history` prints every record ("?" for what it cannot read) for root and nobody.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuguardd.daemon.history import FILE_NAME
from tests.dbus_harness import GuardDaemon
from tests.unit.adversarial.test_history_shapes import ODD_RECORDS

pytest_plugins = ["tests.dbus_harness"]


def test_history_with_partial_records_is_served_and_printed(daemon: GuardDaemon) -> None:
    state = Path(str(daemon.host.root)) / "state"
    state.mkdir(exist_ok=True)
    (state / FILE_NAME).write_text("".join(json.dumps(r) + "\n" for r in ODD_RECORDS))
    daemon.host.write_config()
    daemon.start()
    served = daemon.manager("GetHistory", "u", "0")[0]
    assert sorted(r["id"] for r in served) == sorted(r["id"] for r in ODD_RECORDS)
    for as_nobody in (False, True):
        shown = daemon.ctl("history", "-n", "10", as_nobody=as_nobody)
        assert shown.returncode == 0, shown.stderr
        for record in ODD_RECORDS:
            assert f"Sweep {record['id'][:8]} " in shown.stdout, shown.stdout
        assert "\x1b" not in shown.stdout
    assert daemon.alive()

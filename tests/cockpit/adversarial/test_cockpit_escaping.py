"""The page showed a forged name. A holder whose argument holds U+202E
(right-to-left override) was displayed reversed ("...\\u202egnp.exe" read "exe.png"), and ESC
and BEL were drawn as boxes. The page now shows what the CLI prints: cockpit/src/escape.js
implements gpuguardd/escaping.py's rule, both held to tests/escaping_vectors.json."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from gpuguardd.escaping import escape_text
from tests.bus.adversarial.hostile_holder import spawn
from tests.cockpit_harness import CockpitWs
from tests.dbus_harness import FAST_POLL, GuardDaemon
from tests.unit.adversarial.test_escaping_vectors import VECTORS_FILE

pytest_plugins = ["tests.dbus_harness", "tests.cockpit_harness"]

ESCAPE_JS = VECTORS_FILE.parent.parent / "cockpit" / "src" / "escape.js"
# The module's source and a check after it, as one ES module on node's stdin (no file written).
CHECK = """
import { readFileSync } from "node:fs";
const doc = JSON.parse(readFileSync(process.argv.at(-1), "utf8"));
const wrong = doc.vectors.filter(v => escapeText(v.input) !== v.expected)
                         .map(v => ({ name: v.name, got: escapeText(v.input), expected: v.expected }));
const again = doc.vectors.filter(v => escapeText(v.expected) !== v.expected).map(v => v.name);
console.log(JSON.stringify({ count: doc.vectors.length, wrong, again }));
"""


def test_the_page_rule_meets_every_vector() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is required (make deps installs nodejs)")
    source = ESCAPE_JS.read_text(encoding="utf-8") + CHECK
    done = subprocess.run([node, "--input-type=module", "-", "--", str(VECTORS_FILE)], input=source,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["count"] >= 19 and result["wrong"] == [] and result["again"] == [], result


FORGED = [b"invoice\xe2\x80\xaegnp.exe", b"\x1b[2J\x1b]0;owned\x07", b"bell\x07end", b"\xe2\x81\xa6iso"]


def test_a_forged_name_shows_escaped_as_the_cli_prints_it(daemon: GuardDaemon,
                                                          cockpit_ws: Callable[..., CockpitWs],
                                                          browser_page: Callable[..., Any]) -> None:
    daemon.host.write_config(FAST_POLL)
    daemon.start()
    proc = spawn(daemon.host, FORGED)
    page = browser_page(cockpit_ws().url)
    row = page.locator(f"table.gg-holders tr[data-pid='{proc.pid}']")
    expect(row).to_be_visible(timeout=15_000)
    listed = next(h for h in daemon.manager("ListHolders", "a{sv}", "0")[0] if h["pid"] == proc.pid)
    assert "\u202e" in listed["cmdline"]  # the bus carries the name as it is (--json too)
    command = row.locator("td").nth(8)
    expect(command).to_contain_text("invoice\\u202egnp.exe")
    shown = command.inner_text()
    assert shown.strip() == escape_text(listed["cmdline"]), shown
    for raw in ("\u202e", "\u2066", "\x1b", "\x07"):
        assert raw not in shown, (raw, shown)
    for text in ("\\x1b[2J\\x1b]0;owned\\x07", "bell\\x07end", "\\u2066iso"):
        assert text in shown, shown

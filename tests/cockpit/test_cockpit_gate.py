"""The start gate on the Cockpit page: each GPU card says what the GPU waits on
before the next job can start, or how long it has been free, as gpuguardd's FreeSinceUsec
and WaitingOn say (the rule `gpuguardctl wait` passes on)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from playwright.sync_api import expect

from tests.cockpit.test_cockpit import end, holder, open_gpuguard
from tests.cockpit_harness import CockpitWs
from tests.dbus_harness import FAST_POLL, GuardDaemon

pytest_plugins = ["tests.dbus_harness", "tests.cockpit_harness"]


def test_cards_say_what_each_gpu_waits_on_then_how_long_it_is_free(
        daemon: GuardDaemon, cockpit_ws: Callable[..., CockpitWs],
        browser_page: Callable[..., Any]) -> None:
    daemon.host.write_config(FAST_POLL + "[Gate]\nStableSec=1s\n")
    daemon.start()
    pid = holder(daemon.host, 0)
    page = open_gpuguard(cockpit_ws(), browser_page)
    held = page.locator("section.gg-gpu[data-index='0'] .gg-readiness")
    free = page.locator("section.gg-gpu[data-index='1'] .gg-readiness")
    expect(held).to_have_attribute("data-free", "false")
    expect(held).to_contain_text(f"waiting on: compute holder pid {pid}")
    expect(free).to_have_attribute("data-free", "true")
    expect(free).to_have_text(re.compile(r"^free for \d+ s$"))
    # The count goes up by itself: no property changes while a GPU stays free.
    first = int(free.inner_text().split()[2])
    expect(free).not_to_have_text(f"free for {first} s", timeout=4000)
    # The holder ends: GPU 0 becomes free, live.
    end(daemon.host, pid)
    expect(held).to_have_attribute("data-free", "true", timeout=10000)
    expect(held).to_contain_text("free for")

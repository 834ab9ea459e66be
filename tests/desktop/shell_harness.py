"""The real GNOME Shell 43 (Debian 12), headless, as a non-root user, for the extension's tests.

Checked recipe (the notes on the e2e container, GNOME part): `gnome-shell --wayland --headless
--virtual-monitor 1280x800 --no-x11` as nobody (setpriv), with a HOME and XDG_RUNTIME_DIR
(0700) of its own, inside `dbus-run-session` on a session bus whose policy lets root's test
clients in; DBUS_SYSTEM_BUS_ADDRESS points the shell's Gio.DBus.system at the tests' private
system bus, where gpuguardd runs over the fake NVML. The settings are written before it
starts (extensions enabled, the welcome dialog and the lock warning marked seen). It is
stopped with SIGKILL to its whole process group: on SIGTERM mutter 43 segfaults in
meta_context_destroy.

The test helper extension (tests/desktop/helper) answers what the indicator shows (its icon,
opacity, menu lines, the shell's notifications) and opens its menu over the session bus.
Screenshots go through org.gnome.Shell.Screenshot, which the shell allows to the owner of
org.gnome.Screenshot: the test client takes that name first.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.dbus_harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
UUID = "gpuguard@gpuguard.org"
HELPER_UUID = "helper@gpuguard.test"
HELPER = Path(__file__).resolve().parent / "helper"
NOBODY = 65534
SESSION_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <standard_session_servicedirs/>
  <policy context="default">
    <allow user="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""
# Before the shell starts: as the notes say, or a banner that never expires comes first.
START = """set -e
echo "$DBUS_SESSION_BUS_ADDRESS" > {workdir}/session-address
gsettings set org.gnome.shell enabled-extensions "['{uuid}', '{helper}']"
gsettings set org.gnome.shell welcome-dialog-last-shown-version '999'
gsettings set org.gnome.desktop.interface enable-animations false
touch "$XDG_DATA_HOME/gnome-shell/lock-warning-shown"
exec gnome-shell --wayland --headless --virtual-monitor 1280x800 --no-x11
"""


def _own(path: Path) -> None:
    for top, dirs, files in os.walk(path):
        os.chown(top, NOBODY, NOBODY)
        for name in dirs + files:
            os.chown(os.path.join(top, name), NOBODY, NOBODY)


class GnomeShell:
    def __init__(self, system_bus_address: str, extension_dir: Path) -> None:
        # Not pytest's tmp_path: nobody must reach it, and that is 0700 root.
        self.workdir = Path(tempfile.mkdtemp(prefix="gg-desktop-"))
        os.chmod(self.workdir, 0o755)
        self.home = self.workdir / "home"
        self.runtime = self.workdir / "runtime"
        self.data = self.home / ".local/share"
        extensions = self.data / "gnome-shell/extensions"
        extensions.mkdir(parents=True)
        shutil.copytree(extension_dir, extensions / UUID)
        shutil.copytree(HELPER, extensions / HELPER_UUID)
        self.runtime.mkdir(mode=0o700)
        (self.workdir / "bus").mkdir()
        (self.workdir / "shots").mkdir()
        config = self.workdir / "session.conf"
        config.write_text(SESSION_CONFIG.format(socket=self.workdir / "bus" / "session"))
        script = self.workdir / "start.sh"
        script.write_text(START.format(workdir=self.workdir, uuid=UUID, helper=HELPER_UUID))
        _own(self.workdir)
        self.log_path = self.workdir / "gnome-shell.log"
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.home),
            "XDG_RUNTIME_DIR": str(self.runtime), "XDG_DATA_HOME": str(self.data),
            "XDG_CONFIG_HOME": str(self.home / ".config"), "LANG": "C.UTF-8",
            "DBUS_SYSTEM_BUS_ADDRESS": system_bus_address,
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "dbus-run-session", f"--config-file={config}", "--", "sh", str(script)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.workdir),
                start_new_session=True)
        address_file = self.workdir / "session-address"
        wait_until(lambda: self._alive() and address_file.exists(), 30, "the session bus")
        self.address = address_file.read_text().strip()
        wait_until(lambda: self._alive() and self.helper_ready(), 60, "the shell and its extensions")

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"gnome-shell exited with {self.proc.returncode}:\n{self.log()}")
        return True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # dconf-service and kin share the group; none outlive the kill.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- the session bus -------------------------------------------------------------------

    def gdbus(self, dest: str, path: str, method: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["gdbus", "call", "--address", self.address, "--dest", dest,
                               "--object-path", path, "--method", method, *args],
                              capture_output=True, text=True, timeout=30, check=False)

    def helper_ready(self) -> bool:
        return self.gdbus("org.gpuguard.TestHelper", "/org/gpuguard/TestHelper",
                          "org.gpuguard.TestHelper.Describe").returncode == 0

    def helper(self, method: str, *args: str) -> Any:
        """Call the test helper; its string reply (ASCII JSON) decoded."""
        result = self.gdbus("org.gpuguard.TestHelper", "/org/gpuguard/TestHelper",
                            f"org.gpuguard.TestHelper.{method}", *args)
        assert result.returncode == 0, result.stderr
        text = result.stdout.strip()
        if text == "()":
            return None
        # gdbus prints ('<json>',) with the JSON as a GVariant string literal.
        assert text.startswith("('") and text.endswith("',)"), text
        return json.loads(text[2:-3].encode().decode("unicode_escape"))

    def describe(self) -> dict[str, Any]:
        data: dict[str, Any] = self.helper("Describe")
        return data

    def menu(self, open_it: bool) -> None:
        self.helper("OpenMenu" if open_it else "CloseMenu")

    def dialog(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.helper("DescribeDialog")
        return found

    def extension_state(self, uuid: str = UUID) -> float:
        result = self.gdbus("org.gnome.Shell", "/org/gnome/Shell",
                            "org.gnome.Shell.Extensions.GetExtensionInfo", uuid)
        assert result.returncode == 0, result.stderr
        marker = "'state': <"
        start = result.stdout.index(marker) + len(marker)
        return float(result.stdout[start:result.stdout.index(">", start)])

    def screenshot(self, target: Path, crop: str = "") -> None:
        """The whole screen (or `crop`, ImageMagick's WxH+X+Y) into `target`."""
        shot = self.workdir / "shots" / "shot.png"
        asyncio.run(_screenshot(self.address, str(shot)))
        wait_until(shot.exists, 10, "the screenshot file")
        target.parent.mkdir(parents=True, exist_ok=True)
        if crop:
            subprocess.run(["convert", str(shot), "-crop", crop, "+repage", str(target)], check=True)
        else:
            shutil.copyfile(shot, target)
        shot.unlink()


async def _screenshot(address: str, path: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    try:
        await bus.request_name("org.gnome.Screenshot")
        deadline = time.monotonic() + 10
        while True:
            reply = await bus.call(Message(
                destination="org.gnome.Shell.Screenshot", path="/org/gnome/Shell/Screenshot",
                interface="org.gnome.Shell.Screenshot", member="Screenshot", signature="bbs",
                body=[False, False, path]))
            assert reply is not None
            if reply.message_type != MessageType.ERROR:
                assert reply.body[0], f"the shell could not take the screenshot: {reply.body}"
                return
            # AccessDenied for a moment, while the shell learns the name's new owner.
            if time.monotonic() > deadline:
                raise AssertionError(f"Screenshot refused: {reply.error_name} {reply.body}")
            await asyncio.sleep(0.2)
    finally:
        bus.disconnect()

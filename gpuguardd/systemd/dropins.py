"""The drop-ins `gpuguardctl hook` writes: `<name>.service.d/gpuguard.conf` runs `gpuguardctl
sweep --unit %n` after every stop of the unit; `gpuguard-start.conf` (--start), installed and
removed on its own, runs `gpuguardctl wait` before every start. systemd (239+) also applies
`foo-.service.d/` to every unit whose name starts with `foo-`, so one drop-in covers a family.
Ours start with HEADER: `list` tells ours from an admin's by it; `install` overwrites no other.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field

from gpuguardd.engine.attribution import UNIT_NAME_CHARS
from gpuguardd.safefiles import write_atomic
from gpuguardd.systemd.rules import HOOK_PREFIX

DROPIN_FILE = "gpuguard.conf"
START_DROPIN_FILE = "gpuguard-start.conf"
# The start gate's own deadline (a unit changes it in GPUGUARD_WAIT_OPTIONS): a model server's
# unit sets TimeoutStartSec= to minutes for loading; systemd's 90 s default cuts a longer gate short.
GATE_TIMEOUT = "60s"
HEADER = "# Managed by gpuguard (gpuguardctl hook). Local edits are lost on reinstall."
ETC_UNIT_DIR = "/etc/systemd/system"
# Where systemd looks for units and drop-ins, most to least important (systemd.unit(5)).
UNIT_SEARCH_PATH = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
                    "/usr/lib/systemd/system", "/lib/systemd/system")
GPUGUARDCTL = "/usr/bin/gpuguardctl"
# The sweep may take GraceSec (10 s) + KillTimeoutSec (5 s) + VerifyTimeoutSec (45 s) plus the
# scans: 80 s fits under the default TimeoutStopSec=90s, which also bounds ExecStopPost (see
# docs/real-hosts.md). A shorter TimeoutStopSec cuts the hook short; the daemon finishes the sweep.
HOOK_TIMEOUT = "80s"
HOOK_KILL_AFTER = "5s"

# A template's prefix and instance, each in systemd's unit name alphabet; '@' between them.
_NAME_CHARS = re.compile(rf"[{UNIT_NAME_CHARS}]+")  # fullmatch: "$" would let a final "\n" in
_INSTANCE_CHARS = re.compile(rf"[{UNIT_NAME_CHARS}]*")
_MAX_NAME = 255


class HookError(ValueError):
    """A pattern that cannot name a service (usage), or a file that is not ours to change."""

    def __init__(self, message: str, usage: bool = True) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class HookTarget:
    name: str  # e.g. "sglang-.service", "vllm-qwen.service", "foo@.service"
    kind: str  # "prefix", "unit", "template"

    def dropin_path(self, root: str = "/", start: bool = False) -> str:
        return os.path.join(root, ETC_UNIT_DIR.lstrip("/"), f"{self.name}.d",
                            START_DROPIN_FILE if start else DROPIN_FILE)

    def applies_to(self, unit: str) -> bool:
        stem = self.name.removesuffix(".service")
        if self.kind == "prefix":
            # systemd tries every dash-truncation of the unit name: "a-b-c.service" gets
            # "a-b-.service.d" and "a-.service.d"; "a-.service" itself gets neither.
            unit_stem = unit.removesuffix(".service")
            return unit.endswith(".service") and unit_stem.startswith(stem) and len(unit_stem) > len(stem)
        if self.kind == "template":
            return unit.endswith(".service") and unit.startswith(stem) and unit != self.name
        return unit == self.name


def parse_pattern(pattern: str) -> HookTarget:
    """Accepted: `sglang-` or `sglang-.service` (prefix), `vllm-qwen` or `vllm-qwen.service`,
    `foo@.service` (every instance of a template), `foo@bar.service` (one instance)."""
    text = pattern.strip()
    if not text:
        raise HookError("empty pattern: give a unit name or a prefix ending in '-'")
    if text != pattern or any(c.isspace() for c in text):
        raise HookError(f"invalid pattern {pattern!r}: unit names contain no whitespace")
    if "/" in text or text in (".", "..") or text.startswith("."):
        raise HookError(f"invalid pattern {pattern!r}: a unit name, not a path")
    if glob_chars(text):
        raise HookError(f"invalid pattern {pattern!r}: globs are not unit names; "
                        "use a prefix ending in '-' (e.g. sglang-) to cover a family of units")
    if "." in text and not text.endswith(".service"):
        raise HookError(f"invalid pattern {pattern!r}: ExecStopPost= hooks only apply to .service units")
    name = text if text.endswith(".service") else text + ".service"
    stem = name.removesuffix(".service")
    if len(name) > _MAX_NAME:
        raise HookError(f"invalid pattern: unit names are at most {_MAX_NAME} characters")
    if not stem.strip("-"):
        raise HookError(f"invalid pattern {pattern!r}: a prefix must name a family, e.g. sglang-")
    if "@" in stem:
        prefix, _, instance = stem.partition("@")
        if not prefix or "@" in instance or not _NAME_CHARS.fullmatch(prefix) \
                or not _INSTANCE_CHARS.fullmatch(instance):
            raise HookError(f"invalid pattern {pattern!r}: not a valid template or instance name")
        return HookTarget(name, "unit" if instance else "template")
    if not _NAME_CHARS.fullmatch(stem):
        raise HookError(f"invalid pattern {pattern!r}: unit names use only letters, digits and :_.\\-")
    return HookTarget(name, "prefix" if stem.endswith("-") else "unit")


def glob_chars(text: str) -> bool:
    return any(c in text for c in "*?[]")


def render_dropin(target: HookTarget, ctl: str = GPUGUARDCTL) -> str:
    """The drop-in text; the packaged examples (systemd/dropins/*/gpuguard.conf.in, filled in
    with the default paths by packaging/units.py) are this, byte for byte."""
    remove = target.name.removesuffix(".service") if target.kind == "prefix" else target.name
    return "\n".join((
        HEADER,
        f"# Remove with: gpuguardctl hook remove {remove}",
        "#",
        "# After every stop of the unit (clean, failed, or before an automatic restart), end the",
        "# processes it left holding NVIDIA GPUs and verify through NVML that the memory came",
        "# back. '+' runs the hook with full privileges whatever User= and sandboxing the unit",
        "# has; '-' means a sweep that finds survivors never marks the unit failed. timeout(1)",
        "# bounds the hook below the default TimeoutStopSec=90s, which also covers ExecStopPost=,",
        "# so it can never hang a stop; the daemon finishes and records a sweep cut short.",
        "# ${SERVICE_RESULT}, ${EXIT_CODE} and ${EXIT_STATUS} end up in the report's reason.",
        "[Service]",
        f"ExecStopPost=+-/usr/bin/timeout --kill-after={HOOK_KILL_AFTER} {HOOK_TIMEOUT} {ctl} "
        f"sweep --unit %n --reason \"{HOOK_PREFIX}%n result=${{SERVICE_RESULT}} code=${{EXIT_CODE}} "
        "status=${EXIT_STATUS}\"",
        "",
    ))


def render_start_dropin(target: HookTarget, ctl: str = GPUGUARDCTL) -> str:
    stop_hook = render_dropin(target, ctl).split("\n")
    return "\n".join((
        stop_hook[0],
        stop_hook[1].replace("hook remove ", "hook remove --start "),
        "#",
        "# Before every start of the unit, wait until the GPUs it will use are free for it: no",
        "# compute process left on them, memory below [Gate] FreeBelowMiB and steady for [Gate]",
        "# StableSec, and no sweep of them running (the stop drop-in's, or a watched unit's).",
        "# Its GPUs are its CUDA_VISIBLE_DEVICES (or NVIDIA_VISIBLE_DEVICES): ExecStartPre= runs",
        "# with the unit's Environment= and EnvironmentFile=; without either, every GPU. '+' runs",
        "# the gate outside the unit's sandbox and User=, where the system bus is reachable.",
        f"# After {GATE_TIMEOUT} it gives up: the start fails, with what still holds each GPU in the",
        "# unit's journal. TimeoutStartSec= covers the gate and the model's loading together:",
        "# keep it above both. Change the gate's options in the unit, e.g.",
        "#   Environment=\"GPUGUARD_WAIT_OPTIONS=--timeout 5min --stable 10s\"",
        "[Service]",
        f"ExecStartPre=+{ctl} wait --timeout {GATE_TIMEOUT} $GPUGUARD_WAIT_OPTIONS",
        "",
    ))


def requested_by_for_reason(reason: str) -> str:
    """`hook:<unit>` for a reason the drop-in wrote ("hook:x.service result=..."), else ""."""
    if not reason.startswith(HOOK_PREFIX):
        return ""
    unit = (reason[len(HOOK_PREFIX):].split(None, 1) or [""])[0]
    try:
        parse_pattern(unit)
    except HookError:
        return ""
    return f"{HOOK_PREFIX}{unit}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


@dataclass
class Result:
    action: str  # installed, updated, unchanged, removed, absent
    target: str
    path: str
    daemon_reload: str = ""  # what happened about daemon-reload
    messages: list[str] = field(default_factory=list)


def systemd_running(root: str = "/") -> bool:
    """sd_booted(): systemd is PID 1 when /run/systemd/system exists (root "/" only)."""
    return root in ("/", "") and os.path.isdir("/run/systemd/system")


def daemon_reload(root: str) -> str:
    if root not in ("/", ""):
        return "skipped (--root given: the running systemd does not read that tree)"
    if not systemd_running(root):
        return "skipped (systemd is not PID 1 here)"
    import subprocess  # only where systemctl runs (start-up of every gpuguardctl verb)

    done = subprocess.run(["systemctl", "daemon-reload"], check=False, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HookError(f"systemctl daemon-reload failed: {done.stderr.strip() or done.returncode}", usage=False)
    return "done"


def install(pattern: str, root: str = "/", reload: bool = True, start: bool = False) -> Result:
    target = parse_pattern(pattern)
    path = target.dropin_path(root, start)
    # The hook runs this gpuguardctl if it was started as an installed program (make install
    # PREFIX=/usr/local puts it in /usr/local/bin), else the packaged one.
    program = sys.argv[0] if sys.argv else ""
    ctl = program if os.path.isabs(program) and os.path.basename(program) == "gpuguardctl" else GPUGUARDCTL
    wanted = (render_start_dropin if start else render_dropin)(target, ctl)
    current = _read(path)
    if current is not None and not current.startswith(HEADER):
        raise HookError(f"{path} exists and was not written by gpuguard; not overwriting it", usage=False)
    if current == wanted:
        return Result("unchanged", target.name, path, "not needed (nothing changed)")
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    # 0644 as systemd's own units: systemd reads them as root anyway, but `systemctl cat` as a
    # user and packaging tools expect it. Not synced: systemd re-reads on daemon-reload.
    write_atomic(path, [wanted.encode("utf-8")], prefix=f".{DROPIN_FILE}.", fsync=False)
    return _changed("installed" if current is None else "updated", target, path, root, reload)


def remove(pattern: str, root: str = "/", reload: bool = True, start: bool = False) -> Result:
    target = parse_pattern(pattern)
    path = target.dropin_path(root, start)
    current = _read(path)
    if current is None:
        return Result("absent", target.name, path, "not needed (nothing changed)",
                      [f"no gpuguard hook for {target.name} (nothing at {path})"])
    if not current.startswith(HEADER):
        raise HookError(f"{path} was not written by gpuguard; not removing it", usage=False)
    os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))  # only if we left it empty; an admin's files stay
    return _changed("removed", target, path, root, reload)


def _changed(action: str, target: HookTarget, path: str, root: str, reload: bool) -> Result:
    return Result(action, target.name, path, daemon_reload(root) if reload else "skipped (--no-reload)")


@dataclass
class InstalledHook:
    path: str
    target: HookTarget
    ours: bool
    applies_to: list[str]

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "target": self.target.name, "kind": self.target.kind,
                "ours": self.ours, "units": list(self.applies_to)}


def list_hooks(pattern: str = "", root: str = "/") -> list[InstalledHook]:
    """Installed drop-ins that call gpuguardctl, optionally only those matching `pattern` (anything
    `parse_pattern` takes, or a glob over drop-in names), with the services each applies to: unit
    files under `root`, plus the loaded ones when systemd runs."""
    wanted = parse_pattern(pattern) if pattern and not glob_chars(pattern) else None
    units: set[str] = set()
    found: list[tuple[str, str, str]] = []  # (unit name of the .d directory, file path, text)
    for base in UNIT_SEARCH_PATH:
        directory = os.path.join(root, base.lstrip("/"))
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        units.update(name for name in names if name.endswith(".service"))
        for name in [n for n in names if n.endswith(".service.d")]:
            try:
                files = sorted(f for f in os.listdir(os.path.join(directory, name)) if f.endswith(".conf"))
            except OSError:
                continue
            for file in files:
                path = os.path.join(directory, name, file)
                text = _read(path) or ""
                if file == DROPIN_FILE or "gpuguardctl" in text:
                    found.append((name.removesuffix(".d"), path, text))
    if systemd_running(root):
        import subprocess  # only where systemctl runs (start-up of every gpuguardctl verb)

        done = subprocess.run(["systemctl", "list-units", "--all", "--type=service", "--plain", "--no-legend",
                               "--no-pager"], check=False, capture_output=True, text=True, timeout=60)
        units.update(fields[0] for fields in map(str.split, done.stdout.splitlines())
                     if fields and fields[0].endswith(".service"))
    services = sorted(units)
    hooks: list[InstalledHook] = []
    for name, path, text in found:
        try:
            target = parse_pattern(name)
        except HookError:
            continue
        if pattern and not (target.name == wanted.name if wanted else fnmatch.fnmatchcase(name, pattern)):
            continue
        hooks.append(InstalledHook(path, target, text.startswith(HEADER),
                                   [u for u in services if target.applies_to(u)]))
    return hooks

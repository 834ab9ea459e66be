"""Configuration: built-in defaults, then the main file and its drop-ins in name order (systemd's way).

Lists append to the default (an empty assignment resets). Unknown keys are errors: a typo in
ProtectedExecutables= must not leave nvidia-persistenced unprotected. Every number has an upper bound.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpuguardd.errors import ConfigError
from gpuguardd.numbers import parse_uint, shown

DEFAULT_CONFIG_FILE = "/etc/gpuguard/gpuguard.conf"
DEFAULT_DROPIN_DIR = "/etc/gpuguard/gpuguard.conf.d"

# Real paths as shipped by NVIDIA's and the distributions' packages. Matching is on the resolved
# /proc/<pid>/exe, so the paths here are resolved again at load time (merged /usr, symlinks).
DEFAULT_PROTECTED_EXECUTABLES = (
    "/usr/bin/nvidia-persistenced", "/usr/bin/nv-fabricmanager", "/usr/bin/nvidia-fabricmanager",
    "/usr/bin/nv-hostengine", "/usr/lib/xorg/Xorg", "/usr/libexec/Xorg", "/usr/bin/Xorg", "/usr/bin/Xwayland",
    "/usr/sbin/gdm3", "/usr/sbin/gdm", "/usr/bin/sddm", "/usr/sbin/lightdm",
    "/usr/bin/gnome-shell", "/usr/bin/kwin_wayland",
)

DEFAULT_PROTECTED_UNITS = (
    "nvidia-persistenced.service", "nvidia-fabricmanager.service", "nvidia-dcgm.service", "dcgm.service",
    "display-manager.service", "gdm.service", "gdm3.service", "sddm.service", "lightdm.service",
)

# NVIDIA's nodes, then AMD's: KFD (every ROCm process opens it) and the DRM nodes of amdgpu.
# Which of them count (the "kfd" and "drm" majors of /proc/devices) is engine/devices.py's.
DEFAULT_DEVICE_PATHS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/kfd", "/dev/dri/renderD*", "/dev/dri/card*")
# amd-smi's per-GPU reset, the GPU's PCI address appended (`-g` takes an index, a BDF or a UUID):
# the amdgpu driver's own recovery (debugfs amdgpu_gpu_recover), as rocm-smi --gpureset does.
DEFAULT_AMD_RESET_COMMAND = "amd-smi reset --gpureset --gpu"


@dataclass(frozen=True)
class Config:
    grace_sec: float = 10.0
    kill_timeout_sec: float = 5.0
    # Covers SGLang's 16-26 s in D state after SIGKILL and the release after it (docs/real-hosts.md);
    # GraceSec + KillTimeoutSec + this stays under the drop-ins' 80 s bound.
    verify_timeout_sec: float = 45.0
    released_below_mib: int = 256
    # An idle AMD GPU's driver keeps VRAM of its own (an idle MI300X reads 284 MiB used).
    amd_released_below_mib: int = 1024
    protected_executables: tuple[str, ...] = DEFAULT_PROTECTED_EXECUTABLES
    protected_units: tuple[str, ...] = DEFAULT_PROTECTED_UNITS
    dry_run: bool = False
    # [Recovery] (docs/recovery.md): the reset commands (the GPU's PCI bus id appended), their bound, AutoReset.
    reset_command: str = "nvidia-smi -r -i"  # command_argv() splits it
    amd_reset_command: str = DEFAULT_AMD_RESET_COMMAND  # the same, for an AMD GPU
    reset_timeout_sec: float = 120.0
    auto_reset: bool = False
    leak_grace_sec: float = 300.0
    reset_interval_sec: float = 3600.0
    watch_units: tuple[str, ...] = ()
    device_paths: tuple[str, ...] = DEFAULT_DEVICE_PATHS
    allow_majors: tuple[int, ...] = ()
    mig_minors_path: str = "/proc/driver/nvidia-caps/mig-minors"  # engine/devices.py
    sysfs_path: str = "/sys"
    poll_interval_sec: float = 2.0
    nvml_timeout_sec: float = 5.0  # one NVML snapshot's bound: past it the driver counts as hung
    state_directory: str = "/var/lib/gpuguard"
    runtime_directory: str = "/run/gpuguard"
    history_max: int = 1000
    textfile_directory: str = ""  # node_exporter's textfile collector directory ("": none)
    # The start gate (`gpuguardctl wait`): free below this, steady this long within this tolerance.
    gate_free_below_mib: int = 256
    gate_stable_sec: float = 3.0
    gate_tolerance_mib: int = 16
    sources: tuple[str, ...] = field(default=(), compare=False)  # the files read, in order
    # (list item, "file:line") for items a file added: where a refused entry was written.
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def origin(self, item: str) -> str:
        return next((where for value, where in self.origins if value == item), "built-in default")

    def is_protected_unit(self, unit: str) -> str | None:
        return next((p for p in self.protected_units if unit and fnmatch.fnmatchcase(unit, p)), None)


_TIME_UNITS = {
    "us": 1e-6, "usec": 1e-6,
    "ms": 1e-3, "msec": 1e-3,
    "": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0,
}
MAX_TIMESPAN_SEC = 24 * 3600.0  # for any time span; each key has its own, lower bound
MAX_GRACE_SEC = 3600.0
MAX_RELEASED_BELOW_MIB = 1 << 24  # 16 TiB: more than any GPU has
MAX_GATE_STABLE_SEC = 3600.0
# ASCII digits only: \d and float() also take other scripts' digits (numbers.py).
_TIME_PART = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")


def parse_timespan(text: str, maximum: float = MAX_TIMESPAN_SEC) -> float:
    """Seconds from a systemd time span ("10", "1.5s", "500ms", "1min 30s"), at most `maximum`."""
    text = text.strip().lower()
    if not text:
        raise ValueError("empty time span")
    total = 0.0
    pos = 0
    while pos < len(text):
        match = _TIME_PART.match(text, pos)
        if not match or match.group(2) not in _TIME_UNITS:
            raise ValueError(f"invalid time span {text!r}")
        total += float(match.group(1)) * _TIME_UNITS[match.group(2)]
        pos = match.end()
    # 400 digits parse as float('inf'): nothing downstream (sleep, int(ms)) survives that.
    if not math.isfinite(total) or total > maximum:
        raise ValueError(f"time span {shown(text)} is too long (at most {_span_text(maximum)})")
    return total


def _span_text(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "yes", "y", "true", "t", "on"):
        return True
    if value in ("0", "no", "n", "false", "f", "off"):
        return False
    raise ValueError(f"invalid boolean {text!r} (use yes or no)")


def _bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    return lambda text: parse_uint(text.strip(), "number", maximum, minimum)


def _parse_absolute_path(text: str) -> str:
    value = text.strip()
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    return value


def _timespan_field(maximum: float, minimum: float = 0.0) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = parse_timespan(text, maximum)
        if value < minimum:
            raise ValueError(f"{text!r} is below the minimum of {minimum}s")
        return value
    return parse


def command_argv(text: str) -> tuple[str, ...]:
    """Shell-style quoting, run with no shell: a name found on PATH or an absolute path, then arguments."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:
        raise ValueError(f"invalid command {text!r}: {exc}") from None
    if not words:
        raise ValueError("empty command")
    if "/" in words[0] and not words[0].startswith("/"):
        raise ValueError(f"{words[0]!r} is neither a name found on PATH nor an absolute path")
    return words


def _command(text: str) -> str:
    command_argv(text)
    return text.strip()


def _absolute_list(text: str) -> list[str]:
    return [_parse_absolute_path(item) for item in text.split()]


def _major_list(text: str) -> list[int]:
    return [parse_uint(item, "device major number", 4095) for item in text.split()]  # majors are 12 bits


# (section, key) -> (Config field, parser); a tuple default makes a list. Bounds: gpuguard.conf(5).
_KEYS: dict[tuple[str, str], tuple[str, Callable[[str], Any]]] = {
    ("Sweep", "GraceSec"): ("grace_sec", _timespan_field(MAX_GRACE_SEC)),
    ("Sweep", "KillTimeoutSec"): ("kill_timeout_sec", _timespan_field(600.0)),
    ("Sweep", "VerifyTimeoutSec"): ("verify_timeout_sec", _timespan_field(3600.0)),
    ("Sweep", "ReleasedBelowMiB"): ("released_below_mib", _bounded_int(0, MAX_RELEASED_BELOW_MIB)),
    ("Sweep", "AmdReleasedBelowMiB"): ("amd_released_below_mib", _bounded_int(0, MAX_RELEASED_BELOW_MIB)),
    ("Sweep", "ProtectedExecutables"): ("protected_executables", _absolute_list),
    ("Sweep", "ProtectedUnits"): ("protected_units", str.split),
    ("Sweep", "DryRun"): ("dry_run", parse_bool),
    ("Recovery", "ResetCommand"): ("reset_command", _command),
    ("Recovery", "AmdResetCommand"): ("amd_reset_command", _command),
    ("Recovery", "ResetTimeoutSec"): ("reset_timeout_sec", _timespan_field(600.0, 1.0)),
    ("Recovery", "AutoReset"): ("auto_reset", parse_bool),
    ("Recovery", "LeakGraceSec"): ("leak_grace_sec", _timespan_field(MAX_TIMESPAN_SEC)),
    ("Recovery", "ResetIntervalSec"): ("reset_interval_sec", _timespan_field(MAX_TIMESPAN_SEC)),
    ("Watch", "Units"): ("watch_units", str.split),
    ("Devices", "Paths"): ("device_paths", _absolute_list),
    ("Devices", "AllowMajors"): ("allow_majors", _major_list),
    ("Devices", "MigMinorsPath"): ("mig_minors_path", _parse_absolute_path),
    ("Devices", "SysfsPath"): ("sysfs_path", _parse_absolute_path),
    ("Daemon", "PollIntervalSec"): ("poll_interval_sec", _timespan_field(3600.0, 0.1)),
    ("Daemon", "NvmlTimeoutSec"): ("nvml_timeout_sec", _timespan_field(600.0, 0.1)),
    ("Daemon", "StateDirectory"): ("state_directory", _parse_absolute_path),
    ("Daemon", "RuntimeDirectory"): ("runtime_directory", _parse_absolute_path),
    ("Daemon", "HistoryMax"): ("history_max", _bounded_int(1, 1_000_000)),
    ("Metrics", "TextfileDirectory"): ("textfile_directory",
                                       lambda text: _parse_absolute_path(text) if text.strip() else ""),
    ("Gate", "FreeBelowMiB"): ("gate_free_below_mib", _bounded_int(1, MAX_RELEASED_BELOW_MIB)),
    ("Gate", "StableSec"): ("gate_stable_sec", _timespan_field(MAX_GATE_STABLE_SEC)),
    ("Gate", "ToleranceMiB"): ("gate_tolerance_mib", _bounded_int(0, MAX_RELEASED_BELOW_MIB)),
}


def _apply_file(path: str, values: dict[str, Any], origins: list[tuple[str, str]]) -> None:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(path, 0, "", f"not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(path, 0, "", exc.strerror or str(exc)) from None
    section = ""
    defaults = Config()
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ConfigError(path, number, "", f"malformed section header {line!r}")
            section = line[1:-1].strip()
            if section not in {s for s, _ in _KEYS}:
                raise ConfigError(path, number, "", f"unknown section [{section}]")
            continue
        if "=" not in line:
            raise ConfigError(path, number, "", f"expected Key=value, got {line!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if not section:
            raise ConfigError(path, number, key, "assignment outside of a [Section]")
        spec = _KEYS.get((section, key))
        if spec is None:
            raise ConfigError(path, number, f"[{section}] {key}", "unknown key")
        name, parser = spec
        try:
            parsed = parser(value)
        except ValueError as exc:
            raise ConfigError(path, number, f"[{section}] {key}", str(exc)) from None
        if not isinstance(getattr(defaults, name), tuple):
            values[name] = parsed
        else:
            # Appends (replacing would drop nvidia-persistenced's protection for one added path);
            # a value given twice means it once, so uncommenting the shipped defaults changes nothing.
            kept = values.get(name, getattr(defaults, name)) if value else []
            values[name] = list(dict.fromkeys([*kept, *parsed]))
            origins.extend((str(item), f"{path}:{number}") for item in parsed)


def config_files() -> list[str]:
    files = [DEFAULT_CONFIG_FILE] if os.path.exists(DEFAULT_CONFIG_FILE) else []
    try:
        names = sorted(n for n in os.listdir(DEFAULT_DROPIN_DIR) if n.endswith(".conf"))
    except OSError:
        names = []
    return files + [os.path.join(DEFAULT_DROPIN_DIR, n) for n in names]


def load_config(paths: Sequence[str] | None = None) -> Config:
    """Defaults overridden by `paths`, which must exist (default: the system files, if any)."""
    files = list(paths) if paths is not None else config_files()
    values: dict[str, Any] = {}
    origins: list[tuple[str, str]] = []
    for path in files:
        _apply_file(path, values, origins)
    final = {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}
    for name in ("state_directory", "runtime_directory"):
        # systemd's StateDirectory= and RuntimeDirectory= may list several; the first is ours.
        given = os.environ.get(name.upper())
        if given and name not in final:
            final[name] = given.split(":")[0]
    return replace(Config(), sources=tuple(files), origins=tuple(origins), **final)  # type: ignore[arg-type]

"""Every time span has an upper bound. `GraceSec=` with 400 digits crashed
every sweep with OverflowError; `GraceSec=100000000` sent SIGTERM, overflowed and never sent
SIGKILL nor wrote a report. Now both are configuration errors naming file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd import config as config_module
from gpuguardd.config import load_config
from gpuguardd.errors import ConfigError

# key -> (section, a value just inside its bound, one just past it)
SPANS = {
    "GraceSec": ("Sweep", "1h", "3601s"),
    "KillTimeoutSec": ("Sweep", "10min", "601s"),
    "VerifyTimeoutSec": ("Sweep", "1h", "61min"),
    "PollIntervalSec": ("Daemon", "1h", "3601"),
    "NvmlTimeoutSec": ("Daemon", "10min", "601"),
    "ResetTimeoutSec": ("Recovery", "10min", "601"),
    "LeakGraceSec": ("Recovery", "24h", "86401"),
    "ResetIntervalSec": ("Recovery", "24h", "86401"),
    "StableSec": ("Gate", "1h", "3601"),
}
NUMBERS = {
    "ReleasedBelowMiB": ("Sweep", "16777216", "16777217"),
    "AmdReleasedBelowMiB": ("Sweep", "16777216", "16777217"),
    "HistoryMax": ("Daemon", "1000000", "1000001"),
    "FreeBelowMiB": ("Gate", "16777216", "16777217"),
    "ToleranceMiB": ("Gate", "16777216", "16777217"),
}


def test_every_span_key_has_a_bound_here() -> None:
    spans = {key for (_, key), (_, parser) in config_module._KEYS.items()
             if getattr(parser, "__qualname__", "").startswith("_timespan_field")}
    assert spans == set(SPANS)


@pytest.mark.parametrize("value", ["9" * 400, "100000000", "1" * 400 + "h", "99999999999999999999 ms",
                                   "1e400", "inf", "nan"])
@pytest.mark.parametrize("key", sorted(SPANS))
def test_huge_spans_are_errors_naming_file_line_and_key(tmp_path: Path, key: str, value: str) -> None:
    section = SPANS[key][0]
    path = tmp_path / "bad.conf"
    path.write_text(f"# comment\n[{section}]\n{key}={value}\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(path)])
    text = str(info.value)
    assert text.startswith(f"{path}:3: [{section}] {key}: "), text
    assert len(text) < 300  # the 400 digits are not echoed whole


@pytest.mark.parametrize("key", sorted({**SPANS, **NUMBERS}))
def test_bounds_are_exact(tmp_path: Path, key: str) -> None:
    section, inside, outside = {**SPANS, **NUMBERS}[key]
    path = tmp_path / "c.conf"
    path.write_text(f"[{section}]\n{key}={inside}\n")
    load_config([str(path)])
    path.write_text(f"[{section}]\n{key}={outside}\n")
    with pytest.raises(ConfigError, match=rf"c\.conf:2: \[{section}\] {key}: .*at most"):
        load_config([str(path)])
    path.write_text(f"[{section}]\n{key}={'9' * 400}\n")
    with pytest.raises(ConfigError, match=rf"c\.conf:2: \[{section}\] {key}: "):
        load_config([str(path)])



"""Configuration parsing: defaults, systemd-style lists and time spans, precise errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd import config as config_module
from gpuguardd.config import Config, config_files, load_config, parse_bool, parse_timespan
from gpuguardd.errors import ConfigError


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_no_file_means_defaults() -> None:
    config = load_config([])
    assert config == Config()
    assert "/usr/bin/nvidia-persistenced" in config.protected_executables
    assert config.device_paths == ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/kfd",
                                   "/dev/dri/renderD*", "/dev/dri/card*")
    # An idle MI300X reads 284 MiB used (docs/real-hosts.md): never a leak by default.
    assert config.amd_released_below_mib == 1024
    assert config.amd_reset_command == "amd-smi reset --gpureset --gpu"


def test_amd_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "amd.conf", "[Sweep]\nAmdReleasedBelowMiB=2048\n"
                                        "[Recovery]\nAmdResetCommand=/usr/local/sbin/amd-reset --bdf\n")
    config = load_config([path])
    assert config.amd_released_below_mib == 2048
    assert config.amd_reset_command == "/usr/local/sbin/amd-reset --bdf"
    assert config.released_below_mib == 256 and config.reset_command == "nvidia-smi -r -i"


@pytest.mark.parametrize(("text", "seconds"), [
    ("10", 10.0), ("1.5s", 1.5), ("500ms", 0.5), ("1min 30s", 90.0), ("2h", 7200.0), ("250 ms", 0.25),
])
def test_timespans(text: str, seconds: float) -> None:
    assert parse_timespan(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10 parsecs", "-1", "1s x"])
def test_bad_timespans(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timespan(text)


def test_booleans() -> None:
    assert parse_bool("yes") and parse_bool("On") and parse_bool("1")
    assert not parse_bool("no") and not parse_bool("false")
    with pytest.raises(ValueError, match="maybe"):
        parse_bool("maybe")


def test_values_lists_and_dropin_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    main = write(tmp_path / "gpuguard.conf", """
# comment
[Sweep]
GraceSec=30s
ProtectedExecutables=/opt/a /opt/b
DryRun=yes
[Watch]
Units=sglang-*.service
""")
    dropins = tmp_path / "gpuguard.conf.d"
    dropins.mkdir()
    write(dropins / "20-late.conf", "[Sweep]\nGraceSec=5\n")
    write(dropins / "10-early.conf", "[Sweep]\nGraceSec=7\nProtectedExecutables=\nProtectedExecutables=/opt/c\n"
                                     "[Watch]\nUnits=vllm-*.service\n")
    write(dropins / "ignored.txt", "[Sweep]\nGraceSec=99\n")
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_FILE", main)
    monkeypatch.setattr(config_module, "DEFAULT_DROPIN_DIR", str(dropins))
    files = config_files()
    assert [Path(f).name for f in files] == ["gpuguard.conf", "10-early.conf", "20-late.conf"]
    config = load_config(files)
    assert config.grace_sec == 5.0  # the last drop-in wins
    assert config.protected_executables == ("/opt/c",)  # empty assignment reset the list
    assert config.watch_units == ("sglang-*.service", "vllm-*.service")  # lists accumulate
    assert config.dry_run is True
    assert config.sources == tuple(files)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("[Sweep]\nGraceSec=forever\n", 2, "[Sweep] GraceSec: invalid time span 'forever'"),
    ("[Sweep]\n\nGraceSecs=1\n", 3, "[Sweep] GraceSecs: unknown key"),
    ("[Sweeep]\n", 1, "unknown section [Sweeep]"),
    ("GraceSec=1\n", 1, "GraceSec: assignment outside of a [Section]"),
    ("[Sweep]\nDryRun=perhaps\n", 2, "[Sweep] DryRun: invalid boolean 'perhaps'"),
    ("[Sweep]\nProtectedExecutables=nvidia-persistenced\n", 2, "'nvidia-persistenced' is not an absolute path"),
    ("[Sweep]\nReleasedBelowMiB=lots\n", 2, "[Sweep] ReleasedBelowMiB: number 'lots' is not a number"),
    ("[Sweep]\nAmdReleasedBelowMiB=-1\n", 2, "[Sweep] AmdReleasedBelowMiB: "),
    ("[Recovery]\nAmdResetCommand=bin/amd-smi\n", 2, "neither a name found on PATH nor an absolute path"),
    ("[Sweep]\njust words\n", 2, "expected Key=value, got 'just words'"),
    ("[Daemon]\nPollIntervalSec=1ms\n", 2, "below the minimum"),
])
def test_errors_name_file_line_and_key(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = write(tmp_path / "bad.conf", text)
    with pytest.raises(ConfigError) as info:
        load_config([path])
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert message in str(info.value)


def test_unreadable_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config([str(tmp_path / "missing.conf")])
    binary = tmp_path / "binary.conf"
    binary.write_bytes(b"\xff\xfe[Sweep]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config([str(binary)])


def test_state_directory_from_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/gpuguard:/var/lib/other")
    assert load_config([]).state_directory == "/var/lib/gpuguard"
    path = write(tmp_path / "c.conf", "[Daemon]\nStateDirectory=/srv/gg\n")
    assert load_config([path]).state_directory == "/srv/gg"  # the file is explicit, it wins


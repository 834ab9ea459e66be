"""[Devices] AllowMajors= values that are not device majors are errors naming file, line and
key (the refused nodes themselves: tests/bus/adversarial/test_device_paths.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd.config import load_config
from gpuguardd.errors import ConfigError


@pytest.mark.parametrize(("value", "why"), [("abc", "device major number 'abc' is not a number"),
                                            ("4096", "too large"), ("-1", "'-1' is not a number"),
                                            ("9" * 400, "too large"),
                                            ("\u0661\u0669\u0665", "'\u0661\u0669\u0665' is not a number")])
def test_bad_allow_majors_name_file_line_and_key(tmp_path: Path, value: str, why: str) -> None:
    path = tmp_path / "d.conf"
    path.write_text(f"[Devices]\nAllowMajors=120 {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(path)])
    assert str(info.value).startswith(f"{path}:2: [Devices] AllowMajors: ")
    assert why in str(info.value)

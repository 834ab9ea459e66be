"""runtimepm: the runtime PM status read from a sysfs tree, as untrusted text."""

from __future__ import annotations

from pathlib import Path

from gpuguardd.engine import runtimepm


def _status(root: Path, bdf: str, raw: bytes) -> None:
    power = root / "bus/pci/devices" / bdf / "power"
    power.mkdir(parents=True)
    (power / "runtime_status").write_bytes(raw)


def test_status_by_either_spelling_of_the_bus_id(tmp_path: Path) -> None:
    _status(tmp_path, "0000:01:00.0", b"suspended\n")
    _status(tmp_path, "0000:02:00.0", b"active\n")
    _status(tmp_path, "0000:06:00.0", b"suspending\n")
    assert runtimepm.asleep(str(tmp_path), "00000000:01:00.0")
    assert runtimepm.asleep(str(tmp_path), "0000:06:00.0")
    assert not runtimepm.asleep(str(tmp_path), "0000:02:00.0")
    assert not runtimepm.asleep(str(tmp_path), "0000:03:00.0")  # no such device


def test_odd_text_and_paths_are_no_status(tmp_path: Path) -> None:
    _status(tmp_path, "0000:04:00.0", "suspended\u0660".encode())
    _status(tmp_path, "0000:05:00.0", b"x" * 500)
    assert not runtimepm.asleep(str(tmp_path), "0000:04:00.0")
    assert not runtimepm.asleep(str(tmp_path), "0000:05:00.0")
    # A bus id that is no PCI address never becomes a path.
    (tmp_path / "bus/pci/power").mkdir(parents=True)
    (tmp_path / "bus/pci/power/runtime_status").write_bytes(b"suspended\n")
    assert not runtimepm.asleep(str(tmp_path), "..")


def test_the_nvidia_drivers_devices_in_bus_order(tmp_path: Path) -> None:
    bound = tmp_path / "bus/pci/drivers/nvidia"
    for name in ("0000:41:00.0", "0000:01:00.0", "bind", "new_id", "module"):
        (bound / name).mkdir(parents=True)
    assert runtimepm.nvidia_bus_ids(str(tmp_path)) == ["0000:01:00.0", "0000:41:00.0"]
    assert runtimepm.nvidia_bus_ids(str(tmp_path / "none")) == []


def test_the_driver_version_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "module/nvidia").mkdir(parents=True)
    (tmp_path / "module/nvidia/version").write_text("550.54.15\n")
    assert runtimepm.driver_version(str(tmp_path)) == "550.54.15"
    (tmp_path / "module/nvidia/version").write_text("550\u0660.1\n")
    assert runtimepm.driver_version(str(tmp_path)) == ""
    assert runtimepm.driver_version(str(tmp_path / "none")) == ""

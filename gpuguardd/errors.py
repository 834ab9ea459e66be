"""Exceptions shared by the engine, the service and the CLI, each mapped to one D-Bus error
name of the contract, so the service translates them without knowing where they came from."""

from __future__ import annotations


class GpuGuardError(Exception):
    """Base class; `dbus_name` is the suffix under org.gpuguard.GpuGuard1.Error."""

    dbus_name = "Failed"


class InvalidArgument(GpuGuardError):
    dbus_name = "InvalidArgument"


class NotAuthorized(GpuGuardError):
    dbus_name = "NotAuthorized"

    def __init__(self, message: str, uid: int | None = None) -> None:
        super().__init__(message)
        self.uid = uid  # who was refused, when known: refusals are logged once per uid


class NvmlError(GpuGuardError):
    dbus_name = "NvmlError"


class ConfigError(GpuGuardError):
    dbus_name = "InvalidArgument"

    def __init__(self, path: str, line: int, key: str, message: str) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


class DaemonUnavailable(GpuGuardError):
    """No gpuguardd answers on the bus (not running, not installed, or the bus is down)."""

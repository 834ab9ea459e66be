"""Small helpers every kind of test uses, written once: polling, busctl's JSON, free ports,
whether a process is gone, the CLI's JSON output.

Larger fixtures live with their kind: tests/conftest.py (a fake GPU host), dbus_harness.py
(a daemon on a private bus), e2e/harness.py (a throwaway systemd), cockpit_harness.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any, Protocol


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02,
               error: type[Exception] = AssertionError) -> Any:
    """Poll `predicate` until it returns a true value, and return it; `error` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise error(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def unwrap_busctl(value: Any) -> Any:
    """busctl --json values ({"type": "s", "data": ...} for variants) as plain Python."""
    if isinstance(value, dict):
        if set(value) == {"type", "data"}:
            return unwrap_busctl(value["data"])
        return {k: unwrap_busctl(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap_busctl(v) for v in value]
    return value


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def gone(pid: int) -> bool:
    """Whether process `pid` (of this PID namespace) has ended. A zombie has: it holds no GPU
    and runs no code, it only waits for its parent (often the test itself) to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def alive(pid: int) -> bool:
    return not gone(pid)


class HasCli(Protocol):
    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]: ...


def cli_json(host: HasCli, *args: str) -> tuple[int, Any, str]:
    """`gpuguardctl ARGS --json` on `host`: exit status, the parsed output, stderr."""
    result = host.cli(*args, "--json")
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


__all__ = ["alive", "cli_json", "free_port", "gone", "unwrap_busctl", "wait_until"]

"""`gpuguardctl hook install|remove|list`: systemd/dropins.py's drop-ins under /etc/systemd/system
(or --root), then a daemon-reload. Needs no gpuguardd.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from gpuguardd.cli.output import print_json
from gpuguardd.escaping import escape_text
from gpuguardd.systemd.dropins import HookError, InstalledHook, install, list_hooks, remove


def format_list(hooks: Sequence[InstalledHook]) -> str:
    if not hooks:
        return "no gpuguard hooks installed\n"
    lines: list[str] = []
    for hook in hooks:
        mark = "gpuguard" if hook.ours else "foreign (calls gpuguardctl, not written by gpuguard)"
        lines.append(f"{hook.target.name} ({hook.target.kind}) {hook.path} [{mark}]")
        lines.extend([f"    applies to {unit}" for unit in hook.applies_to] or ["    applies to no unit known yet"])
    # Unit and file names come from directories on the host: shown escaped (escaping.py).
    return "\n".join(escape_text(line) for line in lines) + "\n"


def run_command(args: argparse.Namespace, out: TextIO) -> int:
    """Exit status: 0 done (or nothing to do), 1 error, 2 bad pattern."""
    root = os.path.abspath(args.root)
    try:
        if args.hook_action == "list":
            hooks = list_hooks(args.pattern, root)
            print_json([h.to_dict() for h in hooks], out) if args.json else out.write(format_list(hooks))
            return 0
        act = install if args.hook_action == "install" else remove
        result = act(args.pattern, root, reload=not args.no_reload, start=args.start)
    except HookError as exc:
        sys.stderr.write(f"gpuguardctl: error: {escape_text(exc)}\n")
        return 2 if exc.usage else 1
    except OSError as exc:
        where = exc.filename or ""
        sys.stderr.write(f"gpuguardctl: error: {escape_text(f'{where}: {exc.strerror or exc}')}\n")
        return 1
    if args.json:
        print_json(dataclasses.asdict(result), out)
        return 0
    out.writelines(escape_text(message) + "\n" for message in result.messages)
    verb = {"unchanged": "already installed", "absent": "nothing to remove"}.get(result.action, result.action)
    out.write(escape_text(f"{result.target}: {verb} ({result.path}); daemon-reload: {result.daemon_reload}") + "\n")
    return 0

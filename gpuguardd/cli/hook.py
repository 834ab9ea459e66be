"""`gpuguardctl hook install|remove|list PATTERN [--start]`: the verb over systemd/dropins.py.

Needs no daemon: it writes and lists files under /etc/systemd/system (or --root) and asks
systemd to reload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from gpuguardd.escaping import escape_text
from gpuguardd.systemd.dropins import HookError, InstalledHook, install, list_hooks, remove


def format_list(hooks: Sequence[InstalledHook]) -> str:
    if not hooks:
        return "no gpuguard hooks installed\n"
    lines: list[str] = []
    for hook in hooks:
        mark = "gpuguard" if hook.ours else "foreign (calls gpuguardctl, not written by gpuguard)"
        lines.append(f"{hook.target.name} ({hook.target.kind}) {hook.path} [{mark}]")
        if hook.applies_to:
            lines.extend(f"    applies to {unit}" for unit in hook.applies_to)
        else:
            lines.append("    applies to no unit known yet")
    # Unit and file names come from directories on the host: shown escaped (escaping.py).
    return "\n".join(escape_text(line) for line in lines) + "\n"


def add_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser],
               common: argparse.ArgumentParser) -> None:
    hook = verbs.add_parser(
        "hook", parents=[common],
        help="install, remove or list ExecStopPost drop-ins that sweep a unit after it stops")
    actions = hook.add_subparsers(dest="hook_action", metavar="ACTION")
    actions.required = True
    for action, text in (("install", "write the drop-in and reload systemd (idempotent)"),
                         ("remove", "delete the drop-in and reload systemd"),
                         ("list", "show installed hooks and the units they apply to")):
        sub = actions.add_parser(action, parents=[common], help=text)
        sub.add_argument("pattern", nargs="?" if action == "list" else None, default="",
                         metavar="PATTERN",
                         help="a unit (vllm-qwen.service), a prefix ending in '-' (sglang-) "
                              "or a template (foo@.service)")
        sub.add_argument("--root", default="/", metavar="DIR",
                         help="operate on the tree under DIR (packaging, tests); no daemon-reload")
        if action != "list":
            sub.add_argument("--no-reload", action="store_true",
                             help="do not run systemctl daemon-reload")
            sub.add_argument("--start", action="store_true",
                             help="the start gate's ExecStartPre drop-in (gpuguard-start.conf: "
                                  "`gpuguardctl wait` on the unit's GPUs) instead of the stop hook")


def run_command(args: argparse.Namespace, out: TextIO) -> int:
    """Exit status: 0 done (also: already installed, nothing to remove), 1 error, 2 bad pattern."""
    root = os.path.abspath(args.root)
    try:
        if args.hook_action == "list":
            hooks = list_hooks(args.pattern, root)
            if args.json:
                out.write(json.dumps([h.to_dict() for h in hooks], indent=2, sort_keys=True) + "\n")
            else:
                out.write(format_list(hooks))
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
        out.write(json.dumps(dataclasses.asdict(result), indent=2, sort_keys=True) + "\n")
        return 0
    for message in result.messages:
        out.write(escape_text(message) + "\n")
    verb = {"installed": "installed", "updated": "updated", "unchanged": "already installed",
            "removed": "removed", "absent": "nothing to remove"}[result.action]
    out.write(escape_text(f"{result.target}: {verb} ({result.path}); daemon-reload: "
                          f"{result.daemon_reload}") + "\n")
    return 0

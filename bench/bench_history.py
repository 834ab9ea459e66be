"""Loading a large sweep history: time and peak memory of History.load() on one file.

The peer is the same load by another checkout (`--peer DIR`, e.g. an older gpuguard), on a copy
of the same file, in a fresh interpreter each, so neither pays for the other's memory. The file
holds `--mb` megabytes of realistic reports (a few targets each), written once per run in a
private temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: load the history and print seconds, peak RSS and reports kept as JSON.
CHILD = """
import json, resource, sys, time
from gpuguardd.daemon.history import History
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
history = History(sys.argv[1], int(sys.argv[2]))
start = time.perf_counter()
history.load()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": peak, "base_kib": before,
                  "kept": len(history.newest(0))}))
"""


def report(n: int) -> dict[str, object]:
    target = {"pid": 1000 + n, "comm": "python3", "unit": "sglang-qwen.service",
              "container": "", "kind": "compute", "gpus": [0, 1], "gpu_memory": 2 << 30,
              "exe": "/usr/bin/python3.11"}
    return {"id": f"{n:032x}", "started_usec": 1_700_000_000_000_000 + n, "duration_ms": 52,
            "requested_by": "hook:sglang-qwen.service", "reason": "hook:sglang-qwen.service",
            "scope": {"gpus": [], "unit": "sglang-qwen.service", "container": "",
                      "include_management": False},
            "dry_run": False, "outcome": "freed", "verified": True,
            "targets": [target] * 3, "terminated": [{"pid": 1000 + n, "comm": "python3",
                                                     "unit": "sglang-qwen.service",
                                                     "signal": "SIGTERM",
                                                     "exited_after_ms": 4}] * 3,
            "survived": [], "spared": [], "leaks": [], "warnings": [], "error": "",
            "gpus": [{"index": 0, "uuid": "GPU-00000000-0000-4000-8000-000000000001",
                      "memory_used_before": 2 << 30, "memory_used_after": 0,
                      "memory_total": 80 << 30, "released": True}]}


def write_history(path: Path, megabytes: int) -> int:
    size = megabytes * 1024 * 1024
    written = count = 0
    with open(path, "wb") as handle:
        while written < size:
            line = (json.dumps(report(count), sort_keys=True) + "\n").encode()
            handle.write(line)
            written += len(line)
            count += 1
    return count


def measure(checkout: Path, directory: Path, max_entries: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(max_entries)],
                          env=env, cwd=str(checkout), capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=100, help="history size in MiB")
    parser.add_argument("--max-entries", type=int, default=1000, help="HistoryMax")
    parser.add_argument("--peer", type=Path, help="another gpuguard checkout to compare with")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gg-bench-history-"))
    try:
        source = work / "source.jsonl"
        count = write_history(source, args.mb)
        print(f"history: {args.mb} MiB, {count} reports, HistoryMax={args.max_entries}")
        checkouts = [("this checkout", ROOT)] + ([("peer", args.peer)] if args.peer else [])
        for name, checkout in checkouts:
            state = work / name.replace(" ", "-")
            state.mkdir()
            # load() compacts the file: each run gets its own copy.
            shutil.copyfile(source, state / "history.jsonl")
            got = measure(checkout, state, args.max_entries)
            print(f"{name:14} {got['seconds']:7.2f} s  peak RSS {got['peak_kib'] / 1024:7.1f} MiB "
                  f"(interpreter alone {got['base_kib'] / 1024:.1f} MiB), kept {got['kept']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

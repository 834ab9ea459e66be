"""`make demo`: gpuguard at work on a real systemd, on any Debian 12 machine, no GPU needed.

Boots the machine's own systemd as PID 1 in a throwaway container (systemd-nspawn over a
volatile overlay of /: every write lands in RAM and is gone at the end), installs gpuguard the
way the package does, starts a fake SGLang server whose ranks hold two fake H100s, and runs
the admin's one command, `systemctl stop sglang-qwen`. Then it tells what gpuguard did. It
reuses the end-to-end tests' harness (tests/e2e/harness.py), so the demo is what CI proves.

Run as root: `make demo` (installs the Debian packages and the venv it needs first).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuguardd.escaping import escaped  # noqa: E402  (the repository root is only on the path now)
from tests.e2e.harness import (  # noqa: E402
    BusSignal,
    HarnessError,
    Installed,
    Machine,
    host_fingerprint,
    require_tools,
    wait_for,
)

UNIT = "sglang-qwen.service"
GiB = 1024 ** 3
BOLD = "\033[1m" if sys.stdout.isatty() else ""
DIM = "\033[2m" if sys.stdout.isatty() else ""
RESET = "\033[0m" if sys.stdout.isatty() else ""


def step(number: int, text: str) -> None:
    print(f"\n{BOLD}[{number}/7] {text}{RESET}", flush=True)


def say(text: str = "") -> None:
    print(f"      {text}", flush=True)


def show(output: str) -> None:
    for line in output.rstrip("\n").splitlines():
        print(f"      {DIM}│{RESET} {line}")
    sys.stdout.flush()


def gib(value: int) -> str:
    return f"{value / GiB:.1f} GiB"


def narrate_report(report: dict[str, Any]) -> None:
    report = escaped(report)  # process and unit names, escaped as gpuguardctl shows them
    say(f"report {report['id'][:8]}, requested by {report['requested_by']}, "
        f"{report['duration_ms']} ms")
    say(f"reason: {report['reason']}")
    say("holders found (unit / container as attributed from /proc/<pid>/cgroup):")
    adopted = set(report["scope"].get("adopted_pids", []))
    for target in report["targets"]:
        where = target.get("unit") or "(none)"
        container = target.get("container") or "host"
        note = "  <- left the unit's cgroup; still its leftover" if target["pid"] in adopted else ""
        memory = gib(target["gpu_memory"]) if target["gpu_memory"] else "-"  # 0: NVML does not know
        say(f"  pid {target['pid']:<6} {target['comm']:<14} unit {where:<20} {container:<5} "
            f"GPU {','.join(str(g) for g in target['gpus'])}  {memory}{note}")
    if any(not target["gpu_memory"] for target in report["targets"]):
        say("  (-: NVML names processes by their PIDs on the host, which name nothing in this "
            "container; the GPUs' memory below is what is verified)")
    say("signals sent (through pidfds, so a recycled PID is never hit):")
    for ended in report["terminated"]:
        why = " (it ignored SIGTERM)" if ended["signal"] == "SIGKILL" else ""
        say(f"  pid {ended['pid']:<6} {ended['comm']:<14} {ended['signal']} -> exited after "
            f"{ended['exited_after_ms']} ms{why}")
    for survivor in report["survived"]:
        say(f"  pid {survivor['pid']} {survivor['comm']} SURVIVED: {survivor['why']}")
    say("GPU memory, read through NVML:")
    for gpu in report["gpus"]:
        say(f"  GPU {gpu['index']}: {gib(gpu['memory_used_before'])} before -> "
            f"{gib(gpu['memory_used_after'])} after")
    verified = "verified through NVML" if report["verified"] else "NOT verified"
    say(f"outcome: {BOLD}{report['outcome']}{RESET} ({verified})")


def narrate_signals(signals: list[BusSignal]) -> None:
    if not signals:
        say("(none seen)")
        return
    start = signals[0].usec
    for sig in signals:
        at = f"+{(sig.usec - start) // 1000:>5} ms"
        args = escaped(sig.args)
        if sig.member == "SweepStarted":
            say(f"{at}  SweepStarted({args[0][:8]}, unit={args[1].get('unit', '')})")
        elif sig.member == "ProcessTerminated":
            say(f"{at}  ProcessTerminated({args[0][:8]}, pid={args[1]}, "
                f"comm={args[2]}, unit={args[3] or '-'}, {args[4]})")
        elif sig.member == "SweepFinished":
            say(f"{at}  SweepFinished({args[0][:8]}, {args[1]}, report)")
        else:
            say(f"{at}  {sig.member}{tuple(args)}")


def demo(machine: Machine) -> bool:
    step(1, "Booting systemd as PID 1 in a throwaway container")
    say("systemd-nspawn --volatile=overlay over a bind mount of /: writes go to a tmpfs")
    started = time.monotonic()
    machine.boot()
    version = machine.run(["systemctl", "--version"]).stdout.splitlines()[0]
    say(f"{version}: up in {time.monotonic() - started:.1f} s")

    step(2, "Installing gpuguard the way its package does")
    guard = Installed(machine)
    guard.install(watch="")
    for path in ("/usr/lib/systemd/system/gpuguardd.service",
                 "/usr/share/gpuguard/dropins/sglang-.service.d/gpuguard.conf  (and vllm-, tgi-, "
                 "ollama-, llama-, triton-)",
                 "/usr/share/dbus-1/system.d/org.gpuguard.GpuGuard1.conf",
                 "/usr/share/dbus-1/system-services/org.gpuguard.GpuGuard1.service",
                 "/usr/share/polkit-1/actions/org.gpuguard.GpuGuard1.policy"):
        say(path)
    say("hooks turned on by the admin: gpuguardctl hook install sglang-  (and the other prefixes)")
    show(machine.run(["gpuguardctl", "hook", "list"]).stdout)
    say("test doubles: /dev/nvidia0, /dev/nvidia1, /dev/nvidiactl, /dev/nvidia-uvm and a fake "
        "libnvidia-ml.so.1 reporting two H100 80GB")
    guard.start_daemon()
    say(f"gpuguardd.service is {machine.show('gpuguardd.service', 'ActiveState')}: "
        f"\"{machine.show('gpuguardd.service', 'StatusText')}\"")

    step(3, f"Starting {UNIT}: a launcher and 3 tensor-parallel ranks on GPUs 0 and 1")
    say("KillMode=process, as many inference units have: systemctl stop ends the launcher only")
    pids = guard.start_server(UNIT, workers=3, gpus=(0, 1), mib=36 * 1024, stubborn=(1,),
                              escaper=2, cuda="0,1")
    show(machine.run(["gpuguardctl", "holders"]).stdout)
    say(f"rank 1 (pid {pids['worker1']}) ignores SIGTERM, like a rank stuck in NCCL teardown;")
    say(f"rank 2 (pid {pids['worker2']}) now leaves the unit's cgroup, like a re-parented worker:")
    machine.run(["kill", "-USR1", str(pids["worker2"])])
    wait_for("rank 2 to leave the unit", lambda: UNIT not in guard.cgroup(pids["worker2"]), 10)
    show(machine.run(["gpuguardctl", "holders"]).stdout)
    show(machine.run(["gpuguardctl", "gpus"]).stdout)

    step(4, f"The admin's only command: systemctl stop {UNIT.removesuffix('.service')}")
    with guard.monitor() as signals:
        started = time.monotonic()
        machine.systemctl("stop", UNIT)
        took = time.monotonic() - started
    say(f"returned after {took:.1f} s: systemd stopped the launcher, then ran the drop-in's")
    say("ExecStopPost=+-/usr/bin/timeout ... gpuguardctl sweep --unit %n --reason \"hook:%n ...\"")

    step(5, "What gpuguard did")
    report = guard.reports_for(UNIT)[0]
    narrate_report(report)

    step(6, "What everyone else saw")
    say("on the system bus (busctl monitor, interface org.gpuguard.GpuGuard1.Manager):")
    narrate_signals(signals)
    say("in the history (busctl call ... GetHistory 1):")
    newest = escaped(guard.history(1)[0])
    say(f"  {newest['id'][:8]}  {newest['outcome']}  requested by {newest['requested_by']}  "
        f"{len(newest['terminated'])} terminated")
    say("in the journal (journalctl -u gpuguardd):")
    show("\n".join(line for line in machine.journal("-u", "gpuguardd.service").splitlines()
                   if report["id"][:8] in line or f"{UNIT}:" in line))

    step(7, "Checking, and cleaning up")
    workers = [pid for name, pid in pids.items() if name.startswith("worker")]
    left = [p for p in workers if guard.alive(p)]
    say(f"ranks still running: {left or 'none'}")
    show(machine.run(["gpuguardctl", "gpus"]).stdout)
    return report["outcome"] == "freed" and not left


def main() -> int:
    missing = require_tools()
    if missing:
        print(f"make demo needs: {', '.join(missing)} (run it as root: `make demo`)",
              file=sys.stderr)
        return 1
    sentinel = Path("/tmp") / f"gpuguard-demo-{uuid.uuid4().hex}"
    sentinel.write_text("the host's /tmp keeps this\n")
    before = host_fingerprint(["/etc/systemd/system"])
    machine = Machine()
    ok = False
    try:
        ok = demo(machine)
    except HarnessError as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        machine.shutdown()
        kept = sentinel.exists()
        sentinel.unlink(missing_ok=True)
    untouched = kept and host_fingerprint(["/etc/systemd/system"]) == before \
        and not machine.base.exists()
    say(f"container stopped; nothing left running; host untouched: {'yes' if untouched else 'NO'}"
        f" (/etc/systemd/system unchanged, /tmp kept, {machine.base} removed)")
    if ok and untouched:
        print(f"\n{BOLD}gpuguard freed the GPUs of {UNIT} with no command but systemctl stop.{RESET}")
        return 0
    return 1


if __name__ == "__main__":
    if os.geteuid() != 0:
        print("make demo must run as root (it boots a container)", file=sys.stderr)
        sys.exit(1)
    sys.exit(main())

"""Fleet integration on the real systemd (the session's throwaway machine), against the real
servers: Debian's prometheus-node-exporter (textfile collector) and prometheus scraping both
ways gpuguard exports metrics, the socket-activated DynamicUser exporter, and container scopes
in [Watch] Units=. Every server listens on 127.0.0.1 inside the container's own network
namespace and runs as a transient unit that the test stops.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from collections.abc import Iterator

import pytest

from tests.e2e.harness import REPO, VENV_PYTHON, HarnessError, Installed, interpreter_access, wait_for

TEXTFILES = "/var/lib/prometheus/node-exporter"
PROM_DIR = "/var/lib/gpuguard-e2e-prometheus"
EXPORTER_PORT = 9835
NODE_PORT = 9100
PROM_PORT = 19090  # 9090 is cockpit.socket's

PROMETHEUS_YML = f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: node
    static_configs: [{{targets: ['127.0.0.1:{NODE_PORT}']}}]
  - job_name: gpuguard
    static_configs: [{{targets: ['127.0.0.1:{EXPORTER_PORT}']}}]
"""

# An HTTP GET inside the container (the system Python's urllib: no curl needed).
HTTP_GET = ("import sys, urllib.request\n"
            "with urllib.request.urlopen(sys.argv[1], timeout=10) as r:\n"
            "    sys.stdout.write(r.read().decode())\n")


def http_get(guard: Installed, url: str) -> str:
    return guard.machine.run(["/usr/bin/python3", "-c", HTTP_GET, url], timeout=30).stdout


def query(guard: Installed, expr: str) -> dict[str, float]:
    """Prometheus's instant query API: {job: value} for `expr`."""
    from urllib.parse import quote

    data = json.loads(http_get(guard, f"http://127.0.0.1:{PROM_PORT}/api/v1/query?query={quote(expr)}"))
    assert data["status"] == "success", data
    return {r["metric"].get("job", ""): float(r["value"][1]) for r in data["data"]["result"]}


def metric_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def prometheus(guard: Installed) -> Iterator[Installed]:
    """The textfile configured, the exporter's socket enabled, node_exporter and Prometheus
    running as transient units; all undone afterwards."""
    if shutil.which("prometheus") is None or shutil.which("prometheus-node-exporter") is None:
        pytest.fail("prometheus and prometheus-node-exporter are required (make deps installs them)")
    m = guard.machine
    # Masked at boot (harness.BOOT_MASKED): Debian's own units of these servers never run here.
    for unit in ("prometheus.service", "prometheus-node-exporter.service"):
        assert m.show(unit, "LoadState") == "masked", unit
    m.write("/etc/gpuguard/gpuguard.conf.d/metrics.conf", f"[Metrics]\nTextfileDirectory={TEXTFILES}\n")
    m.systemctl("reload", "gpuguardd.service")
    m.write("/usr/libexec/gpuguard/gpuguard-exporter",
            f"#!/bin/sh\nexec {VENV_PYTHON} -m gpuguardd.exporter.main \"$@\"\n", 0o755)
    m.copy(REPO / "systemd" / "gpuguard-exporter.socket", "/usr/lib/systemd/system/gpuguard-exporter.socket")
    m.install_shipped("systemd/gpuguard-exporter.service", "/usr/lib/systemd/system/gpuguard-exporter.service")
    m.copy(REPO / "systemd" / "gpuguard-exporter.sysusers", "/usr/lib/sysusers.d/gpuguard-exporter.conf")
    m.run(["systemd-sysusers", "gpuguard-exporter.conf"])  # as the packages' postinst does
    # The venv's interpreter may live under /root (pyenv); the package uses /usr/bin/python3.
    m.write("/etc/systemd/system/gpuguard-exporter.service.d/e2e.conf",
            "[Service]\n" + interpreter_access())
    m.write("/etc/gpuguard-e2e/prometheus.yml", PROMETHEUS_YML)
    m.systemctl("daemon-reload")
    m.systemctl("enable", "--now", "gpuguard-exporter.socket")
    m.run(["systemd-run", "--collect", "--unit=e2e-node-exporter", "--property=User=prometheus",
           "/usr/bin/prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{NODE_PORT}",
           "--collector.disable-defaults", "--collector.textfile",
           f"--collector.textfile.directory={TEXTFILES}"])
    m.run(f"rm -rf {PROM_DIR}; mkdir -p {PROM_DIR}; chown prometheus: {PROM_DIR}")
    m.run(["systemd-run", "--collect", "--unit=e2e-prometheus", "--property=User=prometheus",
           "/usr/bin/prometheus", "--config.file=/etc/gpuguard-e2e/prometheus.yml",
           f"--storage.tsdb.path={PROM_DIR}", f"--web.listen-address=127.0.0.1:{PROM_PORT}"])
    try:
        try:
            wait_for("Prometheus to scrape both targets", lambda: _both_up(guard), 60, 0.5)
        except Exception as exc:
            logs = m.journal("-n", "60", "-u", "e2e-prometheus.service", "-u", "e2e-node-exporter.service",
                             "-u", "gpuguard-exporter.service", "-u", "gpuguard-exporter.socket")
            raise AssertionError(f"{exc}\n{logs}") from None
        yield guard
    finally:
        for unit in ("e2e-prometheus.service", "e2e-node-exporter.service"):
            m.systemctl("stop", unit, check=False)
        m.systemctl("disable", "--now", "gpuguard-exporter.socket", check=False)
        m.systemctl("stop", "gpuguard-exporter.service", check=False)
        m.run(f"rm -rf {PROM_DIR} /etc/gpuguard-e2e /etc/gpuguard/gpuguard.conf.d/metrics.conf "
              f"{TEXTFILES}/gpuguard.prom")
        m.systemctl("reload", "gpuguardd.service", check=False)


def _both_up(guard: Installed) -> bool:
    try:
        up = query(guard, "up")
    except Exception:
        return False
    return up.get("node") == 1 and up.get("gpuguard") == 1


def test_prometheus_sees_a_sweep_both_ways(prometheus: Installed) -> None:
    guard = prometheus
    m = guard.machine
    unit = "watched-metrics.service"
    before = http_get(guard, f"http://127.0.0.1:{EXPORTER_PORT}/metrics")
    freed_before = metric_value(before, "gpuguard_sweeps_total", outcome="freed", trigger="watch") or 0
    sigterm_before = metric_value(before, "gpuguard_processes_terminated_total", signal="SIGTERM") or 0
    pids = guard.start_server(unit, workers=2, gpus=(1,))
    workers = [v for k, v in pids.items() if k.startswith("worker")]
    in_use = 'gpuguard_gpu_state{gpu="1",state="in-use"}'
    wait_for("GPU 1 in use in both jobs", lambda: query(guard, in_use) == {"node": 1, "gpuguard": 1}, 30, 0.5)
    assert query(guard, 'gpuguard_gpu_holders{gpu="1",kind="compute"}') == {"node": 2, "gpuguard": 2}

    m.systemctl("stop", unit)
    report = wait_for("the watch's report", lambda: guard.reports_for(unit) or None, 30)[0]
    assert report["outcome"] == "freed" and {t["pid"] for t in report["terminated"]} == set(workers)

    both = {"node": freed_before + 1, "gpuguard": freed_before + 1}
    freed = 'gpuguard_sweeps_total{outcome="freed",trigger="watch"}'
    wait_for("the new sweep count in Prometheus", lambda: query(guard, freed) == both or None, 30, 0.5)
    terminated = 'gpuguard_processes_terminated_total{signal="SIGTERM"}'
    assert query(guard, terminated) == {"node": sigterm_before + 2, "gpuguard": sigterm_before + 2}
    idle = 'gpuguard_gpu_state{gpu="1",state="idle",UUID="GPU-00000000-0000-4000-8000-000000000001"}'
    wait_for("GPU 1 idle in both jobs", lambda: query(guard, idle) == {"node": 1, "gpuguard": 1}, 30, 0.5)
    last = query(guard, "gpuguard_last_sweep_timestamp_seconds")
    assert last["node"] == last["gpuguard"] >= report["started_usec"] / 1e6

    # What was scraped is clean for promtool, both ways.
    for text in (http_get(guard, f"http://127.0.0.1:{EXPORTER_PORT}/metrics"),
                 m.read(f"{TEXTFILES}/gpuguard.prom")):
        done = m.run(["promtool", "check", "metrics"], input=text, check=False)
        assert done.returncode == 0 and (done.stdout + done.stderr).strip() == "", done.stdout + done.stderr


def test_exporter_is_unprivileged_and_the_daemon_keeps_no_network(prometheus: Installed) -> None:
    m = prometheus.machine
    http_get(prometheus, f"http://127.0.0.1:{EXPORTER_PORT}/metrics")  # activates it if idle
    pid = wait_for("the exporter's main PID", lambda: int(m.show("gpuguard-exporter.service", "MainPID")) or None, 10)
    status = m.read(f"/proc/{pid}/status")
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    assert uid != 0 and m.run(["id", "-un", str(uid)]).stdout.strip() == "gpuguard-exporter"
    assert int(re.search(r"^CapEff:\s+([0-9a-f]+)", status, re.M).group(1), 16) == 0  # type: ignore[union-attr]
    assert m.show("gpuguard-exporter.service", "DynamicUser") == "yes"
    assert m.show("gpuguardd.service", "PrivateNetwork") == "yes"
    # The daemon lives in a network namespace of its own (no interfaces but lo); the exporter
    # serves on the socket systemd made in the host's (here: the container's) namespace.
    daemon = int(m.show("gpuguardd.service", "MainPID"))
    assert m.run(["readlink", f"/proc/{daemon}/ns/net"]).stdout != m.run(["readlink", "/proc/1/ns/net"]).stdout
    done = m.run(["systemd-analyze", "verify", "--man=no",
                  "/usr/lib/systemd/system/gpuguard-exporter.socket",
                  "/usr/lib/systemd/system/gpuguard-exporter.service"], check=False)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


# One request to the exporter from inside, by a plain socket: its status line, or the error
# (TimeoutError where a BPF filter drops the SYN: the allow-list answers nothing, not even RST).
PROBE = ("import socket, sys\n"
         "try:\n"
         "    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:\n"
         "        s.settimeout(10)\n"
         "        s.sendall(b'GET /metrics HTTP/1.0\\r\\n\\r\\n')\n"
         "        data = b''\n"
         "        while chunk := s.recv(65536):\n"
         "            data += chunk\n"
         "    print(data.split(b'\\r\\n', 1)[0].decode())\n"
         "except OSError as exc:\n"
         "    print(type(exc).__name__)\n")
OUTSIDER = "10.254.0.7"  # an address of this machine that is not loopback


def probe(guard: Installed, address: str) -> str:
    """`served`, or what the request got instead."""
    answer = guard.machine.run(["/usr/bin/python3", "-c", PROBE, address, str(EXPORTER_PORT)],
                               timeout=30).stdout.strip()
    return "served" if re.fullmatch(r"HTTP/1\.[01] 200 OK", answer) else answer


def test_exporter_socket_serves_loopback_only(prometheus: Installed) -> None:
    """The shipped allow-list (IPAddressDeny=any, IPAddressAllow=localhost) as systemd applies
    it, with a BPF filter on the socket: a connection from an address outside it gets no answer,
    loopback is served, and the same outside address is served once a drop-in lets it in (so
    it was the allow-list that kept it out, and an operator's drop-in does work)."""
    m = prometheus.machine
    m.run(f"ip addr add {OUTSIDER}/32 dev lo")
    try:
        assert probe(prometheus, "127.0.0.1") == "served"
        assert probe(prometheus, OUTSIDER) == "TimeoutError"
        m.systemctl("set-property", "--runtime", "gpuguard-exporter.socket",
                    f"IPAddressAllow={OUTSIDER}/32")
        assert probe(prometheus, OUTSIDER) == "served"
        m.systemctl("revert", "gpuguard-exporter.socket")
        m.systemctl("daemon-reload")
        assert probe(prometheus, OUTSIDER) == "TimeoutError"
        assert probe(prometheus, "127.0.0.1") == "served"
    finally:
        m.systemctl("revert", "gpuguard-exporter.socket", check=False)
        m.run(f"ip addr del {OUTSIDER}/32 dev lo", check=False)


def test_idle_exporter_exits_and_the_socket_starts_it_again(prometheus: Installed) -> None:
    m = prometheus.machine
    m.write("/etc/systemd/system/gpuguard-exporter.service.d/idle.conf",
            "[Service]\nExecStart=\nExecStart=/usr/libexec/gpuguard/gpuguard-exporter --idle-exit 2s\n")
    m.systemctl("daemon-reload")
    m.systemctl("stop", "e2e-prometheus.service")  # nothing scrapes now
    try:
        m.systemctl("restart", "gpuguard-exporter.service")
        wait_for("the idle exporter to exit",
                 lambda: m.show("gpuguard-exporter.service", "ActiveState") == "inactive", 20, 0.5)
        assert m.show("gpuguard-exporter.service", "Result") == "success"
        assert "gpuguard_nvml_up 1.0" in http_get(prometheus, f"http://127.0.0.1:{EXPORTER_PORT}/metrics")
        assert m.show("gpuguard-exporter.service", "ActiveState") == "active"
    finally:
        m.run("rm -f /etc/systemd/system/gpuguard-exporter.service.d/idle.conf")
        m.systemctl("daemon-reload")


# -- containers: [Watch] Units= takes their scopes ------------------------------------------

def test_watch_sweeps_a_removed_containers_leftovers(guard: Installed) -> None:
    """Docker's systemd cgroup driver runs a container as docker-<id>.scope; here a transient
    scope of that name runs the fake server, one of its workers leaves the scope's cgroup, and
    the scope is stopped (what `docker rm -f` does): the watch sweeps the worker left behind."""
    m = guard.machine
    cid = secrets.token_hex(32)
    unit = f"docker-{cid}.scope"
    m.write("/etc/gpuguard/gpuguard.conf.d/containers.conf", "[Watch]\nUnits=docker-*.scope libpod-*.scope\n")
    m.systemctl("reload", "gpuguardd.service")
    wait_for("the watch patterns", lambda: _watched(guard), 10, 0.3)
    server = m.popen(["systemd-run", "--scope", f"--unit={unit}", "--", "/usr/bin/python3",
                      str(REPO / "tests" / "e2e" / "fake_server.py"), f"--name=ctr-{cid[:8]}",
                      "--workers=2", "--gpu=1", "--mib=4096", "--escaper=1"])
    try:
        pids = wait_for("the container's workers", lambda: _pids(guard, f"ctr-{cid[:8]}"), 30, 0.3)
        workers = [pids["worker0"], pids["worker1"]]
        wait_for("gpuguardd to see them in the scope", lambda: {
            h["pid"] for h in guard.holders() if h["unit"] == unit and h["container"] == f"docker/{cid}"
        } >= set(workers) or None, 20, 0.3)
        m.run(["kill", "-USR1", str(workers[1])])  # leaves the container's cgroup
        wait_for("the worker to leave", lambda: unit not in guard.cgroup(workers[1]) or None, 10)
        m.systemctl("stop", unit)
        try:
            report = wait_for("the watch's sweep", lambda: guard.reports_for(unit) or None, 30, 0.5)[0]
        except HarnessError as exc:
            raise HarnessError(f"{exc}\n--- gpuguardd ---\n"
                               f"{m.journal('-n', '40', '-u', 'gpuguardd.service')}") from None
        assert report["requested_by"] == f"watch:{unit}"
        assert report["outcome"] == "freed", report
        assert [t["pid"] for t in report["terminated"]] == [workers[1]]
        assert report["scope"]["adopted_pids"] == [workers[1]]
        assert not guard.alive(workers[1])
    finally:
        server.kill()
        server.wait(timeout=10)
        m.systemctl("stop", unit, check=False)
        m.run("rm -f /etc/gpuguard/gpuguard.conf.d/containers.conf")
        m.systemctl("reload", "gpuguardd.service", check=False)


def _watched(guard: Installed) -> bool:
    done = guard.busctl("get-property", "org.gpuguard.GpuGuard1", "/org/gpuguard/GpuGuard1",
                        "org.gpuguard.GpuGuard1.Manager", "WatchedUnits")
    return "docker-*.scope" in done.stdout


def _pids(guard: Installed, name: str) -> dict[str, int] | None:
    try:
        return guard.server_pids(name)
    except OSError:
        return None

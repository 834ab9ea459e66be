"""`gpuguardctl hook install|remove|list`: ExecStopPost drop-ins, on a scratch root.

The real systemd picking them up (prefix drop-ins, daemon-reload, %n and $SERVICE_RESULT) is
proven in tests/e2e; here: which patterns are accepted, what is written, idempotency, never
touching an admin's file, and the hook's requested_by in the local fallback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguardd.cli import main as cli
from gpuguardd.cli.main import run as ctl
from gpuguardd.systemd import dropins as hooks
from gpuguardd.systemd.dropins import HookError, HookTarget, parse_pattern, render_dropin

ETC = "etc/systemd/system"


@pytest.mark.parametrize(("pattern", "name", "kind"), [
    ("sglang-", "sglang-.service", "prefix"),
    ("sglang-.service", "sglang-.service", "prefix"),
    ("vllm-qwen", "vllm-qwen.service", "unit"),
    ("vllm-qwen.service", "vllm-qwen.service", "unit"),
    ("foo@.service", "foo@.service", "template"),
    ("foo@", "foo@.service", "template"),
    ("foo@bar.service", "foo@bar.service", "unit"),
    ("a:b_c\\x2dd.service", "a:b_c\\x2dd.service", "unit"),
])
def test_valid_patterns(pattern: str, name: str, kind: str) -> None:
    assert parse_pattern(pattern) == HookTarget(name, kind)


@pytest.mark.parametrize(("pattern", "why"), [
    ("", "empty"),
    ("../x", "not a path"),
    ("a/b", "not a path"),
    (".hidden", "not a path"),
    ("a b", "whitespace"),
    (" sglang-", "whitespace"),
    ("*", "globs"),
    ("sglang-*", "globs"),
    ("vllm-?.service", "globs"),
    ("foo.socket", ".service"),
    ("foo.timer", ".service"),
    ("-", "family"),
    ("--", "family"),
    ("-.service", "family"),
    ("@.service", "template"),
    ("a@b@c.service", "template"),
    ("bad$name", "letters"),
    ("x" * 260, "at most"),
])
def test_invalid_patterns(pattern: str, why: str) -> None:
    with pytest.raises(HookError, match=why) as info:
        parse_pattern(pattern)
    assert info.value.usage


@pytest.mark.parametrize(("target", "unit", "applies"), [
    ("sglang-", "sglang-qwen.service", True),
    ("sglang-", "sglang-qwen-72b.service", True),
    ("sglang-", "sglang-.service", False),
    ("sglang-", "sglangx.service", False),
    ("sglang-", "my-sglang-qwen.service", False),
    ("sglang-", "sglang-qwen.socket", False),
    ("sglang-qwen-", "sglang-qwen-72b.service", True),
    ("vllm-qwen", "vllm-qwen.service", True),
    ("vllm-qwen", "vllm-qwen2.service", False),
    ("foo@", "foo@a.service", True),
    ("foo@", "foo@.service", False),
    ("foo@", "foobar.service", False),
])
def test_applies_to_follows_systemds_dropin_rules(target: str, unit: str, applies: bool) -> None:
    assert parse_pattern(target).applies_to(unit) is applies


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.run(["hook", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_install_writes_the_dropin_and_is_idempotent(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli("install", "sglang-", "--root", str(tmp_path), capsys=capsys)
    assert code == 0 and "installed" in out
    assert "skipped (--root given" in out  # the running systemd does not read that tree
    path = tmp_path / ETC / "sglang-.service.d" / "gpuguard.conf"
    text = path.read_text()
    assert text == render_dropin(HookTarget("sglang-.service", "prefix"))
    assert text.startswith(hooks.HEADER)
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    stop_post = [line for line in text.splitlines() if line.startswith("ExecStopPost=")]
    assert stop_post == [
        "ExecStopPost=+-/usr/bin/timeout --kill-after=5s 80s /usr/bin/gpuguardctl sweep "
        "--unit %n --reason \"hook:%n result=${SERVICE_RESULT} code=${EXIT_CODE} "
        "status=${EXIT_STATUS}\""]
    mtime = path.stat().st_mtime_ns
    code, out, _ = run_cli("install", "sglang-.service", "--root", str(tmp_path), capsys=capsys)
    assert code == 0 and "already installed" in out
    assert path.stat().st_mtime_ns == mtime and path.read_text() == text


def test_install_updates_an_older_version_of_ours(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / ETC / "vllm-.service.d" / "gpuguard.conf"
    path.parent.mkdir(parents=True)
    path.write_text(hooks.HEADER + "\n[Service]\nExecStopPost=/old\n")
    code, out, _ = run_cli("install", "vllm-", "--root", str(tmp_path), capsys=capsys)
    assert code == 0 and "updated" in out
    assert "ExecStopPost=/old" not in path.read_text()


def test_never_overwrites_or_removes_an_admins_file(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / ETC / "tgi-.service.d" / "gpuguard.conf"
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStopPost=/usr/local/bin/my-cleanup\n")
    for action in ("install", "remove"):
        code, _, err = run_cli(action, "tgi-", "--root", str(tmp_path), capsys=capsys)
        assert code == 1 and "not written by gpuguard" in err
    assert path.read_text() == "[Service]\nExecStopPost=/usr/local/bin/my-cleanup\n"


def test_remove_deletes_ours_and_missing_is_fine(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run_cli("install", "ollama-", "--root", str(tmp_path), capsys=capsys)
    other = tmp_path / ETC / "ollama-.service.d" / "limits.conf"
    other.write_text("[Service]\nLimitNOFILE=65536\n")
    code, out, _ = run_cli("remove", "ollama-", "--root", str(tmp_path), capsys=capsys)
    assert code == 0 and "removed" in out
    assert not (other.parent / "gpuguard.conf").exists()
    assert other.exists()  # the admin's drop-in and its directory stay
    os.unlink(other)
    code, out, _ = run_cli("remove", "ollama-", "--root", str(tmp_path), capsys=capsys)
    assert code == 0 and "no gpuguard hook for ollama-.service" in out


def test_remove_cleans_up_the_directory_it_made(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run_cli("install", "foo@", "--root", str(tmp_path), capsys=capsys)
    run_cli("remove", "foo@.service", "--root", str(tmp_path), capsys=capsys)
    assert not (tmp_path / ETC / "foo@.service.d").exists()


@pytest.mark.parametrize("pattern", ["", "../x", "a b", "*"])
def test_cli_refuses_bad_patterns_with_usage_status(tmp_path: Path, pattern: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli("install", pattern, "--root", str(tmp_path), capsys=capsys)
    assert code == 2 and "error:" in err
    assert not (tmp_path / "etc").exists()


def test_list_shows_ours_foreign_and_the_units(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    units = tmp_path / "usr/lib/systemd/system"
    units.mkdir(parents=True)
    for name in ("sglang-qwen.service", "sglang-llama.service", "vllm-a.service", "sshd.service"):
        (units / name).write_text("[Service]\nExecStart=/bin/true\n")
    run_cli("install", "sglang-", "--root", str(tmp_path), capsys=capsys)
    foreign = tmp_path / ETC / "vllm-a.service.d" / "cleanup.conf"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("[Service]\nExecStopPost=/usr/bin/gpuguardctl sweep --unit %n\n")
    (tmp_path / ETC / "sshd.service.d").mkdir()
    (tmp_path / ETC / "sshd.service.d" / "x.conf").write_text("[Service]\nNice=1\n")

    code, out, _ = run_cli("list", "--root", str(tmp_path), "--json", capsys=capsys)
    assert code == 0
    listed = {h["target"]: h for h in json.loads(out)}
    assert set(listed) == {"sglang-.service", "vllm-a.service"}  # sshd's drop-in is not ours
    assert listed["sglang-.service"]["ours"] is True
    assert listed["sglang-.service"]["units"] == ["sglang-llama.service", "sglang-qwen.service"]
    assert listed["vllm-a.service"]["ours"] is False
    code, out, _ = run_cli("list", "sglang-", "--root", str(tmp_path), capsys=capsys)
    assert "applies to sglang-qwen.service" in out and "vllm" not in out
    code, out, _ = run_cli("list", "nothing-", "--root", str(tmp_path), capsys=capsys)
    assert "no gpuguard hooks installed" in out


def test_daemon_reload_is_skipped_without_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "systemd_running", lambda root="/": False)
    assert hooks.daemon_reload("/") == "skipped (systemd is not PID 1 here)"
    assert hooks.daemon_reload("/srv/image").startswith("skipped (--root given")


@pytest.mark.parametrize(("reason", "requested_by"), [
    ("hook:sglang-qwen.service result=success code=exited status=0", "hook:sglang-qwen.service"),
    ("hook:foo@bar.service", "hook:foo@bar.service"),
    ("hook:", ""),
    ("hook:../../etc result=x", ""),
    ("manual cleanup", ""),
    ("", ""),
])
def test_requested_by_for_reason(reason: str, requested_by: str) -> None:
    assert hooks.requested_by_for_reason(reason) == requested_by


def test_hook_runs_the_gpuguardctl_that_installed_it(tmp_path: Path) -> None:
    """make install PREFIX=/usr/local: the drop-in must call /usr/local/bin/gpuguardctl."""
    import subprocess
    import sys

    bindir = tmp_path / "usr-local-bin"
    bindir.mkdir()
    program = bindir / "gpuguardctl"
    program.write_text(f"#!{sys.executable}\nfrom gpuguardd.cli.main import main\nmain()\n")
    program.chmod(0o755)
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    subprocess.run([str(program), "hook", "install", "sglang-", "--root", str(root)], env=env,
                   check=True, capture_output=True)
    text = (root / ETC / "sglang-.service.d" / "gpuguard.conf").read_text()
    assert f" {program} sweep --unit %n" in text
    assert text == render_dropin(HookTarget("sglang-.service", "prefix"), str(program))


def test_start_dropin_is_its_own_file_next_to_the_stop_hook(tmp_path: Path) -> None:
    assert ctl(["hook", "install", "sglang-", "--root", str(tmp_path)]) == 0
    assert ctl(["hook", "install", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    directory = tmp_path / "etc/systemd/system/sglang-.service.d"
    stop, start = directory / "gpuguard.conf", directory / "gpuguard-start.conf"
    text = start.read_text()
    assert "ExecStopPost" not in text
    exec_lines = [line for line in text.splitlines() if line.startswith("Exec")]
    assert len(exec_lines) == 1
    assert exec_lines[0].startswith("ExecStartPre=+") and exec_lines[0].endswith(
        " wait --timeout 60s $GPUGUARD_WAIT_OPTIONS")
    assert "TimeoutStartSec" in text  # the guidance is in the file the admin reads
    # Removing the gate leaves the stop hook, and the other way round.
    assert ctl(["hook", "remove", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    assert not start.exists() and "ExecStopPost" in stop.read_text()
    assert ctl(["hook", "install", "--start", "sglang-", "--root", str(tmp_path)]) == 0
    assert ctl(["hook", "remove", "sglang-", "--root", str(tmp_path)]) == 0
    assert start.exists() and not stop.exists()


def test_start_dropin_refuses_to_overwrite_an_admins_file(tmp_path: Path) -> None:
    directory = tmp_path / "etc/systemd/system/vllm-qwen.service.d"
    directory.mkdir(parents=True)
    (directory / "gpuguard-start.conf").write_text("[Service]\nExecStartPre=/bin/true\n")
    assert ctl(["hook", "install", "--start", "vllm-qwen", "--root", str(tmp_path)]) == 1
    assert (directory / "gpuguard-start.conf").read_text().endswith("/bin/true\n")


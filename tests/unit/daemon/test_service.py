"""Unit tests of gpuguardd/daemon/service.py."""

from __future__ import annotations

from gpuguardd.bus.auth import Caller
from gpuguardd.daemon.service import requester
from gpuguardd.records.enums import RequesterKind

ROOT = Caller(sender=":1.42", uid=0, user="root", interactive=False)


ALICE = Caller(sender=":1.43", uid=1000, user="alice", interactive=True)


def test_the_requester_kind_is_decided_with_requested_by() -> None:
    assert requester(ROOT, "hook:train.service result=exit-code") == (
        "hook:train.service", RequesterKind.HOOK)
    assert requester(ALICE, "hook:train.service") == (
        "hook:train.service via uid 1000 (alice) :1.43", RequesterKind.HOOK_NONROOT)
    assert requester(ROOT, "", slurm_job="42") == ("slurm:42", RequesterKind.SLURM)
    assert requester(ALICE, "slurm:42", slurm_job="42") == ("uid 1000 (alice) :1.43",
                                                            RequesterKind.MANUAL)
    assert requester(ROOT, "watch:x.service") == ("uid 0 (root) :1.42", RequesterKind.MANUAL)


def requested_by(caller: Caller, reason: str) -> str:
    return requester(caller, reason)[0]


def test_requested_by() -> None:
    root = Caller(sender=":1.42", uid=0, user="root", interactive=False)
    alice = Caller(sender=":1.43", uid=1000, user="alice", interactive=True)
    assert requested_by(alice, "") == "uid 1000 (alice) :1.43"
    assert requested_by(root, "hook:train.service result=exit-code") == "hook:train.service"
    # Only root is the hook; anyone else claiming to be is still named.
    assert requested_by(alice, "hook:train.service") == "hook:train.service via uid 1000 (alice) :1.43"
    assert requested_by(root, "cleanup after the outage") == "uid 0 (root) :1.42"


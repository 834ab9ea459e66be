"""One scope description (engine/models.describe_scope) for the journal's sweep lines and
gpuguardctl's reports and watch: a resolved Scope and a report's ReportScope read alike."""

from __future__ import annotations

from gpuguardd.cli.output import describe_scope as printed
from gpuguardd.records.models import Scope, describe_scope
from gpuguardd.records.report import ReportScope

MIG = "MIG-1a2b3c4d-0000-4000-8000-00000000000a"


def test_scope_and_report_scope_read_alike() -> None:
    scope = Scope(gpus=(0, 2), mig=(MIG,), unit="a.service", container="docker/abc")
    report = ReportScope.of(scope)
    words = f"GPU 0,2, MIG {MIG}, unit a.service, container docker/abc"
    assert describe_scope(scope) == describe_scope(report) == words
    assert printed(report) == words


def test_whole_host_and_management() -> None:
    assert describe_scope(Scope()) == "the whole host"
    assert describe_scope(Scope(include_management=True)) == "the whole host including management clients"
    assert describe_scope(Scope(gpus=(1,), include_management=True)) == "GPU 1 including management clients"
    # gpuguardctl has always said "whole host", and leaves management out
    assert printed(ReportScope(include_management=True)) == "whole host"


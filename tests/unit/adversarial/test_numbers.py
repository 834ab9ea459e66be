"""Numbers read loosely. Python's int() takes any Unicode digit ("\\u0660" and
"\\U0001d7ce" are 0, full-width "42" is 42) and str.isdigit() is True for "\\u00b2", which
int() then refuses with a traceback. Every entry point reads its numbers with
gpuguardd/numbers.py: ASCII digits within the type's range, or an error naming the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguardd.cli.main import build_parser
from gpuguardd.config import load_config
from gpuguardd.engine.slurm import check_request, epilog_job
from gpuguardd.errors import ConfigError, InvalidArgument
from gpuguardd.numbers import UID_MAX, BadNumber, parse_job_id, parse_uint
from gpuguardd.records.models import SweepRequest
from gpuguardd.records.selectors import INDEX, selector

ARABIC_ZERO = "\u0660"
MATH_ZERO = "\U0001d7ce"
FULLWIDTH_42 = "\uff14\uff12"
SUPERSCRIPT_TWO = "\u00b2"
# Not numbers anywhere: other scripts' digits, signs, spaces, separators, a trailing newline.
NOT_NUMBERS = [ARABIC_ZERO, MATH_ZERO, FULLWIDTH_42, SUPERSCRIPT_TWO, "", "-1", "+1", " 1",
               "1_000", "1\n", "0x10", "1e3", "\u00bd"]


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_only_ascii_digits_are_numbers(text: str) -> None:
    with pytest.raises(BadNumber, match="is not a number") as info:
        parse_uint(text, "count")
    assert repr(text[:40]) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidArgument)


def test_ranges_are_the_types_and_huge_text_is_cheap() -> None:
    assert parse_uint("4294967295", "x") == 2**32 - 1
    assert parse_uint("007", "x") == 7
    for text in ("4294967296", "9" * 23, "9" * 100_000):
        with pytest.raises(BadNumber, match="too large"):
            parse_uint(text, "x")
    with pytest.raises(BadNumber, match="below the minimum of 1"):
        parse_uint("0", "count", minimum=1)
    # (uid_t)-1 is nobody's uid.
    assert parse_uint("4294967294", "uid", UID_MAX) == 2**32 - 2
    with pytest.raises(BadNumber, match="too large"):
        parse_uint("4294967295", "uid", UID_MAX)
    assert parse_job_id("4711") == "4711"
    for text in ("4711\n", "4711 ", "\u0664\u0667", "1" * 21, ""):
        with pytest.raises(BadNumber, match="is not a Slurm job id"):
            parse_job_id(text)


# -- the Slurm epilog's environment (both --local and the daemon read it here) -------------

@pytest.mark.parametrize("uid", [ARABIC_ZERO, MATH_ZERO, FULLWIDTH_42, SUPERSCRIPT_TWO, "0 ", "4294967295"])
def test_epilog_refuses_a_loose_uid(uid: str) -> None:
    """"\\u0660" was read as uid 0: the epilog then ended root's holder on the job's GPU."""
    with pytest.raises(InvalidArgument, match="SLURM_JOB_UID"):
        epilog_job({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": uid, "SLURM_JOB_GPUS": "0"})


@pytest.mark.parametrize("gpus", [SUPERSCRIPT_TWO, ARABIC_ZERO, "0," + FULLWIDTH_42, "9" * 23])
def test_epilog_refuses_loose_gpus(gpus: str) -> None:
    with pytest.raises(InvalidArgument, match="SLURM_JOB_GPUS"):
        epilog_job({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": gpus})


def test_local_and_the_daemon_refuse_the_same_job_ids() -> None:
    """The job id "4711\\n" passed the epilog's check (`$` matches before a final
    newline) and so `--local`, while the daemon refused it. One rule for both: the request's."""
    for job in ("4711\n", "4711 ", "\u0664\u0667\u0661\u0661", "4711;x", "1" * 21):
        with pytest.raises(InvalidArgument, match="SLURM_JOB_ID"):
            epilog_job({"SLURM_JOB_ID": job, "SLURM_JOB_UID": "1000"})
        with pytest.raises(InvalidArgument, match="slurm_job"):
            check_request(SweepRequest(slurm_job=job, slurm_uid=1000))
    check_request(SweepRequest(slurm_job="4711", slurm_uid=1000))
    assert epilog_job({"SLURM_JOB_ID": "4711", "SLURM_JOB_UID": "1000"}).job_id == "4711"


# -- GPU selectors (the CLI's --gpu, the bus's `gpus` option, check) -----------------------

@pytest.mark.parametrize("text", [SUPERSCRIPT_TWO, ARABIC_ZERO, FULLWIDTH_42, "-1", "1\n2"])
def test_a_selector_of_loose_digits_names_no_gpu(text: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid GPU"):
        selector(text).check()


@pytest.mark.parametrize("text", ["4294967296", "1" * 23])
def test_a_selector_index_past_the_bus_range_is_an_error(text: str) -> None:
    with pytest.raises(InvalidArgument, match=r"GPU index .* too large"):
        selector(text)
    assert selector(" 3 ").index == 3 and selector(3).kind == INDEX


# -- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "needle"), [
    (["check", "--gpu", SUPERSCRIPT_TWO], "argument --gpu: invalid GPU"),
    (["check", "--gpu", "4294967296"], "argument --gpu: GPU index '4294967296' is too large"),
    (["holders", "--gpu", "1" * 23], "is too large"),
    (["sweep", "--gpu", ARABIC_ZERO], "argument --gpu: invalid GPU"),
    (["history", "-n", FULLWIDTH_42], "argument -n/--count: count"),
    (["history", "-n", "0"], "below the minimum of 1"),
    (["history", "-n", "9" * 30], "too large"),
])
def test_the_cli_refuses_loose_numbers_with_a_usage_error(argv: list[str], needle: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


# -- the configuration -----------------------------------------------------------------------

@pytest.mark.parametrize("value", [FULLWIDTH_42, ARABIC_ZERO, SUPERSCRIPT_TWO, "1_000", "+5"])
def test_config_numbers_are_ascii(tmp_path: Path, value: str) -> None:
    path = tmp_path / "n.conf"
    path.write_text(f"[Daemon]\nHistoryMax={value}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"n.conf:2: \[Daemon\] HistoryMax: .* is not a number"):
        load_config([str(path)])

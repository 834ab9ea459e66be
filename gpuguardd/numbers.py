"""Numbers read from outside, strictly: int() takes any Unicode digit (U+0660), a sign, underscores
and spaces, and str.isdigit() is True for U+00B2, which int() refuses. Here a number is ASCII digits
in range, or a BadNumber (an InvalidArgument and a ValueError, for every caller's handler).
"""

from __future__ import annotations

from gpuguardd.errors import InvalidArgument

UINT32_MAX = 2**32 - 1
UID_MAX = 2**32 - 2  # (uid_t)-1 is "no uid" to the kernel: never a user
# Slurm job ids are 32-bit; 20 digits leaves room for array and het job forms that arrive
# as one number, and no more: the id goes into a cgroup path match and a drain reason.
JOB_ID_DIGITS = 20

_SHOWN = 40  # what an error message quotes of a value: enough to recognise it


class BadNumber(InvalidArgument, ValueError):
    """A value that is not an ASCII decimal number in range; the message names it."""


def shown(text: str) -> str:
    """`text` as an error message quotes it: repr() (escapes controls), cut short."""
    return repr(text[:_SHOWN]) + ("..." if len(text) > _SHOWN else "")


def is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_uint(text: str, what: str, maximum: int = UINT32_MAX, minimum: int = 0) -> int:
    if not is_digits(text):
        raise BadNumber(f"{what} {shown(text)} is not a number (ASCII digits 0-9 only)")
    # Compare lengths first: int() of a huge digit string is slow (and refused past 4300).
    if len(text.lstrip("0")) > len(str(maximum)) or int(text) > maximum:
        raise BadNumber(f"{what} {shown(text)} is too large (at most {maximum})")
    value = int(text)
    if value < minimum:
        raise BadNumber(f"{what} {shown(text)} is below the minimum of {minimum}")
    return value


def parse_job_id(text: str, what: str = "Slurm job id") -> str:
    """One rule for the epilog's environment, `--local` and the daemon's `slurm_job` option."""
    if not is_digits(text) or len(text) > JOB_ID_DIGITS:
        raise BadNumber(f"{what} {shown(text)} is not a Slurm job id (1 to {JOB_ID_DIGITS} ASCII digits)")
    return text

"""gpuguardctl's exit statuses, for every verb: a report's outcome's, and a failure's."""

from __future__ import annotations

from gpuguardd.errors import ConfigError, GpuGuardError, InvalidArgument, NotAuthorized
from gpuguardd.records.enums import Outcome

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SURVIVORS = 3
EXIT_NOT_RELEASED = 4
EXIT_NOT_AUTHORIZED = 5
EXIT_UNVERIFIED = 6
EXIT_NOT_FREE = 7
EXIT_GATE_TIMEOUT = 8  # `wait`: the GPUs were not free by --timeout

OUTCOME_EXIT = {
    Outcome.FREED: EXIT_OK,
    Outcome.NOTHING: EXIT_OK,
    Outcome.DRY_RUN: EXIT_OK,
    Outcome.SURVIVORS: EXIT_SURVIVORS,
    Outcome.NOT_RELEASED: EXIT_NOT_RELEASED,
    Outcome.UNVERIFIED: EXIT_UNVERIFIED,
    Outcome.RESET: EXIT_OK,
    Outcome.RESET_REFUSED: EXIT_NOT_FREE,  # something holds the GPU
}


def outcome_exit(outcome: Outcome) -> int:
    return OUTCOME_EXIT.get(outcome, EXIT_ERROR)


def error_exit(exc: GpuGuardError) -> int:
    if isinstance(exc, (ConfigError, InvalidArgument)):
        return EXIT_USAGE
    if isinstance(exc, NotAuthorized):
        return EXIT_NOT_AUTHORIZED
    return EXIT_ERROR

"""Errors that end a run with one line and a chosen exit status, never a traceback."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2.

    The message says what is wrong and how to fix it.
    """

    exit_code = 2
    agreed = (
        True  # every rank reaches the same verdict, so rank 0 alone says it (False: the rank that met it)
    )


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: one line naming the file and why."""


class TrainingStopped(Exception):
    """Training cannot go on (non-finite loss, failed save, dead peer): one line, exit 1."""

    exit_code = 1
    agreed = True


# A distributed run that hung: the watchdog wrote <save-dir>/hang_report.txt (and, when it could, a checkpoint of
# the last completed step) and ended every rank it could reach with this status (docs/hangs.md, "When a run
# hangs"). Distinct from 1 (failed) and 2 (bad input), so launchers tell a hang apart and do not requeue blindly.
HANG_EXIT_STATUS = 3

"""Exception hierarchy and exit codes.

The CLI turns every :class:`GpufeedError` into one sentence on stderr (a traceback only with
``gpufeed --verbose``) and exits with the error's ``exit_code``:

- 2: a usage or input error found before the job started (bad option, missing shard, bad manifest);
- 1: the job started and then failed (:class:`RunError`), or it ran and a check failed (the record's ``ok``);
- 128 + N: a run stopped by signal N (:class:`Interrupted`: 143 for SIGTERM, 130 for SIGINT).
"""


class GpufeedError(Exception):
    """Base class: a usage or input problem the user can fix, found before work started (exit code 2). A
    password in a URL the message names is replaced by ``***`` (:func:`gpufeed.core.redact.redact`)."""

    exit_code = 2

    def __init__(self, *args: object) -> None:
        from gpufeed.core.redact import redact

        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(GpufeedError):
    """A bad option or configuration file."""


class DataError(GpufeedError):
    """Bad input data: a missing folder, an unreadable shard set, a refused plan."""


class RunError(GpufeedError):
    """A job that started and then failed (a corrupt shard met mid-run, a rank that died): exit code 1."""

    exit_code = 1


class Interrupted(RunError):
    """A run stopped by a signal (a scheduler's SIGTERM, a SIGINT): exit code 128 + the signal's number, as a
    shell reports a process killed by it (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal N`` for a number this platform does not name."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch re-raises worker errors with the worker traceback
    appended to the message; the cause is the first line)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

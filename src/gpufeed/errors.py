"""Exception hierarchy. The CLI turns every GpufeedError into a one-sentence message and exit code 2."""


class GpufeedError(Exception):
    """Base class: a usage or input problem the user can fix (exit code 2)."""

    exit_code = 2


class ConfigError(GpufeedError):
    """A bad option or configuration file."""


class DataError(GpufeedError):
    """Bad input data: a missing folder, an unreadable shard set, a refused plan."""

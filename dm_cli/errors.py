"""The errors a user can cause, each with the exit code docs/CONTRACTS.md gives it.

The CLI turns a DmapError into one sentence on stderr; anything else is a bug (exit 1).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3


class DmapError(Exception):
    """Base: an error the user can act on. `str(error)` is the sentence shown."""

    exit_code = EXIT_USAGE


class UsageError(DmapError):
    """Bad option or value (unparsable size, unknown dtype, bad device spec)."""


class SourceError(DmapError):
    """SOURCE cannot be resolved or its configs are missing or malformed."""


class CheckpointError(DmapError):
    """A weight file or index is corrupt, truncated or inconsistent."""


class DoesNotFitError(DmapError):
    """The plan cannot be satisfied on the devices given."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}

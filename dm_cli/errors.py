"""The errors a user can cause, each with the exit code docs/CONTRACTS.md gives it.

The CLI turns a DmapError into one sentence on stderr; anything else is a bug (exit 1).
"""

from __future__ import annotations

import errno
import os

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


class DiskFullError(DmapError):
    """The disk (or the user's quota) filled up while dmap wrote: what was being written is gone, nothing
    half-written is left as complete, and the same command goes on once there is room (exit 2; 507 from
    `dmap serve`)."""

    http_status = 507

    @classmethod
    def of(cls, error: BaseException | None) -> "DiskFullError | None":
        """`error` as a DiskFullError when its chain says the disk or the quota is full (`disk_full`), else None:
        where no writer of dmap's said it in its own words (a library, a thread), what the system said, and the file
        when it is known."""
        if isinstance(error, DiskFullError):
            return error
        found = disk_full(error)
        if found is None:
            return None
        quota = getattr(found, "errno", None) == errno.EDQUOT or "quota" in str(found).lower()
        where = getattr(found, "filename", None)
        where = f" while writing {where}" if where else ""
        return cls(f"{'Your disk quota is full' if quota else 'The disk is full'}{where}: nothing was left "
                   "half-written (outputs are renamed into place only when complete); make room and run the same "
                   "command again.")


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# how libraries that do not raise OSError say it (safetensors' SafetensorError carries only Rust's text)
DISK_FULL_TEXTS = tuple(dict.fromkeys(("No space left on device", "Disk quota exceeded",
                                       os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))))


def disk_full(error: BaseException | None) -> BaseException | None:
    """The exception in `error`'s chain (itself, its cause, its context) that says the disk or the quota is full:
    by its errno (ENOSPC, EDQUOT) where it has one, by its text otherwise; None when none does."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "errno", None)
        if code in DISK_FULL_ERRNOS or (not isinstance(code, int) and any(t in str(error) for t in DISK_FULL_TEXTS)):
            return error
        error = error.__cause__ or error.__context__
    return None

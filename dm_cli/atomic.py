"""Write a file so that nothing half-written is ever where the result belongs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`; it is renamed over `path` only when complete.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def refuse_existing(paths, overwrite: bool) -> None:
    """dmap's one overwrite policy (run, shard and plan): an existing output is replaced only with --overwrite.

    Checked before any work starts, so a refusal costs nothing.
    """
    from .errors import UsageError

    if overwrite:
        return
    for path in paths:
        if Path(path).exists():
            raise UsageError(f"The output {path} already exists: choose another --output or add --overwrite.")

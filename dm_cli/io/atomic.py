"""Write a file so that nothing half-written is ever where the result belongs."""

from __future__ import annotations

import os
import re
import stat
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
    """dmap's one overwrite policy (run, shard and plan): an existing output is replaced only with --overwrite,
    and only if it is something dmap could have written: a regular file, or a folder of weights or frames.
    A device node, FIFO, link or anybody's folder is never replaced (as root, `-o /dev/full` would be).

    Checked before any work starts, so a refusal costs nothing.
    """
    from dm_cli.errors import UsageError

    for path in map(Path, paths):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as error:
            raise UsageError(f"Cannot check the output {path}: {error.strerror or error}.") from None
        if not overwrite:
            raise UsageError(f"The output {path} already exists: choose another --output or add --overwrite.")
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode) and _written_by_dmap(path):
            continue
        what = "a folder dmap did not write" if stat.S_ISDIR(mode) else \
            "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file (a device or a FIFO?)"
        raise UsageError(f"The output {path} is {what}: --overwrite replaces only files and folders dmap writes; "
                         "choose another --output.")


_DMAP_FOLDER_FILES = re.compile(r"model_index\.json|config\.json|.+\.safetensors(\.index(\.\w+)?\.json)?")
_FRAMES_FOLDER_FILES = re.compile(r"frame-[0-9]+\.png|metadata\.json|.+\.wav")


def _written_by_dmap(folder: Path) -> bool:
    """An empty folder, a model folder (dmap shard's output) or a frames folder (dmap run's video frames)."""
    try:
        names = [entry.name for entry in os.scandir(folder)]
    except OSError:
        return False
    if not names or any(_DMAP_FOLDER_FILES.fullmatch(name) for name in names):
        return True
    return all(_FRAMES_FOLDER_FILES.fullmatch(name) for name in names)

"""Write a file so that nothing half-written is ever where the result belongs."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

from dm_cli.errors import DiskFullError, DmapError, UsageError, disk_full
from dm_cli.units import format_size


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], needed: int | None = None) -> None:
    """`write(tmp)` fills a temporary file beside `path`; it is renamed over `path` only when complete.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600. A full disk (or quota),
    however the writer says it, is a DiskFullError naming the file, the `needed` bytes when known and the room
    left, after the temporary file is removed.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        if disk_full(error):
            raise disk_full_error(path, needed, error) from error
        raise
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if not isinstance(error, DmapError) and disk_full(error):
            raise disk_full_error(path, needed, error) from error
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` as the file `path`, atomically (`atomic_write`): a full disk says how much it needed."""

    def write(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
        try:
            view = memoryview(data).cast("B")
            while view:  # os.write may write less than asked (a disk filling up): the rest, or ENOSPC
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    atomic_write(path, write, needed=len(data))


def disk_full_error(path: str | os.PathLike, needed: int | None = None, cause: BaseException | None = None) -> DiskFullError:
    """One sentence for a write of `path` that found no room (`cause`: what said so): what it needed (when known),
    where, what is free."""
    found = disk_full(cause)
    quota = found is not None and (getattr(found, "errno", None) == errno.EDQUOT or "quota" in str(found).lower())
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        free = f"{format_size(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "no room left"
    full = "Your disk quota is full" if quota else "The disk is full"
    need = f"{path} needs {format_size(needed)} in {folder}, which has {free}" if needed is not None else \
        f"writing {path} found {folder} with {free}"
    return DiskFullError(f"{full}: {need}; nothing was left half-written: make room and run the same command again.")


def check_writable_file(path: Path, option: str, example: str) -> None:
    """An output file's path checked before any work (UsageError, one sentence): not a folder nor anything but a
    regular file, in a folder that exists and takes files. `example`: a file name the refusal suggests."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: give a file name such as {path / example}.")
    if path.exists() and not path.is_file():
        raise UsageError(f"{option} {path} exists and is not a regular file.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"Cannot write {option} {path}: folder {parent} does not exist.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"Cannot write {option} {path}: folder {parent} is not writable.")


def refuse_existing(paths, overwrite: bool) -> None:
    """dmap's one overwrite policy (run, shard and plan): an existing output is replaced only with --overwrite,
    and only if it is something dmap could have written: a regular file, or a folder of weights or frames.
    A device node, FIFO, link or anybody's folder is never replaced (as root, `-o /dev/full` would be).

    Checked before any work starts, so a refusal costs nothing.
    """
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

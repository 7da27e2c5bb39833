"""One run at a time per output: a run claims what it will write when it starts, and a second run that
would write the same output stops (exit 2) naming the first, instead of silently replacing its result.

A claim is a small file beside the output (a file, or a folder: a queue's), `.NAME.dmap-claim`, holding the
claiming process's pid, host, command and start time, and locked with `flock` for as long as the run lasts. The lock is the claim: the kernel drops it when the process ends, however it ends (SIGTERM,
SIGKILL, a crash), so a claim file whose lock nobody holds is stale and the next run takes it over. A run
releases its claims (unlocks and removes the files) on every exit Python sees: success, error, Ctrl-C.
Where the file system has no `flock`, the pid is checked instead: a claim of a dead process on this host is
stale.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import DiskFullError, UsageError, disk_full
from dm_cli.io.strict_json import json_text

CLAIM_SUFFIX = ".dmap-claim"
_HOLDER_BYTES = 4096  # a claim file is a line of JSON: anything longer is not dmap's
_WAIT_FOR_HOLDER_S = 1.0  # a claimer writes its line right after locking: wait this long to name it


def claim_path(output: str | os.PathLike) -> Path:
    """The claim file of an output (a file or a folder): beside it, hidden."""
    output = Path(output)
    return output.parent / f".{output.name}{CLAIM_SUFFIX}"


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as its file says."""

    pid: int
    host: str
    started: float
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.command} (pid {self.pid} on {self.host}, started {when})"

    def alive(self) -> bool:
        """On this host, whether the pid is a live process (another host's: assumed alive)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's live process
        except OSError:
            return False
        return True


class Claims:
    """The claims a run holds; `release()` (or leaving the `with` block) gives them all back."""

    def __init__(self) -> None:
        self._held: list[tuple[Path, int]] = []

    @property
    def paths(self) -> list[Path]:
        return [path for path, _ in self._held]

    def release(self) -> None:
        """Remove each claim file (if it is still ours), then unlock it by closing it: in that order, so that a run
        that opened the file meanwhile sees, once it gets the lock, that the name is no longer that file."""
        while self._held:
            _give_back(*self._held.pop())

    def __enter__(self) -> "Claims":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def take(self, claim: Path, label: str, command: str) -> bool:
        """Claim `claim` for `label` ("the output x.png"); False when no claim can be made there (no such folder,
        no permission: the write itself says why later, in its own words). A live claim of another run is a
        UsageError naming it; a full disk a DiskFullError."""
        try:
            import fcntl  # lazy: fcntl is POSIX only
        except ImportError:  # no flock on this platform: no claims
            return False
        for _ in range(20):  # a run releasing its claim between our open and our lock: open the new file
            fd = _open_claim(claim, label)
            if fd is None:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _wait_for_holder(fd)
                os.close(fd)
                raise UsageError(_refusal(label, holder, claim)) from None
            except OSError:  # no flock on this file system (ENOLCK, EOPNOTSUPP): the pid says whether it is alive
                holder = _read_holder(fd)
                if holder is not None and holder.alive() and not _is_this_process(holder):
                    os.close(fd)
                    raise UsageError(_refusal(label, holder, claim, locked=False)) from None
            if not _same_file(fd, claim):  # released (removed) while we waited for the lock: try again
                os.close(fd)
                continue
            try:
                line = json_text({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                  "command": command}) + "\n"
                os.ftruncate(fd, 0)
                os.pwrite(fd, line.encode(), 0)
            except OSError as error:
                _give_back(claim, fd)
                if disk_full(error):
                    raise _full(claim) from error
                return False
            self._held.append((claim, fd))
            return True
        return False


def claim_outputs(outputs, command: str) -> Claims:
    """Claim every output (files or folders) a run will write, before it does any work; see the module's doc.
    An output that is there and is neither a file nor a folder (a device, a FIFO) is not claimed: the
    overwrite policy refuses it (dm_cli.io.atomic.refuse_existing)."""
    claims = Claims()
    try:
        for output in outputs:
            output = Path(output)
            if not output.name or output.name in (".", ".."):
                continue
            try:
                mode = os.lstat(output).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    continue
            except OSError:
                pass
            claims.take(claim_path(output), f"the output {output}", command)
    except BaseException:
        claims.release()
        raise
    return claims


def claim_folder(folder: str | os.PathLike, command: str) -> Claims:
    """Claim a whole output folder (a queue's: its items and its manifest), beside it as any output."""
    folder = Path(folder)
    target = folder if folder.name not in ("", ".", "..") else folder.resolve()
    claims = Claims()
    claims.take(claim_path(target), f"the output folder {folder}", command)
    return claims


# --- the claim file ----------------------------------------------------------------------------------------


def _open_claim(claim: Path, label: str) -> int | None:
    """The claim file opened for writing (created if absent), never through a link; None where it cannot be made."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(claim, flags, 0o644)
    except OSError as error:
        if disk_full(error):
            raise _full(claim) from error
        if error.errno == errno.ELOOP or os.path.islink(claim):
            raise UsageError(f"{claim} is a symbolic link, not dmap's claim on {label}: "
                             "remove it and run again.") from None
        if error.errno == errno.EISDIR:
            raise UsageError(f"{claim} is a folder, not dmap's claim on {label}: remove it and run again.") \
                from None
        if error.errno in (errno.EACCES, errno.EPERM):  # another user's claim file: is it held?
            return _readable_claim(claim, label)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{claim} is not a regular file, not dmap's claim on {label}: remove it and run "
                         "again.")
    return fd


def _readable_claim(claim: Path, label: str) -> int | None:
    """Another user's claim file: held, it is refused by the caller's lock; not held, it is stale and removed."""
    import fcntl  # POSIX only: reached only where take() could import it

    try:
        fd = os.open(claim, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _wait_for_holder(fd)
        os.close(fd)
        raise UsageError(_refusal(label, holder, claim)) from None
    except OSError:
        pass
    os.close(fd)
    try:
        os.unlink(claim)  # stale: the folder is ours to write in, or the output could not be written either
    except OSError:
        return None
    try:
        return os.open(claim, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return None


def _give_back(path: Path, fd: int) -> None:
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int) -> Holder | None:
    try:
        data = json.loads(os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8"))
        return Holder(int(data["pid"]), str(data["host"]), float(data["started"]), str(data["command"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_for_holder(fd: int) -> Holder | None:
    """The holder of a locked claim: it writes its line right after it locks, so an empty file is read again."""
    deadline = time.monotonic() + _WAIT_FOR_HOLDER_S
    while True:
        holder = _read_holder(fd)
        if holder is not None or time.monotonic() > deadline:
            return holder
        time.sleep(0.02)


def _is_this_process(holder: Holder) -> bool:
    return holder.pid == os.getpid() and holder.host == socket.gethostname()


def _refusal(label: str, holder: Holder | None, claim: Path, locked: bool = True) -> str:
    who = f"another {holder.describe()}" if holder is not None else "another dmap process (its claim does not say which)"
    gone = "" if locked else f" (if that run is gone, remove {claim})"
    return f"{label[:1].upper()}{label[1:]} is being written by {who}: wait for it to finish, or choose another --output{gone}."


def _full(claim: Path) -> DiskFullError:
    folder = claim.parent if str(claim.parent) else Path(".")
    return DiskFullError(f"The disk holding {folder} is full: dmap cannot even claim its output there, and nothing was "
                         "written; make room and run the same command again.")

"""Putting a finished, verified output where it belongs without ever losing data.

Three moves, each recoverable at every instant (a kill between any two renames included):

- `publish`: a temporary folder becomes the output. Without `overwrite` the name is claimed
  atomically (`renameat2(RENAME_NOREPLACE)`, else an empty-folder claim), so a folder that appeared
  at the output name meanwhile, or a concurrent run's result, is never removed. With `overwrite`
  the two folders are exchanged atomically (`RENAME_EXCHANGE`) where the file system can.
- `swap_in_place`: weight files of the source are replaced. A journal (the list of old and new
  files per folder) is written into the temporary folder, which is then renamed to a
  `.NAME.dmap-swap-PID-*` folder: from that instant the swap is committed. Old files are moved
  into it first, then the new ones out of it (each index last), then it is removed.
- `recover`: run before the next write beside the same output. It finishes a committed swap whose
  process is gone (the new files were verified before the commit), restores an output whose
  `--overwrite` exchange was cut in half, and removes temporary folders of killed runs.

Every rename goes through `_rename`, which tests replace to kill the process at each step.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import CheckpointError, DmapError
from dm_cli.io.checkpoint import is_plain_file_name, read_json_object
from dm_cli.io.strict_json import json_text

TEMP_MARK = ".dmap-tmp-"
REPLACED_MARK = ".dmap-replaced-"  # the previous output during an --overwrite without RENAME_EXCHANGE
SWAP_MARK = ".dmap-swap-"
OLD_MARK = ".dmap-old-"  # left by dmap before 0.2's journaled swap: old weights, never removed by dmap
MARKS = (TEMP_MARK, REPLACED_MARK, SWAP_MARK, OLD_MARK)
JOURNAL = "dmap-swap.json"
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2_state = {"fn": None, "looked": False}


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False when the C library or the file system does not offer `flags`."""
    if not _renameat2_state["looked"]:
        _renameat2_state["looked"] = True
        try:
            _renameat2_state["fn"] = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
        except OSError:
            _renameat2_state["fn"] = None
    fn = _renameat2_state["fn"]
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def _rename(src: Path, dst: Path, flags: int = 0) -> bool:
    """The one rename primitive (tests inject kills here). False: `flags` unsupported, nothing done."""
    if flags:
        return _renameat2(src, dst, flags)
    os.rename(src, dst)
    return True


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hidden_name(out: Path, mark: str) -> Path:
    """A hidden sibling of `out` tagged with this process: `.NAME<mark>PID-RANDOM`."""
    return out.parent / f".{out.name}{mark}{os.getpid()}-{secrets.token_hex(4)}"


class OutputTakenError(DmapError):
    """The output name was taken by something else while dmap worked: nothing was replaced."""


def publish(temp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder `temp` to `out`; replace an existing `out` only with `overwrite`."""
    if overwrite and out.exists():
        if not _rename(temp, out, RENAME_EXCHANGE):
            old = hidden_name(out, REPLACED_MARK)
            _rename(out, old)  # a kill from here to the next rename is repaired by `recover`
            _rename(temp, out)
            temp = old
        shutil.rmtree(temp, ignore_errors=True)  # after an exchange `temp` holds the old output
    else:
        _claim(temp, out)
    fsync_dir(out.parent)


def _claim(temp: Path, out: Path) -> None:
    taken = OutputTakenError(f"{out} appeared while dmap was writing it (another run, or another program): "
                             "it was left as it is and nothing was written there; choose another --output "
                             "or add --overwrite to replace it.")
    try:
        if _rename(temp, out, RENAME_NOREPLACE):
            return
        os.mkdir(out)  # no renameat2 here: claim the name with an empty folder, then replace our own claim
    except FileExistsError:
        raise taken from None
    try:
        _rename(temp, out)
    except OSError:
        try:
            os.rmdir(out)  # ours, still empty; something put files into it: leave it
        except OSError:
            pass
        raise taken from None


# --- in place -------------------------------------------------------------------------------------


@dataclass
class SwapFolder:
    """One folder whose files `old` are replaced by `new` (found under `new_dir` in the swap folder)."""

    folder: Path
    new_dir: str  # relative to the swap folder
    old: list[str]
    new: list[str]  # in placing order: each index file last


def swap_in_place(temp: Path, root: Path, folders: list[SwapFolder]) -> None:
    """Replace files of `root`'s folders by the verified ones in `temp` (see the module docstring)."""
    journal = {"format": "dmap-swap", "version": 1, "root": str(root),
               "folders": [{"folder": str(f.folder), "new_dir": f.new_dir, "old": f.old, "new": f.new} for f in folders]}
    path = temp / JOURNAL
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json_text(journal))
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(temp)
    swap = hidden_name(root, SWAP_MARK)
    _rename(temp, swap)  # the commit point
    fsync_dir(swap.parent)
    try:
        _roll_forward(swap, journal)
    except BaseException as error:
        if isinstance(error, OSError):
            raise DmapError(
                f"Replacing the weights of {root} stopped half-way ({error.strerror or error}). The new files are "
                f"verified and the old ones are kept in {swap}; run the same dmap shard command again to finish."
            ) from error
        raise
    _discard(swap)


def _old_dir(swap: Path, index: int) -> Path:
    return swap / f".old-{index}"


def _roll_forward(swap: Path, journal: dict) -> None:
    """Move old files aside, then new files in; every step is skipped if it was already done."""
    folders = journal["folders"]
    for index, entry in enumerate(folders):
        folder, new_dir = Path(entry["folder"]), swap / entry["new_dir"]
        aside = _old_dir(swap, index)
        aside.mkdir(exist_ok=True)
        for name in entry["old"]:
            original, backup = folder / name, aside / name
            # Before any new file is placed every old file is moved aside, so a name both old and
            # new that is still in the folder is old exactly when its new file is not placed yet.
            still_old = name not in entry["new"] or (new_dir / name).exists()
            if not backup.exists() and original.exists() and still_old:
                _rename(original, backup)
        fsync_dir(folder)
    for index, entry in enumerate(folders):
        folder, new_dir = Path(entry["folder"]), swap / entry["new_dir"]
        for name in entry["new"]:
            source, target = new_dir / name, folder / name
            if not source.exists():
                continue  # placed already
            if target.exists():
                raise DmapError(f"{target} exists and is not one of the files being replaced; the new files are in "
                                f"{new_dir} and the old ones in {_old_dir(swap, index)}: move {target} away and run "
                                "the same dmap shard command again.")
            _rename(source, target)
        fsync_dir(folder)


def _discard(folder: Path) -> None:
    """Remove a finished swap or a dead temporary folder: renamed to a temp mark first, so that a
    kill during the removal leaves a folder `recover` deletes, never a half-deleted journal."""
    dead = hidden_name(folder.parent / folder.name.split(".dmap-")[0][1:], TEMP_MARK)  # `.NAME.dmap-…` -> NAME
    try:
        _rename(folder, dead)
    except OSError:
        dead = folder
    shutil.rmtree(dead, ignore_errors=True)


# --- recovery -------------------------------------------------------------------------------------
#
# Everything here reads folders that may have been shipped beside a model by someone else, so it acts
# only on what this module could have written: a real folder (never a link) named by `hidden_name`
# for a PID a process could have had and that is gone; a swap only for `dmap shard --in-place` of that
# very source, with a journal naming that source's own folders and weight-file names, and a swap folder
# holding exactly the files the journal lists. Anything else is left untouched (or refused, exit 2).

_PID_MAX = 2**22  # above Linux's largest pid_max: a larger "PID" was never written by hidden_name
_NAME_RE = re.compile(r"(" + "|".join(map(re.escape, MARKS)) + r")([0-9]{1,19})-[0-9A-Za-z]+", re.ASCII)
_OLD_WEIGHT_RE = re.compile(r".+(?:\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.index(?:\.\w+)?\.json)", re.ASCII)
_NEW_WEIGHT_RE = re.compile(r".+(?:\.safetensors|\.safetensors\.index(?:\.\w+)?\.json)", re.ASCII)


def _abandoned(out: Path) -> list[tuple[str, Path]]:
    """(mark, folder) for each real folder `.NAME<mark>PID-*` beside `out` whose dmap process is gone, in name order."""
    prefix = f".{out.name}"
    try:
        entries = sorted(entry for entry in out.parent.iterdir() if entry.name.startswith(prefix))
    except OSError:
        return []
    found = []
    for candidate in entries:
        match = _NAME_RE.fullmatch(candidate.name[len(prefix):])
        if match is None:
            continue
        mark, pid = match.group(1), int(match.group(2))
        if not 0 < pid < (2**63 if mark == OLD_MARK else _PID_MAX) or _pid_alive(pid):
            continue  # no dmap process had that PID (the old design's backups are only pointed at)
        if candidate.is_dir() and not candidate.is_symlink():
            found.append((mark, candidate))
    return found


def recover(out: Path, overwrite: bool) -> list[str]:
    """Before writing `out`: remove temporary folders of killed runs and settle an `--overwrite` cut in
    half (the old output is put back only by a run that may replace `out` itself). One sentence per thing."""
    done: list[str] = []
    for mark, candidate in _abandoned(out):
        if mark == OLD_MARK:
            done.append(f"Note: {candidate} holds weights an earlier dmap moved aside during an interrupted --in-place "
                        "run; check them and remove the folder yourself.")
        elif mark == REPLACED_MARK:
            if not overwrite:
                done.append(f"Note: {candidate} looks like the previous {out.name} of an interrupted --overwrite run; "
                            "it was left as it is: rename it back or remove it yourself.")
            elif os.path.lexists(out):
                _discard(candidate)
                done.append(f"Removed the replaced output of an interrupted --overwrite run: {candidate}")
            else:
                _rename(candidate, out)
                done.append(f"Restored {out} from an interrupted --overwrite run (it was in {candidate})")
        elif mark == TEMP_MARK:
            shutil.rmtree(candidate, ignore_errors=True)
            done.append(f"Removed a leftover temporary folder of an interrupted run: {candidate}")
    return done


def pending_swap(root: Path) -> Path | None:
    """A swap folder of `root` whose process is gone: readers refuse the source until `--in-place` settles it."""
    return next((candidate for mark, candidate in _abandoned(root) if mark == SWAP_MARK), None)


def finish_swaps(root: Path) -> list[str]:
    """`dmap shard --in-place ROOT`: finish the committed swaps of ROOT that a killed run left (see above)."""
    return [_finish_swap(candidate, root) for mark, candidate in _abandoned(root) if mark == SWAP_MARK]


def _finish_swap(swap: Path, root: Path) -> str:
    try:
        journal = _checked_journal(swap, root)
    except (CheckpointError, ValueError) as error:
        raise DmapError(f"{swap} is not an interrupted in-place swap of {root} that dmap can finish ({error}); "
                        "nothing was changed: if an earlier dmap shard --in-place was killed, its old weights are "
                        "in the .old-* folders there; restore them by hand and remove the folder.") from None
    _roll_forward(swap, journal)
    _discard(swap)
    return f"Finished an interrupted --in-place swap of {root} (its new files had been verified)"


def _checked_journal(swap: Path, root: Path) -> dict:
    """The journal, if it is one `swap_in_place` for `root` could have written; else ValueError saying why."""
    journal = read_json_object(swap / JOURNAL, "swap journal")
    if set(journal) != {"format", "version", "root", "folders"} or journal["format"] != "dmap-swap" \
            or journal["version"] != 1:
        raise ValueError("not a dmap swap journal")
    if journal["root"] != str(root):
        raise ValueError(f"its journal is about {_shown(journal['root'])}, not {root}")
    folders = journal["folders"]
    if not isinstance(folders, list) or not folders:
        raise ValueError("its journal lists no folders")
    expected: dict[str, str] = {JOURNAL: "file"}  # what the swap folder may hold, relative path -> kind
    seen_folders: set[str] = set()
    for index, entry in enumerate(folders):
        if not isinstance(entry, dict) or set(entry) != {"folder", "new_dir", "old", "new"}:
            raise ValueError("a journal entry is not a swap folder")
        folder, new_dir, old, new = entry["folder"], entry["new_dir"], entry["old"], entry["new"]
        if not isinstance(folder, str) or not isinstance(new_dir, str) or folder in seen_folders:
            raise ValueError("a journal entry names its folder twice or not as text")
        seen_folders.add(folder)
        if Path(folder) != root and Path(folder) != root / new_dir or new_dir and not _is_plain(new_dir):
            raise ValueError(f"it names {_shown(folder)}, which is not {root} or one of its component folders")
        if os.path.realpath(folder) != folder or not Path(folder).is_dir():
            raise ValueError(f"{_shown(folder)} is a link or not a folder")
        for names, pattern in ((old, _OLD_WEIGHT_RE), (new, _NEW_WEIGHT_RE)):
            if not isinstance(names, list) or len(set(map(str, names))) != len(names) or not all(
                    isinstance(n, str) and _is_plain(n) and pattern.fullmatch(n) for n in names):
                raise ValueError("its journal names a file that is not a weight file of that folder")
        aside = _old_dir(swap, index).name
        expected[aside] = "dir"
        expected.update({f"{aside}/{name}": "file" for name in old})
        if new_dir:
            if expected.setdefault(new_dir, "dir") != "dir":
                raise ValueError("its journal names a folder twice")
        expected.update({f"{new_dir}/{name}" if new_dir else name: "file" for name in new})
    for relative, kind in _contents(swap).items():
        if expected.get(relative) != kind:
            raise ValueError(f"it holds {_shown(relative)}, which its journal does not list")
    return journal


def _is_plain(name: str) -> bool:
    return is_plain_file_name(name) and name != JOURNAL and not name.startswith(".old-")


def _contents(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (links never followed): relative path -> 'file', 'dir' or 'other'."""
    found: dict[str, str] = {}
    for current, dirs, files in os.walk(folder, onerror=_raise):
        base = Path(current).relative_to(folder)
        for name in [*dirs, *files]:
            path = Path(current) / name
            kind = "dir" if path.is_dir() and not path.is_symlink() else \
                "file" if path.is_file() and not path.is_symlink() else "other"
            found[str(base / name) if str(base) != "." else name] = kind
        dirs[:] = [d for d in dirs if found[str(base / d) if str(base) != "." else d] == "dir"]
    return found


def _raise(error: OSError) -> None:
    raise ValueError(f"it cannot be read: {error.strerror or error}")


def _shown(value: object) -> str:
    return ascii(value)[:200]


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True

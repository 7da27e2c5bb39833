"""One shard file written: its header, then its tensors in data order, byte copies as runs of consecutive source
ranges, converted and legacy tensors one at a time in RAM; and the files carried over unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from dm_cli.errors import CheckpointError
from dm_cli.model.sharding.copying import copy_buffer, copy_range, write_all
from dm_cli.model.sharding.layout import PlannedTensor, Progress, ShardFile
from dm_cli.model.sharding.verification import ShardFinisher


def copy_files(copies: list[tuple[Path, str]], temp: Path, progress: Progress) -> None:
    for path, rel in copies:
        target = temp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        shutil.copymode(path, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        progress.advance(target.stat().st_size)


def _tensor_bytes(t: PlannedTensor, legacy: dict[Path, dict]):
    """The output bytes of a tensor that is converted or comes from a legacy file (one tensor in RAM)."""
    # torch: imported on use, so start-up stays free of torch
    import torch

    if t.source.legacy:
        tensor = legacy[t.source.file][t.name]
    else:
        with open(t.source.file, "rb") as handle:
            handle.seek(t.source.begin)
            raw = bytearray(handle.read(t.source.end - t.source.begin))
        if len(raw) != t.source.end - t.source.begin:
            raise CheckpointError(f"{t.source.file} ended before tensor '{t.name}': it changed while dmap read it.")
        tensor = torch.frombuffer(raw, dtype=getattr(torch, t.source.dtype)) if raw else torch.empty(
            0, dtype=getattr(torch, t.source.dtype))
        tensor = tensor.reshape(t.shape)
    tensor = tensor.to(getattr(torch, t.dtype)).contiguous()
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().data


def _runs(tensors: list[PlannedTensor]) -> list[list[PlannedTensor]]:
    """Consecutive byte copies that are also consecutive in the same source file: one copy and one
    comparison each, instead of one system call and one job per (possibly tiny) tensor."""
    runs: list[list[PlannedTensor]] = []
    for t in tensors:
        last = runs[-1][-1] if runs else None
        if (last is not None and t.byte_copy and last.byte_copy and t.source.file == last.source.file
                and t.source.begin == last.source.end):
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def write_shard(path: Path, shard_file: ShardFile, legacy: dict[Path, dict], progress: Progress,
                 finisher: ShardFinisher) -> None:
    buffer = None  # only copies that cannot stay in the kernel need one (8 MB of RSS and page faults)
    sources: dict[Path, int] = {}
    # verified byte copies are read back as they are written: the file is opened for reading too
    fd = os.open(path, (os.O_RDWR if finisher.verify else os.O_WRONLY) | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, shard_file.header)
        at = len(shard_file.header)
        for run in _runs(shard_file.tensors):
            finisher.raise_if_failed()
            first = run[0]
            count = sum(t.nbytes for t in run)
            if first.byte_copy:
                src = sources.get(first.source.file)
                if src is None:
                    src = sources[first.source.file] = os.open(first.source.file, os.O_RDONLY)
                if finisher.verify:
                    wrong = copy_range(src, fd, first.source.begin, count, None, progress, verify_at=at)
                    if wrong is not None:
                        raise CheckpointError(f"Verification failed: tensor '{_tensor_at(run, wrong).name}' in "
                                              f"{path.name} differs from the source.")
                    finisher.verified(count)
                else:
                    buffer = copy_buffer(buffer)
                    copy_range(src, fd, first.source.begin, count, buffer, progress)
            else:
                data = _tensor_bytes(first, legacy)
                if len(data) != first.nbytes:
                    raise CheckpointError(f"Tensor '{first.name}' converted to {len(data)} bytes, expected {first.nbytes}.")
                if finisher.verify:
                    finisher.expected[(path, first.name)] = hashlib.sha256(data).digest()
                write_all(fd, data)
                progress.advance(first.nbytes)
                finisher.check_run(path, at, run)
            at += count
    except BaseException:
        os.close(fd)
        raise
    finally:
        for src in sources.values():
            os.close(src)
    finisher.shard_written(fd, path, shard_file)


def _tensor_at(run: list[PlannedTensor], offset: int) -> PlannedTensor:
    """The tensor of a run (tensors back to back) that holds byte `offset` of it."""
    for t in run:
        if offset < t.nbytes:
            return t
        offset -= t.nbytes
    return run[-1]

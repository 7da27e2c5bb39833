"""Shards checked after they are written: each header parsed back, converted tensors hashed back on background
threads while the next tensors are written (`ShardFinisher`), the index compared with the tensors written. Byte
copies are checked as they are written (`copying._copy_verified`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dm_cli.errors import CheckpointError
from dm_cli.io.checkpoint import read_safetensors_header
from dm_cli.model.sharding.layout import ComponentPlan, PlannedTensor, Progress, ShardFile

HASH_CHUNK = 1 << 20  # read size when hashing converted tensors back
VERIFY_THREADS = 2  # threads hashing converted tensors back beside the writing thread (sha256 releases the GIL)
VERIFY_BATCH_BYTES = 16 << 20  # tensors per verification job: a few MB, or
VERIFY_BATCH_RUNS = 4096  # this many separate ranges (a million tiny tensors: a few hundred jobs)


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardFinisher:
    """Fsyncs and verifies in the background while the main thread copies the next tensors.

    One thread fsyncs each finished shard, so disk flushes overlap copying. Byte copies are verified
    by the writer itself as they are written (`_copy_verified`); with verification, `VERIFY_THREADS`
    threads hash each converted tensor back as soon as it is written, while it is still in the page
    cache (file reads and sha256 release the GIL, so they run beside the writing). The first failure
    stops the writing (`raise_if_failed`).
    """

    def __init__(self, verify: bool, progress: Progress):
        self.verify = verify
        self.expected: dict[tuple[Path, str], bytes] = {}  # sha256 of converted tensors, as written
        self._progress = progress
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmap-fsync")
        self._checker = ThreadPoolExecutor(max_workers=VERIFY_THREADS, thread_name_prefix="dmap-verify") if verify else None
        self._futures = []  # fsync jobs (one per shard)
        self._checks = []  # verification jobs still running
        self._batch: list[tuple[Path, int, list[PlannedTensor]]] = []
        self._batch_bytes = 0
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._checked = 0  # bytes verified so far
        self._reporting = False  # whether verified bytes go to the progress bar yet

    def verified(self, nbytes: int) -> None:
        """Bytes the writer verified itself (byte copies, compared as they are written)."""
        with self._lock:
            self._checked += nbytes

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def check_run(self, path: Path, begin: int, run: list[PlannedTensor]) -> None:
        """Queue the comparison of tensors just written back to back at `begin` in `path`.

        Runs are batched (`VERIFY_BATCH_BYTES`, `VERIFY_BATCH_RUNS`) so that a million tiny tensors
        make a few hundred jobs, not a million futures."""
        self.raise_if_failed()
        if self._checker is None:
            return
        self._batch.append((path, begin, run))
        self._batch_bytes += sum(t.nbytes for t in run)
        if self._batch_bytes >= VERIFY_BATCH_BYTES or len(self._batch) >= VERIFY_BATCH_RUNS:
            self.flush()

    def flush(self) -> None:
        """Submit the pending batch (at the end of each shard, and when it is full)."""
        if self._checker is None or not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._checks = [f for f in self._checks if not f.done()]  # failures are kept in `_failure`
        self._checks.append(self._checker.submit(self._check, batch))

    def _check(self, batch: list[tuple[Path, int, list[PlannedTensor]]]) -> None:
        for path, begin, run in batch:
            if self._failure is not None:
                return
            try:
                _check_run(path, begin, run, self.expected)
            except BaseException as error:
                self._failure = self._failure or error
                raise
            nbytes = sum(t.nbytes for t in run)
            with self._lock:
                self._checked += nbytes
                reporting = self._reporting
            if reporting:
                self._progress.advance(nbytes)

    def shard_written(self, fd: int, path: Path, shard_file: ShardFile) -> None:
        """Check the header that was written (cheap, here), then fsync and close `fd` in the background."""
        self.flush()
        try:
            if self.verify:
                _check_header(path, shard_file)
        except BaseException:
            os.close(fd)
            raise
        self._futures.append(self._syncer.submit(_fsync_and_close, fd))

    def report_rest_as(self, phase: str, total_bytes: int) -> None:
        """Writing is done: show the verification still running as its own progress phase."""
        with self._lock:
            if total_bytes > self._checked:  # byte copies were verified while written: often nothing is left
                self._progress.phase(phase, total_bytes - self._checked)
            self._reporting = True

    def wait(self, raise_errors: bool = True) -> None:
        """Every file is durable and verified (or the first error raised) when this returns."""
        if self._checker is not None:
            if raise_errors:
                self.flush()
            self._checker.shutdown(cancel_futures=not raise_errors)
        self._syncer.shutdown()  # never cancelled: each fsync job also closes its file
        jobs = self._futures + self._checks
        errors = [f.exception() for f in jobs if not f.cancelled() and f.exception() is not None]
        self._futures.clear()
        self._checks.clear()
        if raise_errors:
            self.raise_if_failed()
            if errors:
                raise errors[0]


def _hash_range(path: Path, begin: int, count: int) -> bytes:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(min(HASH_CHUNK, max(count, 1))))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < count:
            n = os.preadv(fd, [buffer[: min(len(buffer), count - done)]], begin + done)
            if n == 0:
                raise CheckpointError(f"{path} ended before its header says it should while verifying.")
            digest.update(buffer[:n])
            done += n
    finally:
        os.close(fd)
    return digest.digest()


def _check_run(path: Path, begin: int, run: list[PlannedTensor], expected: dict) -> None:
    """Compare a converted tensor, read back from `path`, with the sha256 of the bytes written (byte copies
    are compared with their source while they are written: `_copy_verified`)."""
    t = run[0]
    if _hash_range(path, begin, t.nbytes) != expected[(path, t.name)]:
        raise CheckpointError(f"Verification failed: tensor '{t.name}' in {path.name} differs from the source.")


def _check_header(path: Path, shard_file: ShardFile) -> None:
    """The shard's header, parsed back, names the planned tensors with their dtype, shape and place."""
    header = read_safetensors_header(path)
    if set(header.tensors) != {t.name for t in shard_file.tensors}:
        raise CheckpointError(f"Verification failed: {shard_file.name} does not hold the planned tensors.")
    for t in shard_file.tensors:
        entry = header.tensors[t.name]
        if (entry.dtype != t.dtype or entry.shape != t.shape or entry.nbytes != t.nbytes
                or entry.begin != len(shard_file.header) + t.offset):
            raise CheckpointError(f"Verification failed: tensor '{t.name}' in {shard_file.name} has the wrong dtype or shape.")


def verify_index(folder: Path, comp: ComponentPlan) -> None:
    """The index written maps exactly the tensors written to their shards."""
    written_index = json.loads((folder / comp.index_name).read_text(encoding="utf-8"))
    want = {t.name: s.name for s in comp.shards for t in s.tensors}
    if written_index.get("weight_map") != want:
        raise CheckpointError(f"Verification failed: {comp.index_name} does not list the tensors written.")

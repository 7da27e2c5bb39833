"""Live bytes of the storages that ops create: the one counter behind the meta trace and the run's meter.

No torch import: callers hand in tensors. No Typer, no Rich.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

from dm_cli.planning.trace.gpu_kernels import allocated


class LiveStorages:
    """Bytes of live storages per place: counted once when an op first produces a storage, returned when it dies.

    A storage is known by `_cdata`, the address of its StorageImpl: unique while it lives, on meta as
    on cpu (`data_ptr()` is 0 for every meta storage, so it cannot tell them apart). Its death is seen
    by a weak reference on its Python object: torch keeps one such object per storage, shared by a
    tensor and all its views, for as long as the storage lives, so the callback fires when the last
    tensor using the storage dies, on meta and cpu alike (checked on torch 2.13). That is one weak
    reference per storage, where a finalizer per tensor would cost one per op output.
    Weight storages (`skip`) are never counted: weights are not activations.
    """

    def __init__(self):
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        # the same live storages in the caching allocator's 512-byte blocks (what a GPU's allocated bytes count)
        self.blocks: dict[str, int] = defaultdict(int)
        self._counted: dict[int, tuple] = {}  # storage key -> (bytes, place, weak reference)
        self._skipped: dict[int, weakref.ref] = {}  # weight storage key -> weak reference (forgotten at death)

    def skip(self, tensor) -> None:
        """Never count `tensor`'s storage (a weight) while it lives."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        self._skipped[key] = weakref.ref(storage, lambda _ref, key=key: self._skipped.pop(key, None))

    def count(self, tensor, place: str) -> None:
        """Charge `tensor`'s storage to `place`, unless it is counted already or a weight's."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key in self._counted or key in self._skipped:
            return
        size = storage.nbytes()
        self._counted[key] = (size, place, weakref.ref(storage, lambda _ref, key=key: self._release(key)))
        self.blocks[place] += allocated(size)
        live = self.live[place] = self.live[place] + size
        if live > self.peak[place]:
            self.peak[place] = live

    def _release(self, key: int) -> None:
        size, place, _ref = self._counted.pop(key)
        self.live[place] -= size
        self.blocks[place] -= allocated(size)

    def reset_peaks(self) -> None:
        """Peaks from now on: each place's peak starts at what is live."""
        self.peak = defaultdict(int, self.live)

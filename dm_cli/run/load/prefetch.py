"""Overlapped offload (the plan's `offload.mode` "overlapped", planning/time/overlap.py): the blocks a plan streams
from the cpu fetched one block ahead of their turn on a second CUDA stream, so that block k+1's weights cross the
bus while block k computes.

accelerate's offload hooks (loading.py `_dispatch`) still put each layer's weights in place before its forward and
drop them after; what changes is the mapping they read. `PrefetchedWeights` hands them the copy already on the
execution device where one was prefetched, else the host copy, which they copy in turn as before. The host copies
are the cpu blocks' weights read and cast once at load, pinned where CUDA runs (a copy from pageable memory cannot
overlap; a GGUF single file's parameters pinned as they are, their quant type kept: `pinned`). A forward pre-hook on
each of those blocks takes its copies (the compute stream waits for their event; each is recorded on the compute
stream, so the allocator does not hand its memory to the next copy while a kernel still reads it) and starts the
next block's; the component's own pre-hook starts the first, which then crosses while the modules before it compute.
At most two blocks are on the device at once: the running one and the prefetched one, what the plan charges.
accelerate's hooks inside those blocks skip the allocator flush they run for each tensor (`quiet_hook_class`: its
cudaFree would synchronize the device, waiting for the next block's copy). Blocks on disk stay synchronous: read
from the checkpoint on each use. Where CUDA is absent (a CPU execution device: tests, CPU runs) the same path copies
at once on the one stream; the values are the host copies either way, so the pixels are the synchronous path's. No
Typer, no Rich."""

from __future__ import annotations

import contextlib
import functools

from dm_cli.devices import map_entry


class PrefetchedWeights:
    """The weights accelerate's offload hooks read (name -> tensor), with the cpu blocks' copies fetched ahead."""

    def __init__(self, base, blocks: list[tuple[str, list[str]]], device):
        """`base`: the mapping the hooks would read (dmap's CastingWeights, or a state dict); `blocks`: (device_map
        key, its tensor names) of each cpu block, in execution order; `device`: the execution device."""
        import torch  # lazy: torch (heavy, off start-up)

        self._base, self._device = base, device
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._host = {}
        for _, names in blocks:
            for name in names:
                value = base[name]
                self._host[name] = pinned(value) if cuda and isinstance(value, torch.Tensor) else value
        self.order = [key for key, _ in blocks]
        self._names = [names for _, names in blocks]
        self._ready: dict[int, tuple] = {}  # block index -> (event or None, {name: copy on the device})
        self._current: dict = {}  # name -> copy on the device, of the block about to run
        self.prefetched = 0  # blocks handed over from a copy started ahead of their turn

    def __contains__(self, key) -> bool:
        return key in self._base

    def __getitem__(self, key):
        value = self._current.pop(key, None)
        if value is not None:
            return value
        host = self._host.get(key)
        return host if host is not None else self._base[key]

    def keys(self):
        return self._base.keys()

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def start(self, index: int) -> None:
        """Begin copying block `index` to the execution device (nothing past the last, nothing twice)."""
        import torch  # lazy: torch (heavy, off start-up)

        if index >= len(self._names) or index in self._ready:
            return
        names = self._names[index]
        if self._stream is None:  # no second stream: the copy happens now, on the one stream
            self._ready[index] = (None, {n: self._host[n].to(self._device) for n in names})
            return
        with torch.cuda.stream(self._stream):
            copies = {n: self._host[n].to(self._device, non_blocking=True) for n in names}
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ready[index] = (event, copies)

    def enter(self, index: int) -> None:
        """Block `index` is about to run: its copies handed to the hooks (the compute stream waiting for them), any
        stale ones dropped, and the next block's copy started."""
        import torch  # lazy: torch (heavy, off start-up)

        event, copies = self._ready.pop(index, (None, {}))
        self._ready.clear()
        self._current = copies
        if copies:
            self.prefetched += 1
        if event is not None:
            compute = torch.cuda.current_stream(self._device)
            compute.wait_event(event)
            for tensor in copies.values():
                tensor.record_stream(compute)
        self.start(index + 1)

    def close(self) -> None:
        """The host copies and any copies in flight let go (the component is being freed)."""
        self._ready.clear()
        self._current = {}
        self._host = {}


def pinned(value):
    """`value` in page-locked RAM (a copy from pageable memory cannot overlap compute). A GGUF parameter comes back
    of its own class with its quant type (its `__torch_function__` rewraps what `pin_memory` returns); another
    tensor subclass that would not, or cannot be pinned, is kept as it is and copied from pageable memory."""
    import torch  # lazy: torch (heavy, off start-up)

    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.pin_memory()
    try:
        copy = value.pin_memory()
    except (RuntimeError, TypeError, NotImplementedError):
        return value
    same = type(copy) is type(value) and getattr(copy, "quant_type", None) == getattr(value, "quant_type", None)
    return copy if same else value


def prefetched_weights(model, device_map: dict, base, device) -> PrefetchedWeights | None:
    """The mapping for `_dispatch` when the plan overlaps this component's offload: its cpu blocks that are modules
    (a tensor the root holds itself streams in its turn), each with its tensor names; None when there are none."""
    modules = dict(model.named_modules())
    names: dict[str, list[str]] = {}
    for name in base.keys():
        entry = map_entry(name, device_map)
        if entry is not None and device_map[entry] == "cpu" and entry in modules and entry:
            names.setdefault(entry, []).append(name)
    blocks = [(key, names[key]) for key in device_map if key in names]
    return PrefetchedWeights(base, blocks, device) if blocks else None


def attach_prefetch(model, weights: PrefetchedWeights) -> None:
    """The pre-hooks that drive `weights`: the component's starts the first block's copy, each block's takes its
    own and starts the next one's; accelerate's offload hooks inside those blocks made quiet (`quiet_hook_class`).
    Kept on the model (`_dmap_prefetch`) for `free_components` to close."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook  # lazy: accelerate (heavy, off start-up)

    quiet = quiet_hook_class()
    model.register_forward_pre_hook(lambda module, args: weights.start(0))
    for index, key in enumerate(weights.order):
        block = model.get_submodule(key)
        block.register_forward_pre_hook(lambda module, args, index=index: weights.enter(index))
        for module in block.modules():
            hook = getattr(module, "_hf_hook", None)
            for each in hook.hooks if isinstance(hook, SequentialHook) else [hook]:
                if type(each) is AlignDevicesHook and each.offload:
                    each.__class__ = quiet
    model._dmap_prefetch = weights


@functools.cache
def quiet_hook_class():
    """accelerate's AlignDevicesHook without the allocator flush it runs for each tensor it sets on a GPU
    (`set_module_tensor_to_device` calls torch.cuda.empty_cache, whose cudaFree synchronizes the device: it would wait
    for the next block's copy before this block computes, undoing the overlap). The caching allocator then reuses
    the freed blocks of the same sizes for the next copies, which is what the plan charges."""
    from accelerate.hooks import AlignDevicesHook  # lazy: accelerate (heavy, off start-up)

    class QuietAlignDevicesHook(AlignDevicesHook):
        def pre_forward(self, module, *args, **kwargs):
            with no_cache_flush():
                return super().pre_forward(module, *args, **kwargs)

        def post_forward(self, module, output):
            with no_cache_flush():
                return super().post_forward(module, output)

    return QuietAlignDevicesHook


@contextlib.contextmanager
def no_cache_flush():
    """accelerate's `clear_device_cache` a no-op while the block's tensors are set and dropped, then restored."""
    from accelerate.utils import modeling  # lazy: accelerate (heavy, off start-up)

    flush = modeling.clear_device_cache
    modeling.clear_device_cache = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling.clear_device_cache = flush

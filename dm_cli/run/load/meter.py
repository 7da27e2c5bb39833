"""Measured memory during a run: bytes per (virtual) device, and the process's peak RSS while loading.

Used by the stage loop (`dm_cli.run.loops.stages`); no Typer, no Rich.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

from dm_cli.devices import device_of
from dm_cli.planning.trace.storages import LiveStorages


def plain_tensors(tensor) -> list:
    """The tensors holding memory: the inner ones of a tensor subclass (torchao's int8 data, scales...)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    return [t for name in flatten(tensor)[0] for t in plain_tensors(getattr(tensor, name))]


class MemoryMeter(LiveStorages):
    """Tracked bytes per (virtual) device: weights by the plan's map, activations by the module running.

    Weights are registered as weak references when a component loads, so `resident()` shows what is
    really still alive (a freed component drops to zero only if nothing holds it). Activations are
    counted by a dispatch mode between `start()` and `stop()` (`LiveStorages`: a storage's bytes when
    an op creates it, returned when it dies), charged to the device of the innermost mapped module
    running. The mode costs Python work on every op, so the runner keeps it on for encode, decode and
    only the FIRST denoising step: every step runs the same graph on the same shapes, so its peak is
    the stage's. CUDA devices in a real run report `torch.cuda.max_memory_allocated` instead.
    """

    def __init__(self):
        super().__init__()
        self._weights: dict[str, list[tuple[weakref.ref, int]]] = defaultdict(list)
        self.current: list[str] = ["cpu"]
        self._mode = None
        self.tracking = False

    def register_weights(self, model, device_map: dict, default_device: str) -> None:
        seen: set[int] = set()
        tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, outer in tensors:
            if outer is None or outer.device.type == "meta":
                continue
            for tensor in plain_tensors(outer):
                storage = tensor.untyped_storage()
                if storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                self.skip(tensor)
                device = str(device_of(name, device_map, default_device))
                self._weights[device].append((weakref.ref(tensor), storage.nbytes()))

    def resident(self) -> dict[str, int]:
        """Bytes of registered weights still alive (call after gc.collect() to see frees)."""
        out = {}
        for device, refs in self._weights.items():
            alive = [(r, n) for r, n in refs if r() is not None]
            self._weights[device] = alive
            out[device] = sum(n for _, n in alive)
        return out

    def start(self) -> None:
        """Count the storages that ops create from now on (until `stop`)."""
        if self._mode is not None:
            self.tracking = True
            return
        import torch  # lazy: torch (heavy, off start-up)
        from torch.utils._python_dispatch import TorchDispatchMode  # lazy: torch (heavy, off start-up)
        from torch.utils._pytree import tree_flatten  # lazy: torch (heavy, off start-up)

        tensor_type = torch.Tensor
        meter = self

        class _Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if meter.tracking:
                    if isinstance(out, tensor_type):
                        meter._track(out)
                    elif isinstance(out, (tuple, list)):
                        for t in tree_flatten(out)[0]:
                            if isinstance(t, tensor_type):
                                meter._track(t)
                return out

        self._mode = _Track()
        self._mode.__enter__()
        self.tracking = True

    def stop(self) -> None:
        """No more counting (storages already counted are still returned when they die).

        The dispatch mode leaves the mode stack only when it is on top (a stop from inside a
        pipeline callback could otherwise pop someone else's mode); else it passes ops through
        untouched until `stop` is called again at the end of the stage.
        """
        self.tracking = False
        if self._mode is None:
            return
        from torch.utils._python_dispatch import _get_current_dispatch_mode  # lazy: torch (heavy, off start-up)

        if _get_current_dispatch_mode() is self._mode:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _track(self, tensor) -> None:
        """Count the memory behind an op's output: a meta tensor has none; a tensor subclass (torchao's
        int8 weights) holds its inner tensors, and its own storage is a placeholder of its nominal size."""
        if tensor.device.type == "meta":
            return
        for plain in plain_tensors(tensor):
            self.count(plain, self.current[-1])

    def attach(self, model, device_map: dict, default_device: str) -> list:
        """Hooks that make activations count against the device of the module that makes them."""
        handles = []
        modules = dict(model.named_modules())
        for prefix, dev in device_map.items():
            module = modules.get(prefix)
            if module is None:
                continue
            key = str(dev)

            def pre(_module, _args, key=key):
                self.current.append(key)

            def post(_module, _args, _out):
                if len(self.current) > 1:
                    self.current.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        return handles


class RssSampler:
    """Peak resident set size of this process while a block runs.

    On Linux the kernel keeps the high-water mark (VmHWM) for free, and writing 5 to
    /proc/self/clear_refs resets it to the current RSS: two file reads and no thread, exact. Where
    that is not possible, a thread samples the RSS every 2 ms.
    """

    def __init__(self):
        self._thread = None
        self._exact = _reset_peak_rss()
        if self._exact:
            self.start = self.peak = _proc_status("VmRSS")
            return
        import psutil  # lazy: psutil (optional)

        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = self._process.memory_info().rss
            if rss > self.peak:
                self.peak = rss
            self._stop.wait(0.002)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._exact:
            self.peak = max(self.start, _proc_status("VmHWM"))
            return
        self._stop.set()
        self._thread.join()
        rss = self._process.memory_info().rss
        self.peak = max(self.peak, rss)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        _proc_status("VmHWM")
        return True
    except OSError:
        return False

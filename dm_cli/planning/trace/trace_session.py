"""The meta trace's engine (`_Session`, used by `trace.py`): one forward under a torch dispatch mode and module hooks
that records the order modules first run in, counts live activation bytes per storage (`LiveStorages`) and the peak
while each module runs, and tags tensors with a virtual device (or the module they came from) to report ops that
combine two tags, moving inputs at module boundaries as accelerate's AlignDevicesHook does. The session is three
parts: `_ModuleHooks` (module boundaries), `_OpAccounting` (what each op costs) and `_Session` (state and tags).

torch is imported inside functions only: importing this module (and `dmap --help`) must not pay for it.
"""

from __future__ import annotations

import re
import sys
import weakref
from functools import lru_cache

from dm_cli.devices import map_entry, normalise_map
from dm_cli.planning.parallel.parallel import PIPELINE_LISTS
from dm_cli.planning.trace.gpu_kernels import (
    AttentionCall,
    attention_backend,
    attention_transient,
    convolution_transient,
    kernel_head_dim,
)
from dm_cli.planning.trace.storages import LiveStorages

_TAG = "_dmap_tag"
_META = "meta"  # the one place a trace counts activations against
_BLOCK_ENTRY = re.compile(rf"(?:{'|'.join(PIPELINE_LISTS)})\.[0-9]+")  # a block of the lists a pipeline cuts


def iter_tensors(value, torch):
    """Tensors in an op's or a module's arguments (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item, torch)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item, torch)


@lru_cache(maxsize=1)
def _mode_classes():
    """The dispatch and function modes, defined on first use so that importing this module needs no torch."""
    import torch  # here only: importing this module stays torch-free
    from torch.overrides import TorchFunctionMode  # lazy: torch (heavy, off start-up)
    from torch.utils._python_dispatch import TorchDispatchMode  # lazy: torch (heavy, off start-up)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    to_methods = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}

    class DispatchMode(TorchDispatchMode):
        def __init__(self, session):
            super().__init__()
            self.session = session

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.session.after_op(func, args, kwargs, out)
            return out

    class FunctionMode(TorchFunctionMode):
        def __init__(self, session):
            super().__init__()
            self.session = session

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa and self.session.replace_sdpa:
                return self.session.fused_attention(*args, **kwargs)
            if func in to_methods and self.session.tag_mode is not None:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                out = func(*args, **kwargs)
                if _explicit_device(func, args, kwargs) and not caller.startswith("accelerate"):
                    # model code moving a tensor to a named device (x.to(y.device)): on meta we cannot
                    # tell which virtual device is meant, so the result is compatible with any.
                    if out is args[0]:
                        out = out.view_as(out)
                    self.session.set_tag(out, None)
                return out
            return func(*args, **kwargs)

    def _explicit_device(func, args, kwargs):
        if func is not torch.Tensor.to:
            return True
        if "device" in kwargs or "other" in kwargs:
            return True
        return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool) for a in args[1:])

    return DispatchMode, FunctionMode


class _ModuleHooks:
    """Module hooks around one forward (`_Session`'s first part): entering and leaving each module (its peak and
    the size of its output), and moving its inputs to its tag as accelerate's AlignDevicesHook does. Uses the
    state `_Session.__init__` sets up."""

    def __enter__(self):
        dispatch_cls, function_cls = _mode_classes()
        for module in self.model.modules():
            prefix = self.names.get(id(module))
            if prefix is None:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(prefix), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(prefix), always_call=True))
        self._modes = [function_cls(self), dispatch_cls(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for tensor in self.tagged:
            try:
                delattr(tensor, _TAG)
            except AttributeError:
                pass
        self.tagged = []
        return False

    # --- module boundaries -------------------------------------------------------------------

    def enter_module(self, prefix: str) -> None:
        self.stack.append([prefix, self.memory.live[_META], self.memory.blocks[_META]])
        self.called.add(prefix)
        if prefix in self.holds_tensors and prefix not in self.ordered:
            self.ordered.add(prefix)
            self.order.append(prefix)

    def exit_module(self, prefix: str) -> None:
        if not any(frame[0] == prefix for frame in self.stack):
            return
        while self.stack:
            name, peak, gpu_peak = self.stack.pop()
            peak = max(peak, self.memory.live[_META])
            gpu_peak = max(gpu_peak, self.memory.blocks[_META])
            if self.stack:
                self.stack[-1][1] = max(self.stack[-1][1], peak)
                self.stack[-1][2] = max(self.stack[-1][2], gpu_peak)
            self.module_peaks[name] = max(self.module_peaks.get(name, 0), peak)
            self.gpu_module_peaks[name] = max(self.gpu_module_peaks.get(name, 0), gpu_peak)
            if name == prefix:
                break

    def _pre_hook(self, prefix):
        def hook(module, args, kwargs):
            self.enter_module(prefix)
            target = self.recolor.get(prefix)
            if target is None:
                return None
            return self._move(args, target), self._move(kwargs, target)

        return hook

    def _post_hook(self, prefix):
        def hook(module, args, kwargs_or_output, output=None):
            self.exit_module(prefix)
            produced = kwargs_or_output if output is None else output
            size = sum(t.numel() * t.element_size() for t in iter_tensors(produced, self.torch))
            if size > self.module_outputs.get(prefix, 0):
                self.module_outputs[prefix] = size
            return None

        return hook

    def _move(self, value, target):
        """What accelerate's send_to_device does to a module's inputs: tensors land on `target`."""
        torch = self.torch
        if isinstance(value, torch.Tensor):
            if getattr(value, _TAG, None) == target:
                return value
            alias = value.view_as(value)
            self.set_tag(alias, target)
            return alias
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._move(v, target) for v in value)
        if isinstance(value, list):
            # in place: models mutate lists they are given (the Wan VAE's feature cache, `feat_cache`),
            # and a copy would lose what they write into it (accelerate skips those keys: `_skip_keys`)
            for index, item in enumerate(value):
                value[index] = self._move(item, target)
            return value
        if type(value) is dict:
            return {k: self._move(v, target) for k, v in value.items()}
        return value


class _OpAccounting:
    """What each dispatched op costs (`_Session`'s second part): the first use of each weight (the execution
    order), live activation bytes and the peak of the running module, the work (FLOPs, memory-bound bytes, ops),
    and fused attention counted as its kernel allocates. Uses the state `_Session.__init__` sets up."""

    def after_op(self, func, args, kwargs, out) -> None:
        torch = self.torch
        inputs = list(iter_tensors(args, torch))
        if kwargs:
            inputs.extend(iter_tensors(kwargs, torch))
        input_ids = {id(t) for t in inputs}
        for tensor in inputs:
            owner = self.weight_owner.get(id(tensor))
            if owner is not None and owner not in self.ordered:
                self.ordered.add(owner)
                self.order.append(owner)
        outputs = [t for t in iter_tensors(out, torch) if id(t) not in input_ids]
        if self.tag_mode is not None:
            tag = self.combine(inputs, func)
            if tag is not None:
                for tensor in outputs:
                    self.set_tag(tensor, tag)
        if self.track_memory:
            self.count_work(func, args, kwargs, inputs, out,
                            outside=not any(_BLOCK_ENTRY.fullmatch(frame[0]) for frame in self.stack))
            for tensor in outputs:
                self.memory.count(tensor, _META)
            live = self.memory.live[_META]
            if self.stack and live > self.stack[-1][1]:
                self.stack[-1][1] = live
            self.gpu_candidate(_convolution_transient(func, args, out, torch), func)

    def gpu_candidate(self, transient: int, op) -> None:
        """What a GPU holds now: the live storages in the allocator's blocks, plus what the running kernel holds
        beside its output (gpu_kernels.py); the running module's GPU peak and the call's, with what set it."""
        live = self.memory.blocks[_META] + transient
        if self.stack and live > self.stack[-1][2]:
            self.stack[-1][2] = live
        if live > self.gpu_peak:
            self.gpu_peak = live
            self.gpu_peak_at = {"module": self.stack[-1][0] if self.stack else "", "op": _op_name(op),
                                "kernel_bytes": transient}

    def count_work(self, func, args, kwargs, inputs, out, outside: bool = False) -> None:
        """Add one dispatched op to `work`: FLOPs by torch's own formulas (torch.utils.flop_counter) for matmuls and
        convolutions; the bytes read and written for the other ops that are not views. `outside`: no block of a
        block list runs (the modules before and after the blocks), so the op counts again in the `outside_*` keys:
        what every rank of a pipeline runs whatever its slice (the step-time prediction's slices)."""
        if self._flop_formulas is None:
            from torch.utils.flop_counter import flop_registry  # lazy: torch (heavy, off start-up)

            self._flop_formulas = flop_registry
        if getattr(func, "is_view", False):
            if any(id(t) in self.fused_made for t in inputs):  # a view of a run's tensor: the run's still
                self.fused_made.update(self.fused_key(t) for t in iter_tensors(out, self.torch))
            return
        work = self.work
        work["ops"] += 1
        work["outside_ops"] += outside
        formula = self._flop_formulas.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
                work["matmul_flops"] += flops
                work["matmul_ops"] += 1
                work["outside_flops"] += flops if outside else 0
                conv = "conv" in str(getattr(func, "_overloadpacket", ""))
                if conv:  # counted in the matmul FLOPs too
                    work["conv_flops"] += flops
                    work["conv_ops"] += 1
                if flops > 0:  # by size (powers of two): a GPU's rate depends on each op's size, not their mean
                    key = f"{'conv' if conv else 'matmul'}_flops_at_2^{flops.bit_length() - 1}"
                    work[key] = work.get(key, 0) + flops
                self.end_fused_run()  # a matmul ends the run of elementwise ops
                return
            except Exception:  # noqa: BLE001 - a formula that does not take this call: counted as bytes
                pass
        moved = sum(t.numel() * t.element_size() for t in (*inputs, *iter_tensors(out, self.torch)))
        work["other_bytes"] += moved
        work["outside_bytes"] += moved if outside else 0
        self.count_fused(inputs, out, outside)

    def end_fused_run(self) -> None:
        """A matmul or attention ends the run of elementwise ops a compiler fuses: a new run starts empty."""
        self.fused_made, self.fused_read, self.fused_refs = set(), set(), {}

    def fused_key(self, tensor) -> int:
        """`id(tensor)`, forgotten by the run when the tensor is freed (a freed id is reused by later tensors), through a
        weak reference: the run must not keep a tensor alive, which the trace's live storages would count."""
        key = id(tensor)
        if key not in self.fused_refs:
            self.fused_refs[key] = weakref.ref(tensor, lambda _ref, key=key, refs=self.fused_refs: self._forget(key, refs))
        return key

    def _forget(self, key: int, refs: dict) -> None:
        if refs is self.fused_refs:  # (a run that ended since has taken its sets with it)
            self.fused_made.discard(key)
            self.fused_read.discard(key)
            refs.pop(key, None)

    def count_fused(self, inputs, out, outside: bool) -> None:
        """The same op as a compiler fuses it (torch.compile's inductor): the elementwise ops between two matmuls
        (or attentions) are one kernel, which reads each tensor from outside the run once and writes what it makes,
        a tensor made and then read inside the run never leaving the kernel. `fused_kernels`: the runs;
        `fused_bytes`: what they read and write (with `outside_fused_*`, the part outside the block lists)."""
        work = self.work
        fused = 0
        if not self.fused_made:  # the first op after a matmul starts a run: one kernel
            work["fused_kernels"] += 1
            work["outside_fused_kernels"] += outside
        for tensor in inputs:
            key, nbytes = self.fused_key(tensor), tensor.numel() * tensor.element_size()
            if key in self.fused_made:
                if key not in self.fused_read:  # made in the run: never written out, never read back
                    self.fused_read.add(key)
                    fused -= nbytes
            elif key not in self.fused_read:
                self.fused_read.add(key)
                fused += nbytes
        outputs = list(iter_tensors(out, self.torch))
        self.fused_made.update(self.fused_key(t) for t in outputs)
        fused += sum(t.numel() * t.element_size() for t in outputs)
        work["fused_bytes"] += fused
        work["outside_fused_bytes"] += fused if outside else 0

    def fused_attention(self, query, key, value, attn_mask=None, *args, **kwargs):
        """What fused SDPA kernels allocate: the output only (the meta decomposition would materialise n^2)."""
        torch = self.torch
        shape = tuple(query.shape[:-1]) + (value.shape[-1],)
        out = torch.empty(shape, dtype=query.dtype, device=query.device)
        if self.track_memory:  # what the GPU's kernel holds beside the output (gpu_kernels.py)
            call = AttentionCall(query.shape[:-2].numel(), query.shape[-2], key.shape[-2], query.shape[-1],
                                 value.shape[-1], str(query.dtype).removeprefix("torch."),
                                 isinstance(attn_mask, torch.Tensor),
                                 bool(kwargs.get("is_causal", args[1] if len(args) > 1 else False)))
            backend = attention_backend(call)
            self.attention_backends[backend] = self.attention_backends.get(backend, 0) + 1
            self.gpu_candidate(attention_transient(call, backend), f"attention ({backend}, head dim {call.head_dim})")
            # what a GPU's kernel multiplies: the same at the width it is built for (flash: 40 computes as 64)
            self.work["attention_kernel_flops"] += 4 * query.shape[:-1].numel() * key.shape[-2] \
                * kernel_head_dim(call, backend)
        if self.track_memory:  # scores and weighted sum: 2 x 2 x queries x keys x head dim per head
            self.work["attention_flops"] += 4 * query.shape[:-1].numel() * key.shape[-2] * query.shape[-1]
            self.work["attention_ops"] += 1
            self.work["attention_scores"] += query.shape[:-1].numel() * key.shape[-2]
            self.work["attention_rows"] += query.shape[:-1].numel()  # each query row's fixed cost (its softmax)
            self.work["ops"] += 1
            self.end_fused_run()  # an attention ends the run of elementwise ops
        if self.tag_mode is not None:
            tensors = [query, key, value] + ([attn_mask] if isinstance(attn_mask, torch.Tensor) else [])
            tag = self.combine(tensors, "aten.scaled_dot_product_attention")
            self.set_tag(out, tag)
        return out


class _Session(_ModuleHooks, _OpAccounting):
    """Hooks + modes around one forward. `tag_mode`: None, "device" (virtual devices) or "provenance". The module
    hooks and the op accounting are its parts `_ModuleHooks` and `_OpAccounting`; here: the state, the tags."""

    def __init__(self, model, *, track_memory=False, replace_sdpa=False, tag_mode=None, device_map=None,
                 problems: list | None = None, seen_problems: set | None = None):
        import torch  # here only: importing this module stays torch-free

        self.torch = torch
        self.model = model
        self.track_memory = track_memory
        self.replace_sdpa = replace_sdpa
        self.tag_mode = tag_mode
        self.memory = LiveStorages()
        # modules
        self.names: dict[int, str] = {}
        self.classes: dict[str, str] = {}
        self.holds_tensors: set[str] = set()
        self.weight_owner: dict[int, str] = {}
        self.order: list[str] = []
        self.ordered: set[str] = set()
        self.called: set[str] = set()
        self.stack: list[list] = []  # [prefix, peak while running]
        self.module_peaks: dict[str, int] = {}
        self.module_outputs: dict[str, int] = {}
        # the same on a GPU (track_memory only): allocator blocks and what kernels hold beside their outputs
        self.gpu_module_peaks: dict[str, int] = {}
        self.gpu_peak = 0
        self.gpu_peak_at: dict = {}  # the module, op and kernel bytes at the GPU peak
        self.attention_backends: dict[str, int] = {}  # the GPU's attention kernel -> calls
        # the work of the call (track_memory only): FLOPs of matmuls and convolutions, of attention, the bytes
        # other ops read and write (memory-bound), and the ops dispatched (each costs the host a fixed time)
        self.work = {"matmul_flops": 0, "matmul_ops": 0, "attention_flops": 0, "attention_kernel_flops": 0,
                     "attention_ops": 0, "attention_scores": 0, "attention_rows": 0, "conv_flops": 0, "conv_ops": 0, "other_bytes": 0,
                     "ops": 0, "outside_ops": 0, "outside_flops": 0, "outside_bytes": 0, "fused_bytes": 0,
                     "fused_kernels": 0, "outside_fused_bytes": 0, "outside_fused_kernels": 0}
        self._flop_formulas = None
        # the run of elementwise ops since the last matmul or attention, as a compiler fuses it (`count_fused`):
        # the tensors it made, the tensors it has read
        self.fused_made: set[int] = set()
        self.fused_read: set[int] = set()
        self.fused_refs: dict = {}  # id -> a weak reference that forgets the id when its tensor is freed
        # tags
        self.recolor: dict[str, frozenset] = {}  # module prefix -> tag its inputs get at entry
        self.tagged: list = []
        self.problems: list[str] = problems if problems is not None else []
        self._seen_problems: set = seen_problems if seen_problems is not None else set()
        self.groups: dict[str, list[frozenset]] = {}
        self._unit_cache: dict[tuple[str, str], str] = {}
        self._handles: list = []
        self._modes: list = []

        for prefix, module in model.named_modules():
            if id(module) in self.names:
                continue
            self.names[id(module)] = prefix
            self.classes[prefix] = type(module).__name__
            own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
            if own:
                self.holds_tensors.add(prefix)
            for tensor in own:
                self.weight_owner.setdefault(id(tensor), prefix)
                if track_memory:
                    self.memory.skip(tensor)
        if tag_mode == "provenance":
            # every module is a possible hook point: one without tensors (LTX-2's norm_out, a LayerNorm without
            # affine) that a split module combines gets its own device_map key from the planner
            # (search.component_blocks), so that accelerate moves its inputs as this trace assumes
            for prefix in self.classes:
                self.recolor[prefix] = frozenset((prefix,))
            for name, tensor in _named_tensors(self.model):
                self.set_tag(tensor, frozenset((self.weight_owner.get(id(tensor), ""),)))
                self.tagged.append(tensor)
        elif tag_mode == "device":
            self._setup_devices(device_map or {})

    # --- setup ---------------------------------------------------------------------------------

    def _setup_devices(self, device_map: dict) -> None:
        placed = normalise_map(device_map)
        gpus = sorted({d for d in placed.values() if d not in ("cpu", "disk")}, key=str)
        main = gpus[0] if gpus else "cpu"
        execution = {k: (main if d in ("cpu", "disk") else d) for k, d in placed.items()}
        uncovered: dict[str, int] = {}
        for name, tensor in _named_tensors(self.model):
            key = map_entry(name, execution)
            if key is None:
                owner = name.rpartition(".")[0]
                uncovered[owner] = uncovered.get(owner, 0) + 1
                continue
            self.set_tag(tensor, frozenset((execution[key],)))
            self.tagged.append(tensor)
        if uncovered:
            owners = sorted(uncovered)
            shown = ", ".join(o or "(root)" for o in owners[:3]) + (", ..." if len(owners) > 3 else "")
            self.report(f"device_map places no entry for {sum(uncovered.values())} tensors of {len(owners)} modules "
                        f"({shown}): accelerate would refuse the map", key=("uncovered",))
        if len(set(execution.values())) > 1 or "disk" in placed.values():
            # accelerate hooks: every mapped module and, below one, every module holding tensors
            for prefix in self.classes:
                key = map_entry(prefix, execution)
                if key is None:
                    continue
                if prefix == key or prefix in self.holds_tensors:
                    self.recolor[prefix] = frozenset((execution[key],))
            self.recolor[""] = frozenset((main,))

    # --- tags ---------------------------------------------------------------------------------------

    def set_tag(self, tensor, tag) -> None:
        try:
            setattr(tensor, _TAG, tag)
        except (AttributeError, RuntimeError):
            pass

    def combine(self, tensors, func):
        """Tag of an op's result; report the op when its inputs carry different tags."""
        tags = [t for t in (getattr(x, _TAG, None) for x in tensors) if t]
        if not tags:
            return None
        first = tags[0]
        if all(t == first for t in tags):
            return first
        union = frozenset().union(*tags)
        op = _op_name(func)
        where = self.stack[-1][0] if self.stack else ""
        if self.tag_mode == "provenance":
            units = frozenset(self._unit(where, c) for c in union)
            if len(units) > 1:
                self.groups.setdefault(where, []).append(units)
            return union
        devices = sorted(union, key=str)
        shown = " and ".join(str(d) for d in devices)
        self.report(f"{where or '(root)'} ({self.classes.get(where, '?')}) combines tensors on devices {shown} in {op}",
                    key=(where, op, tuple(devices)))
        return first

    def _unit(self, frame: str, color: str) -> str:
        """Which called child of `frame` a tagged tensor came from (`frame` itself for its inputs/own tensors)."""
        key = (frame, color)
        cached = self._unit_cache.get(key)
        if cached is not None:
            return cached
        if color == frame:
            unit = frame
        elif frame and not color.startswith(frame + "."):
            unit = frame  # reached the frame some other way than through a child: treat as its own
        else:
            rest = color[len(frame) + 1:] if frame else color
            unit = color
            base = frame
            for part in rest.split("."):
                base = f"{base}.{part}" if base else part
                if base in self.called:
                    unit = base
                    break
        self._unit_cache[key] = unit
        return unit

    def report(self, message: str, key) -> None:
        if key in self._seen_problems:
            return
        self._seen_problems.add(key)
        self.problems.append(message)

    # --- results -------------------------------------------------------------------------------

    def execution_order(self) -> list[str]:
        order = list(self.order)
        seen = set(order)
        for prefix in self.classes:
            if prefix in self.holds_tensors and prefix not in seen:
                order.append(prefix)
        return order

    def same_device_groups(self) -> dict[str, list[list[str]]]:
        return {frame: _merged_groups(sets) for frame, sets in self.groups.items()}



def _named_tensors(model):
    """(name, tensor) of each parameter and buffer of `model`, once each (tied ones under their first name)."""
    seen = set()
    for prefix, module in model.named_modules():
        for collection in (module._parameters, module._buffers):
            for name, tensor in collection.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                yield (f"{prefix}.{name}" if prefix else name), tensor


def _merged_groups(sets) -> list[list[str]]:
    """Units that must share a device in one frame: the sets that overlap merged (union-find), singletons left out."""
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for units in sets:
        items = sorted(units)
        for other in items[1:]:
            parent[find(other)] = find(items[0])
    merged: dict[str, list[str]] = {}
    for item in parent:
        merged.setdefault(find(item), []).append(item)
    return sorted(sorted(g) for g in merged.values() if len(g) > 1)


def _convolution_transient(func, args, out, torch) -> int:
    """cuDNN's workspace for a convolution op on a GPU (gpu_kernels.convolution_transient); 0 for other ops."""
    if getattr(func, "_overloadpacket", None) is not torch.ops.aten.convolution or len(args) < 2:
        return 0
    data, weight = args[0], args[1]
    if not isinstance(data, torch.Tensor) or not isinstance(out, torch.Tensor):
        return 0
    channels_last = data.dim() == 4 and data.is_contiguous(memory_format=torch.channels_last) \
        and not data.is_contiguous()
    return convolution_transient(data.numel() * data.element_size(), weight.numel() * weight.element_size(),
                                 out.numel() * out.element_size(), str(data.dtype).removeprefix("torch."),
                                 data.dim(), channels_last)


def _op_name(func) -> str:
    if isinstance(func, str):
        return func
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", None) or str(func).split(".")[0]
    namespace = getattr(func, "namespace", "aten")
    return f"{namespace}.{name}"

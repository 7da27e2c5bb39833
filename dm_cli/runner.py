"""`dmap run`: staged encode -> denoise -> decode across devices, following a dmap plan.

The diffusers "distributed inference" recipe (load the text encoders, encode, free them; load the
denoiser, denoise to latents, free it; load the VAE, decode) done by one function for any
supported pipeline, with each component loaded straight to the devices the plan gives it:

- whole-device components and GPU-only splits go through `from_pretrained(device_map=...)`;
- components with cpu/disk blocks are built empty and dispatched with accelerate hooks whose
  weights map points INTO the original safetensors files (no re-saved `.dat` copies);
- `simulate=True` runs every virtual device on the CPU with the tracer's split check active
  (`dm_cli.trace.VirtualDevices`), so a two-GPU plan can be proven on a laptop.

The runner is the only part of dmap that loads real weights. No Typer, no Rich here.
"""

from __future__ import annotations

import gc
import hashlib
import inspect as pyinspect
import json
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import __version__
from .atomic import atomic_write
from .errors import CheckpointError, DoesNotFitError, SourceError, UsageError
from .inputs import InputSpec
from .sources import config_digest
from .units import format_size, parse_dtype
from .weight_formats import format_of

SUPPORTED_PIPELINES = ("FluxPipeline", "StableDiffusionXLPipeline", "StableDiffusionPipeline", "StableDiffusion3Pipeline")
DENOISERS = ("transformer", "unet")
# Peak host RAM during a component's load may exceed the largest shard by this much: the Python
# heap, safetensors' mmap bookkeeping and one tensor in flight during a dtype cast.
LOAD_RSS_MARGIN_BYTES = 64 * 1024 * 1024
# The activation tracker (MemoryMeter) costs Python work on every op, so in denoise it runs for the
# first TRACKED_STEPS steps only. Two, not one: from the second step on, the previous step's outputs
# (noise_pred, the CFG halves) are still alive in the pipeline's loop while the denoiser runs again,
# so step 2 is the steady state that every later step repeats (same graph, same shapes).
# None tracks every step (what the tests compare against).
TRACKED_STEPS: int | None = 2


# --- request / result ----------------------------------------------------------------------


@dataclass
class RunRequest:
    """Everything `dmap run` was asked for. None means: the pipeline's (or the demo's) default."""

    source: str | None
    prompt: str
    negative_prompt: str | None = None
    device_map: str = "auto"  # auto|balanced|balanced_low_0|sequential or a plan JSON path
    max_memory: str | None = None
    overhead: str | None = None  # per-device overhead for the planner, e.g. 0=600MB
    mode: str = "auto"
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    num_images: int = 1
    max_sequence_length: int | None = None
    output: str | None = "dmap.png"
    save_latents: str | None = None
    dtype: str | None = None
    simulate: bool = False
    weights: str | None = None  # --weights spec (fp8, int8, transformer=fp8,...); None: the plan's


@dataclass
class StageResult:
    name: str
    components: list[str]
    load_s: float = 0.0
    run_s: float = 0.0
    wall_s: float = 0.0
    resident_before: dict[str, int] = field(default_factory=dict)  # tracked weight bytes per device before loading
    resident_after_load: dict[str, int] = field(default_factory=dict)
    measured_peak: dict[str, int] = field(default_factory=dict)
    planned_peak: dict[str, int] = field(default_factory=dict)
    load_rss_delta: int = 0  # peak host RSS during this stage's load minus RSS before it
    tracked: str = "all"  # which part of the run the activation tracker saw ("first of N steps" in denoise)
    largest_shard: int = 0  # largest safetensors file this stage read


@dataclass
class RunResult:
    source: str
    pipeline_class: str
    demo: bool
    plan: dict
    plan_digest: str
    planned_here: bool
    simulate: bool
    seed: int
    steps: int
    guidance_scale: float
    height: int
    width: int
    num_images: int
    images: list[str]
    latents_path: str | None
    stages: list[StageResult]
    split_problems: list[str] = field(default_factory=list)
    split_check: bool = False  # True when the tracer's VirtualDevices check ran during the run
    notices: list[str] = field(default_factory=list)
    images_data: list = field(default_factory=list, repr=False)  # PIL images (not in JSON)
    latents: object = field(default=None, repr=False)

    def device_peaks(self) -> dict[str, tuple[int, int]]:
        """device -> (measured peak over all stages, planned peak over all stages)."""
        out: dict[str, list[int]] = {}
        for stage in self.stages:
            for dev in set(stage.measured_peak) | set(stage.planned_peak):
                entry = out.setdefault(dev, [0, 0])
                entry[0] = max(entry[0], stage.measured_peak.get(dev, 0))
                entry[1] = max(entry[1], stage.planned_peak.get(dev, 0))
        return {dev: (m, p) for dev, (m, p) in out.items()}

    def to_json(self) -> dict:
        return {
            "source": self.source, "pipeline": self.pipeline_class, "demo_random_weights": self.demo,
            "plan_digest": self.plan_digest, "planned_here": self.planned_here, "mode": self.plan.get("mode"),
            "simulate": self.simulate, "seed": self.seed, "steps": self.steps, "guidance_scale": self.guidance_scale,
            "height": self.height, "width": self.width, "num_images": self.num_images, "images": self.images,
            "latents": self.latents_path,
            "stages": [asdict(s) for s in self.stages],
            "devices": {d: {"measured_peak_bytes": m, "planned_peak_bytes": p} for d, (m, p) in self.device_peaks().items()},
            "split_check": self.split_check, "split_problems": self.split_problems, "notices": self.notices,
        }


# --- plan handling -------------------------------------------------------------------------


def _quiet_libraries() -> None:
    """dmap prints its own progress and summary: the libraries' load bars and advice would drown it."""
    import transformers

    transformers.utils.logging.set_verbosity_error()  # diffusers' import triggers transformers warnings
    transformers.utils.logging.disable_progress_bar()
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()


def plan_digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_plan_file(path: str) -> dict:
    from .plan import load_plan

    return load_plan(path).to_json()


def make_run_plan(source, request: RunRequest, inputs: InputSpec) -> dict:
    """Plan with dmap's planner (`dm_cli.plan.make_plan`) for these inputs and devices."""
    from .plan import PlanOptions, make_plan
    from .units import parse_dtype

    options = PlanOptions(max_memory=request.max_memory, strategy=request.device_map, mode=request.mode,
                          overhead=request.overhead,
                          inputs=inputs, dtype=parse_dtype(request.dtype) if request.dtype else None,
                          weights=request.weights)
    try:
        plan = make_plan(str(source.root), options).to_json()
    except DoesNotFitError as error:  # name the SOURCE as the user gave it (the demo is a cache path)
        raise DoesNotFitError(str(error).replace(str(source.root), source.spec), error.details) from None
    plan["source"] = source.spec
    return plan


def check_plan_matches(plan: dict, source, inputs: InputSpec, dtype: str | None, where: str,
                       weights: str | None = None) -> None:
    """A plan made for another model, other inputs, another dtype or other weight storage is refused, not run."""
    digest = plan.get("config_digest") or plan.get("source_digest")
    ours = config_digest(source)
    names = {c.name for c in source.components}
    planned = set(plan.get("components", {}))
    if digest is not None and digest != ours:
        raise UsageError(
            f"{where} was made for another model (config digest {digest}, this SOURCE has {ours}): "
            f"plan again with dmap plan {source.spec} --output PLAN.json."
        )
    if planned != names:
        raise UsageError(
            f"{where} places components {sorted(planned)} but {source.spec} has {sorted(names)}: it is a plan for another model."
        )
    for name, comp in plan["components"].items():
        cls = comp.get("class")
        actual = next(c.cls for c in source.components if c.name == name)
        if cls and cls != "?" and cls != actual:
            raise UsageError(f"{where} plans '{name}' as {cls} but {source.spec} has {actual}: it is a plan for another model.")
    planned_inputs = plan.get("inputs") or {}
    for key, value in (("height", inputs.height), ("width", inputs.width),
                       ("batch_size", inputs.batch_size), ("num_images", inputs.num_images)):
        if key in planned_inputs and planned_inputs[key] not in (None, value) and planned_inputs[key] != 0:
            raise UsageError(
                f"{where} was made for {key}={planned_inputs[key]}, this run asks for {value}: "
                f"pass --{key.replace('_', '-')} {planned_inputs[key]} or plan again for these inputs."
            )
    if dtype and plan.get("dtype") and parse_dtype(dtype) != plan["dtype"]:
        raise UsageError(f"{where} was made for {plan['dtype']}, this run asks for {dtype}: drop --dtype or plan again.")
    if weights is not None:
        from .weight_formats import parse_weights_spec, storage_dtype

        asked = parse_weights_spec(weights, sorted(names))
        for name, fmt in asked.items():
            planned = plan["components"][name].get("storage_dtype") or plan.get("dtype")
            wanted = storage_dtype(fmt, plan.get("dtype"))
            if planned != wanted:
                raise UsageError(f"{where} stores '{name}' as {planned}, this run asks for {wanted}: "
                                 f"drop --weights or plan again with --weights {weights}.")


def plan_devices(plan: dict) -> set[str]:
    devices = set()
    for comp in plan["components"].values():
        for dev in comp["device_map"].values():
            devices.add(str(dev))
    return devices


def check_devices_present(plan: dict) -> None:
    """Without --simulate, every device the plan names must exist here."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for dev in sorted(plan_devices(plan)):
        if dev in ("cpu", "disk"):
            continue
        if dev == "mps":
            if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
                raise UsageError("The plan places weights on mps, which this machine lacks: add --simulate to run it on the CPU.")
            continue
        if int(dev) >= gpus:
            raise UsageError(
                f"The plan places weights on GPU {dev} but this machine has {gpus} GPU(s): add --simulate to run "
                "it on the CPU with the split check, or plan for this machine (omit --max-memory)."
            )


# --- memory measurement --------------------------------------------------------------------


class MemoryMeter:
    """Tracked bytes per (virtual) device: weights by the plan's map, activations by the module running.

    Weights are registered as weak references when a component loads, so `resident()` shows what is
    really still alive (a freed component drops to zero only if nothing holds it). Activations are
    counted by a dispatch mode between `start()` and `stop()`: a storage's bytes when an op creates
    it, charged to the device of the innermost mapped module running, returned when the storage
    dies (a weak reference on the storage itself, so views cost one dict lookup). The mode costs
    Python work on every op, so the runner keeps it on for encode, decode and only the FIRST
    denoising step: every step runs the same graph on the same shapes, so its peak is the stage's.
    CUDA devices in a real run report `torch.cuda.max_memory_allocated` instead.
    """

    def __init__(self):
        self._weights: dict[str, list[tuple[weakref.ref, int]]] = defaultdict(list)
        self._weight_ptrs: set[int] = set()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self._storages: dict[tuple, tuple] = {}  # (device type, index, data_ptr) -> (bytes, device, weakref)
        self.current: list[str] = ["cpu"]
        self._mode = None
        self.tracking = False

    def register_weights(self, model, device_map: dict, default_device: str) -> None:
        entries = sorted(((k, str(v)) for k, v in device_map.items()), key=lambda kv: -len(kv[0]))
        seen: set[int] = set()
        tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        for name, outer in tensors:
            if outer is None or outer.device.type == "meta":
                continue
            for tensor in _plain_tensors(outer):
                ptr = tensor.untyped_storage().data_ptr()
                if ptr in seen or ptr == 0:
                    continue
                seen.add(ptr)
                self._weight_ptrs.add(ptr)
                device = default_device
                for prefix, dev in entries:
                    if prefix == "" or name == prefix or name.startswith(prefix + "."):
                        device = dev
                        break
                self._weights[device].append((weakref.ref(tensor), tensor.untyped_storage().nbytes()))

    def resident(self) -> dict[str, int]:
        """Bytes of registered weights still alive (call after gc.collect() to see frees)."""
        out = {}
        for device, refs in self._weights.items():
            alive = [(r, n) for r, n in refs if r() is not None]
            self._weights[device] = alive
            out[device] = sum(n for _, n in alive)
        self._weight_ptrs = {r().untyped_storage().data_ptr() for refs in self._weights.values() for r, _ in refs}
        return out

    def reset_peaks(self) -> None:
        self.peak = defaultdict(int, {d: v for d, v in self.live.items()})

    def start(self) -> None:
        """Count the storages that ops create from now on (until `stop`)."""
        if self._mode is not None:
            self.tracking = True
            return
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

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
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is self._mode:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _track(self, tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._weight_ptrs:
            return
        key = (tensor.device.type, tensor.device.index, ptr)
        if key in self._storages:
            return
        device = self.current[-1]
        size = storage.nbytes()
        self._storages[key] = (size, device, weakref.ref(storage, lambda _ref, key=key: self._release(key)))
        live = self.live[device] = self.live[device] + size
        if live > self.peak[device]:
            self.peak[device] = live

    def _release(self, key) -> None:
        record = self._storages.pop(key, None)
        if record is not None:
            self.live[record[1]] -= record[0]

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


def _plain_tensors(tensor) -> list:
    """The tensors holding memory: the inner ones of a tensor subclass (torchao's int8 data, scales...)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return [tensor]
    return [t for name in flatten(tensor)[0] for t in _plain_tensors(getattr(tensor, name))]


class _RssSampler:
    """Peak resident set size of this process while a block runs (sampled every 2 ms)."""

    def __init__(self):
        import psutil

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
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        rss = self._process.memory_info().rss
        self.peak = max(self.peak, rss)


# --- loading -------------------------------------------------------------------------------


def _execution_device(device_map: dict, simulate: bool):
    """Where a component computes: its first GPU in map order, else the CPU."""
    import torch

    if simulate:
        return torch.device("cpu")
    for dev in device_map.values():
        if isinstance(dev, int) or (isinstance(dev, str) and dev.isdigit()):
            return torch.device("cuda", int(dev))
        if dev == "mps":
            return torch.device("mps")
    return torch.device("cpu")


def _normalise_map(device_map: dict) -> dict:
    return {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in device_map.items()}


def check_component_files(comp) -> int:
    """Headers of a component's safetensors validated; returns the largest shard's size."""
    from .checkpoint import open_checkpoint

    if comp.weights is None:
        raise CheckpointError(
            f"Component '{comp.name}' has no safetensors weights in {comp.folder}: add them (dmap shard converts .bin files) "
            "or pick the folder that has them."
        )
    checkpoint = open_checkpoint(comp.weights, strict=True)
    return max((p.stat().st_size for p in checkpoint.files), default=0)


def load_component(comp, device_map: dict, dtype: str | None, simulate: bool, weights: str | None = None):
    """One component on its planned devices. Under simulate every virtual device is the CPU.

    `weights` (fp8, int8) stores the tensors `weight_formats` names in low precision: such a
    component is always loaded tensor by tensor (`_load_streamed`), each tensor cast on its way to
    its device, so the run dtype copy of the whole component never exists.
    """
    import torch

    torch_dtype = getattr(torch, dtype) if dtype else None
    device_map = _normalise_map(device_map)
    offloaded = any(v in ("cpu", "disk") for v in device_map.values())
    on_accelerator = any(not isinstance(v, str) or v == "mps" for v in device_map.values())
    cpu_only = simulate or not on_accelerator and set(device_map.values()) == {"cpu"}
    if weights == "int8" and offloaded and not cpu_only:
        raise UsageError(
            f"The plan offloads blocks of '{comp.name}' to cpu/disk, which int8 weights cannot be streamed from: "
            f"plan with more GPU memory or with --weights {comp.name}=fp8."
        )
    try:
        if weights is not None:
            model = _load_streamed(comp, device_map, torch_dtype, weights, resident=cpu_only)
        elif cpu_only:
            model = _from_pretrained(comp, {"": "cpu"}, torch_dtype)
        elif offloaded:
            model = _load_streamed(comp, device_map, torch_dtype)
        else:
            model = _from_pretrained(comp, device_map, torch_dtype)
            if len(set(device_map.values())) == 1:
                from accelerate.hooks import AlignDevicesHook, add_hook_to_module

                # Inputs made on another device (embeddings, latents) follow the component.
                add_hook_to_module(model, AlignDevicesHook(execution_device=_execution_device(device_map, False), io_same_device=True))
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        raise CheckpointError(f"Cannot load component '{comp.name}' from {comp.folder}: {error}".rstrip(".") + ".") from error
    model.eval()
    return model


def _component_class(comp):
    import diffusers
    import transformers

    module = diffusers if comp.library == "diffusers" else transformers
    cls = getattr(module, comp.cls, None)
    if cls is None:
        raise SourceError(f"Component '{comp.name}' is a {comp.cls}, which {module.__name__} {module.__version__} lacks.")
    return cls


def _from_pretrained(comp, device_map, torch_dtype):
    cls = _component_class(comp)
    if comp.library == "diffusers":
        return cls.from_pretrained(comp.folder, torch_dtype=torch_dtype, device_map=device_map)
    return cls.from_pretrained(comp.folder, dtype=torch_dtype if torch_dtype is not None else "auto", device_map=device_map)


def _load_streamed(comp, device_map: dict, torch_dtype, weights: str | None = None, resident: bool = False):
    """Build empty, put each tensor on its device, and stream cpu/disk blocks from the ORIGINAL safetensors.

    accelerate's own disk offload re-saves every tensor as .dat; here offloaded blocks are read from
    the checkpoint's shards (mmap) on each use. Each tensor goes stored dtype -> run dtype -> storage
    dtype (fp8 for the tensors `weight_formats` casts), as from_pretrained + enable_layerwise_casting
    would, one tensor at a time. `resident`: everything stays on the CPU (simulated or cpu-only plans).
    """
    import torch
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    from .checkpoint import open_checkpoint
    from .skeleton import skeleton_for_component
    from .weight_formats import CastingWeights, LoadedTensor, apply_fp8, quantize_int8, read_cast

    cls = _component_class(comp)
    clean = {k: v for k, v in comp.config.items() if k not in ("_name_or_path", "transformers_version")}
    with init_empty_weights(include_buffers=False):
        if comp.library == "diffusers":
            model = cls.from_config(clean)
        else:
            model = cls(cls.config_class.from_dict(clean))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    skeleton, _ = skeleton_for_component(comp)
    dtype_name = str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else None
    fp8 = weights if weights == "fp8" else None
    infos = {t.name: t for t in skeleton.tensors}
    aliases = {alias: group[0] for group in skeleton.tie_groups for alias in group[1:]}
    checkpoint = open_checkpoint(comp.weights, strict=True)
    folder = Path(comp.weights).parent
    where = {name: folder / shard for name, shard in checkpoint.tensor_files.items()}
    gpu_main = _execution_device(device_map, False)
    entries = sorted(device_map.items(), key=lambda kv: -len(kv[0]))
    int8_layers = {t.name.rpartition(".")[0] for t in skeleton.tensors if weights == "int8" and "int8" in t.low_precision}
    modules = dict(model.named_modules())

    def placed(name):
        if resident:
            return "cpu"
        for prefix, dev in entries:
            if prefix == "" or name == prefix or name.startswith(prefix + "."):
                return dev
        return "cpu"

    streamed: dict[str, LoadedTensor] = {}
    buffer_names = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + sorted(buffer_names)
    persistent = {t.name for t in skeleton.tensors if t.kind in ("param", "buffer")} | set(aliases)
    handles: dict[str, object] = {}
    for name in names:
        if name not in persistent:
            continue  # non-persistent buffers were built for real by init_empty_weights(include_buffers=False)
        stored = name if name in where else aliases.get(name, name)
        if stored not in where:
            stored = next((a for g in skeleton.tie_groups if name in g for a in g if a in where), stored)
        if stored not in where:
            raise CheckpointError(f"Component '{comp.name}': tensor '{name}' is missing from {comp.weights}.")
        info = infos.get(name) or infos[aliases.get(name, stored)]
        entry = LoadedTensor(name, str(where[stored]), stored, info.dtype_at(dtype_name), info.dtype_at(dtype_name, fp8))
        dev = placed(name)
        if dev in ("cpu", "disk") and not resident and name not in buffer_names:
            streamed[name] = entry
            # the meta tensor takes the storage dtype: accelerate casts each streamed value to it
            storage_dtype = getattr(torch, entry.storage)
            set_module_tensor_to_device(model, name, "meta", value=torch.empty(info.shape, dtype=storage_dtype, device="meta"),
                                        dtype=storage_dtype)
            continue
        handle = handles.get(entry.file) or handles.setdefault(entry.file, safe_open(entry.file, framework="pt", device="cpu"))
        set_module_tensor_to_device(model, name, "cpu" if dev in ("cpu", "disk") else dev, value=read_cast(handle, entry),
                                    dtype=getattr(torch, entry.storage))
        layer, _, leaf = name.rpartition(".")
        if leaf == "weight" and layer in int8_layers:
            quantize_int8(modules[layer])  # this layer's weight only: the run dtype copy lives one tensor long
    handles.clear()
    if fp8:
        apply_fp8(model, torch_dtype)
    if resident:
        return model
    dispatch_map = {k: ("disk" if v in ("cpu", "disk") else v) for k, v in device_map.items()}
    main = gpu_main.index if gpu_main.type == "cuda" else gpu_main.type  # safetensors wants "cpu" or an index
    model = dispatch_model(model, dispatch_map, main_device=main, state_dict=CastingWeights(streamed), offload_index={},
                           offload_buffers=False, force_hooks=True)
    model.hf_device_map = dict(device_map)
    return model


def free_components(models: list) -> None:
    """Hooks off, references dropped, allocator caches emptied: the memory goes back to the device.

    One gc.collect() for all of them. The list is emptied: the caller must hold no other reference.
    """
    import torch

    from accelerate.hooks import remove_hook_from_module

    while models:
        model = models.pop()
        try:
            remove_hook_from_module(model, recurse=True)
        except Exception:  # noqa: BLE001 - a model without hooks
            pass
        for module in model.modules():  # diffusers' hook registries keep the model reachable otherwise
            module.__dict__.pop("_diffusers_hook", None)
        del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- pipelines -----------------------------------------------------------------------------


def _placeholder(comp, torch_dtype):
    """The component on the meta device: its config and dtype for the pipeline, no memory.

    Text encoders get None instead: the pipelines only read them while encoding (when the real one
    is loaded) and, given prompt embeddings, fall back to the denoiser's dtype exactly as the
    diffusers staged recipe (which passes text_encoder=None) does. Building a T5 on meta costs a
    quarter of a second even for the demo, for nothing.
    """
    if comp.name.startswith("text_encoder"):
        return None
    from .skeleton import build_on_meta

    model = build_on_meta(comp.library, comp.cls, comp.config)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    return model


def build_pipeline(source, torch_dtype, placeholders: dict):
    """The pipeline object with tokenizers and scheduler loaded and every model a meta placeholder."""
    import diffusers

    cls = getattr(diffusers, source.pipeline_class)
    params = pyinspect.signature(cls.__init__).parameters
    kwargs = {}
    for name, param in params.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        if name in placeholders:
            kwargs[name] = placeholders[name]
        elif name in source.other_components:
            library, class_name = source.other_components[name]
            kwargs[name] = _load_weightless(source, name, library, class_name)
        elif name == "requires_safety_checker":
            kwargs[name] = bool(source.model_index.get("requires_safety_checker", False))
        elif param.default is pyinspect.Parameter.empty:
            kwargs[name] = None
    staged = type(cls.__name__, (cls,), {"_execution_device": property(lambda self: self._dmap_device)})
    pipe = staged(**kwargs)
    pipe._dmap_device = "cpu"
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _load_weightless(source, name, library, class_name):
    if library is None or class_name is None:
        return None
    folder = source.root / name
    if "Scheduler" in class_name:
        import diffusers

        scheduler_cls = getattr(diffusers, class_name, None)
        if scheduler_cls is None:
            raise SourceError(f"Scheduler {class_name} is not in this diffusers.")
        if not (folder / "scheduler_config.json").is_file():
            raise SourceError(f"The scheduler config of {source.spec} is missing: {folder / 'scheduler_config.json'}.")
        return scheduler_cls.from_pretrained(source.root, subfolder=name)
    if "Tokenizer" in class_name:
        import transformers

        if not folder.is_dir() or not any(folder.iterdir()):
            raise SourceError(
                f"Tokenizer '{name}' of {source.spec} is missing ({folder}): copy the tokenizer folders with the weights."
            )
        try:
            return getattr(transformers, class_name).from_pretrained(folder)
        except (OSError, ValueError, TypeError) as error:
            raise SourceError(f"Tokenizer '{name}' of {source.spec} cannot be loaded from {folder}: {error}") from error
    return None  # feature extractors, image encoders: not used for text-to-image


@dataclass
class Embeds:
    tensors: dict  # kwargs for the pipeline call
    do_cfg: bool


def encode(pipe, pipeline_class: str, prompt: str, negative: str | None, device, num_images: int,
           guidance: float, max_sequence_length: int | None) -> Embeds:
    """The pipeline's own encode_prompt, called as its __call__ would call it."""
    if pipeline_class == "FluxPipeline":
        pe, ppe, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=num_images,
                                        max_sequence_length=max_sequence_length or 512)
        return Embeds({"prompt_embeds": pe, "pooled_prompt_embeds": ppe}, False)
    if pipeline_class == "StableDiffusionPipeline":
        do_cfg = guidance > 1 and pipe.unet.config.time_cond_proj_dim is None
        pe, npe = pipe.encode_prompt(prompt, device, num_images, do_cfg, negative)
        out = {"prompt_embeds": pe}
        if do_cfg:
            out["negative_prompt_embeds"] = npe
        return Embeds(out, do_cfg)
    if pipeline_class == "StableDiffusionXLPipeline":
        do_cfg = guidance > 1 and pipe.unet.config.time_cond_proj_dim is None
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=num_images,
                                                do_classifier_free_guidance=do_cfg, negative_prompt=negative)
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
        if do_cfg:
            out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
        return Embeds(out, do_cfg)
    if pipeline_class == "StableDiffusion3Pipeline":
        do_cfg = guidance > 1
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None, device=device,
                                                num_images_per_prompt=num_images, do_classifier_free_guidance=do_cfg,
                                                negative_prompt=negative, max_sequence_length=max_sequence_length or 256)
        out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
        if do_cfg:
            out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
        return Embeds(out, do_cfg)
    raise UsageError(f"dmap run does not support {pipeline_class}.")


def decode(pipe, pipeline_class: str, latents, height: int, width: int, device):
    """The pipeline's own decode tail (unpack, unscale, VAE decode, postprocess to PIL)."""
    import torch

    vae = pipe.vae
    if pipeline_class == "FluxPipeline":
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    elif pipeline_class == "StableDiffusion3Pipeline":
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    elif pipeline_class == "StableDiffusionXLPipeline":
        needs_upcasting = vae.dtype == torch.float16 and vae.config.force_upcast
        if needs_upcasting:
            pipe.upcast_vae()
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
    else:
        latents = latents / vae.config.scaling_factor
    image = vae.decode(latents.to(device), return_dict=False)[0]
    if pipeline_class == "StableDiffusionXLPipeline" and getattr(pipe, "watermark", None) is not None:
        image = pipe.watermark.apply_watermark(image)
    kwargs = {"do_denormalize": [True] * image.shape[0]} if pipeline_class == "StableDiffusionPipeline" else {}
    return pipe.image_processor.postprocess(image, output_type="pil", **kwargs)


def _call_default(pipeline_class: str, name: str):
    import diffusers

    param = pyinspect.signature(getattr(diffusers, pipeline_class).__call__).parameters.get(name)
    return None if param is None or param.default is pyinspect.Parameter.empty else param.default


# --- the run -------------------------------------------------------------------------------


def size_multiple(pipeline_class: str, vae_scale: int, denoiser_config: dict) -> int:
    """What height and width must be multiples of, as the pipeline's own check_inputs demands."""
    if pipeline_class == "FluxPipeline":
        return vae_scale * 2  # latents are packed 2x2
    if pipeline_class == "StableDiffusion3Pipeline":
        return vae_scale * int((denoiser_config or {}).get("patch_size", 2))
    return math.lcm(8, vae_scale)  # StableDiffusion(XL)Pipeline.check_inputs: divisible by 8


def check_image_size(pipeline_class: str, height: int, width: int, vae_scale: int, denoiser_config: dict) -> None:
    multiple = size_multiple(pipeline_class, vae_scale, denoiser_config)
    for flag, value in (("--height", height), ("--width", width)):
        if value < multiple or value % multiple:
            lower = max(multiple, value - value % multiple)
            raise UsageError(
                f"{flag} {value} is not a multiple of {multiple}, which {pipeline_class} needs for this model: "
                f"use {lower} or {lower + multiple}."
            )


def prepare(request: RunRequest):
    """Resolve SOURCE (the demo when None), refuse what cannot run, and settle every default."""
    from .sources import resolve_source

    demo = request.source is None
    notices = []
    if demo:
        from .demo import DEMO_DEFAULTS, DEMO_NOTICE, ensure_demo

        source = resolve_source(str(ensure_demo()))
        source.spec = "demo"
        notices.append(DEMO_NOTICE)
        defaults = DEMO_DEFAULTS
    else:
        source = resolve_source(request.source)
        defaults = {}
    if source.kind != "pipeline":
        raise UsageError(f"dmap run needs a pipeline folder (model_index.json); {request.source} is a single {source.kind}.")
    if source.pipeline_class not in SUPPORTED_PIPELINES:
        raise UsageError(
            f"dmap run does not support {source.pipeline_class}: it runs {', '.join(SUPPORTED_PIPELINES)}."
        )
    if request.negative_prompt and source.pipeline_class == "FluxPipeline":
        raise UsageError("FLUX pipelines ignore negative prompts (guidance is distilled): drop --negative-prompt.")
    if request.num_images < 1:
        raise UsageError("--num-images must be at least 1.")
    return source, demo, defaults, notices


def run(request: RunRequest, on_plan: Callable[[dict], None] | None = None,
        on_step: Callable[[int, int], None] | None = None) -> RunResult:
    """Plan (or read and check a plan), then encode -> denoise -> decode following it.

    With torch, diffusers and transformers imported, a full garbage collection walks ~400k objects
    (~0.2 s on a laptop core), and allocations trigger them anywhere: an import, a load, a step.
    Everything alive before the stages (libraries, placeholders, tokenizers, the plan) is frozen out
    of the collector for the run, so collections only look at what the run makes, and what the
    stages free is still collected. Unfrozen at the end (unless the caller had frozen first).
    """
    # before the libraries' first import: some of them warn while importing (torchvision fallbacks)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    owner = gc.get_freeze_count() == 0
    if owner:
        gc.freeze()
    try:
        return _run(request, on_plan, on_step, owner)
    finally:
        if owner:
            gc.unfreeze()


def _run(request: RunRequest, on_plan, on_step, freeze: bool) -> RunResult:
    source, demo, defaults, notices = prepare(request)
    cls_name = source.pipeline_class

    # Settle the inputs first: the plan is made for (and checked against) them.
    denoiser = next((c for c in source.components if c.name in DENOISERS), None)
    vae = next((c for c in source.components if c.name == "vae"), None)
    if denoiser is None or vae is None:
        raise SourceError(f"{source.spec} has no denoiser (transformer/unet) or no vae: dmap run needs both.")
    scale = 2 ** (len(vae.config.get("block_out_channels", [0, 0, 0, 0])) - 1)
    default_size = int(denoiser.config.get("sample_size", 64)) * scale
    if cls_name == "FluxPipeline":
        default_size = 128 * scale
    height = request.height or defaults.get("height") or default_size
    width = request.width or defaults.get("width") or default_size
    check_image_size(cls_name, height, width, scale, denoiser.config)  # before any heavy import: a quick exit 2
    steps = request.steps or defaults.get("steps") or _call_default(cls_name, "num_inference_steps") or 28
    guidance = request.guidance_scale if request.guidance_scale is not None else (
        defaults.get("guidance_scale") or _call_default(cls_name, "guidance_scale") or 1.0)
    max_seq = request.max_sequence_length or defaults.get("max_sequence_length") or _call_default(cls_name, "max_sequence_length")
    inputs = InputSpec(height=height, width=width, batch_size=1, num_images=request.num_images,
                       guidance_scale=guidance, max_sequence_length=max_seq)

    _quiet_libraries()
    # missing or corrupt weights are bad input: say so before spending time on a plan
    largest = {c.name: check_component_files(c) for c in source.components}
    is_file = request.device_map.endswith(".json") or Path(request.device_map).is_file()
    if is_file:
        plan = read_plan_file(request.device_map)
        check_plan_matches(plan, source, inputs, request.dtype, request.device_map, request.weights)
    else:
        if request.device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise UsageError(f"--device-map must be auto, balanced, balanced_low_0, sequential or a plan JSON file, not '{request.device_map}'.")
        plan = make_run_plan(source, request, inputs)
    if on_plan is not None:
        on_plan(plan)
    if not request.simulate:
        check_devices_present(plan)

    import torch

    dtype = plan.get("dtype")
    torch_dtype = getattr(torch, dtype) if dtype else None
    digest = plan_digest(plan)
    result = RunResult(
        source=source.spec, pipeline_class=cls_name, demo=demo, plan=plan, plan_digest=digest, planned_here=not is_file,
        simulate=request.simulate, seed=request.seed, steps=steps, guidance_scale=guidance, height=height, width=width,
        num_images=request.num_images, images=[], latents_path=None, stages=[], notices=notices,
    )
    comps = {c.name: c for c in source.components}
    weights = {n: format_of(c.get("storage_dtype")) for n, c in plan["components"].items()}
    placeholders = {name: _placeholder(comps[name], torch_dtype) for name in plan["components"]}
    pipe = build_pipeline(source, torch_dtype, placeholders)
    meter = MemoryMeter()
    loaded: dict[str, object] = {}
    hooks: dict[str, list] = {}
    checkers: dict[str, object] = {}
    cuda_used = not request.simulate and torch.cuda.is_available()

    def load(names: list[str], stage: StageResult) -> None:
        with _RssSampler() as rss:
            for name in names:
                cmap = plan["components"][name]["device_map"]
                model = load_component(comps[name], cmap, dtype, request.simulate, weights.get(name))
                default_dev = str(next(iter(cmap.values())))
                meter.register_weights(model, cmap, default_dev)
                hooks[name] = meter.attach(model, cmap, default_dev)
                if request.simulate:
                    checkers[name] = _virtual_devices(model, cmap)
                    result.split_check = result.split_check or checkers[name] is not None
                    hooks[name] += _check_each_forward(model, checkers[name], name, result.split_problems)
                loaded[name] = model
                setattr(pipe, name, model)
        stage.load_rss_delta = rss.peak - rss.start
        stage.largest_shard = max([largest.get(n, 0) for n in names] + [stage.largest_shard])

    def unload(names: list[str]) -> None:
        models = []
        for name in names:
            for handle in hooks.pop(name, []):
                handle.remove()
            checkers.pop(name, None)
            setattr(pipe, name, placeholders[name])
            models.append(loaded.pop(name))
        free_components(models)
        del models

    staged = plan.get("mode", "staged") != "resident"
    stages = plan["stages"]
    latents = None
    embeds = None
    images = []
    if freeze:  # what the stages free is collected without walking the libraries (see run())
        gc.freeze()
    try:
        if not staged:
            first = StageResult("load", sorted(plan["components"]))
            t0 = time.perf_counter()
            first.resident_before = meter.resident()
            load(list(plan["components"]), first)
            first.load_s = first.wall_s = time.perf_counter() - t0
            first.resident_after_load = meter.resident()
            result.stages.append(first)
        for stage_plan in stages:
            name = stage_plan["name"]
            stage = StageResult(name, list(stage_plan["components"]), planned_peak={
                str(k): int(v) for k, v in stage_plan.get("peak_bytes", {}).items()})
            t0 = time.perf_counter()
            stage.resident_before = meter.resident()
            if staged:
                load(stage.components, stage)
            stage.load_s = time.perf_counter() - t0
            stage.resident_after_load = meter.resident()
            meter.reset_peaks()
            if cuda_used:
                for i in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(i)
            t1 = time.perf_counter()
            first_map = plan["components"][stage.components[0]]["device_map"] if stage.components else {"": "cpu"}
            meter.current[:] = [str(next(iter(first_map.values())))]
            track = not cuda_used or any(
                _execution_device(plan["components"][c]["device_map"], False).type == "cpu" for c in stage.components)
            stage.tracked = "all" if track else "none (CUDA: max_memory_allocated)"
            try:
                with torch.inference_mode(False), torch.no_grad():
                    if track:
                        meter.start()
                    if name == "encode":
                        embeds = _run_encode(pipe, plan, stage.components, cls_name, request, inputs, guidance, max_seq, meter)
                    elif name == "denoise":
                        latents = _run_denoise(pipe, plan, stage.components, embeds, steps, guidance, height, width,
                                               request, max_seq, on_step, meter)
                        embeds = None
                        if track and TRACKED_STEPS is not None and steps > TRACKED_STEPS:
                            stage.tracked = f"first {TRACKED_STEPS} of {steps} steps"
                    elif name == "decode":
                        device = _execution_device(plan["components"]["vae"]["device_map"], request.simulate)
                        meter.current.append(str(next(iter(plan["components"]["vae"]["device_map"].values()))))
                        images = decode(pipe, cls_name, latents, height, width, device)
                        meter.current.pop()
                    else:
                        raise UsageError(f"The plan has a stage '{name}' that dmap run does not know (encode, denoise, decode).")
                    meter.stop()
            except torch.OutOfMemoryError as error:
                raise _oom(error, name, stage.planned_peak, request) from None
            except MemoryError:
                raise DoesNotFitError(
                    f"Out of host memory during {name} (planned cpu peak {format_size(stage.planned_peak.get('cpu', 0))}): "
                    "lower cpu= in --max-memory to what is really free and plan again."
                ) from None
            stage.run_s = time.perf_counter() - t1
            resident = stage.resident_after_load
            stage.measured_peak = {d: resident.get(d, 0) + meter.peak.get(d, 0)
                                   for d in set(resident) | set(meter.peak) if resident.get(d, 0) + meter.peak.get(d, 0)}
            if cuda_used:
                for i in range(torch.cuda.device_count()):
                    stage.measured_peak[str(i)] = torch.cuda.max_memory_allocated(i)
            if staged:
                unload(stage.components)
            stage.wall_s = time.perf_counter() - t0
            result.stages.append(stage)
    finally:
        meter.stop()  # an interrupted stage may have left the tracker on
        if loaded:
            unload(list(loaded))
    if latents is None or not images:
        raise UsageError("The plan has no denoise or decode stage: nothing was generated.")
    result.images_data = images
    result.latents = latents.detach().to("cpu")
    if request.save_latents:
        result.latents_path = save_latents(result.latents, request.save_latents, _metadata(result, request))
    if request.output:
        result.images = save_images(images, request.output, _metadata(result, request))
    return result


def _run_encode(pipe, plan, names, cls_name, request, inputs, guidance, max_seq, meter):
    enc_map = plan["components"][names[0]]["device_map"] if names else {"": "cpu"}
    device = _execution_device(enc_map, request.simulate)
    pipe._dmap_device = device
    return encode(pipe, cls_name, request.prompt, request.negative_prompt, device, inputs.num_images, guidance, max_seq)


def _run_denoise(pipe, plan, names, embeds, steps, guidance, height, width, request, max_seq, on_step, meter):
    import torch

    if embeds is None:
        raise UsageError("The plan runs denoise before encode: the stages are out of order.")
    den_map = plan["components"][names[0]]["device_map"]
    device = _execution_device(den_map, request.simulate)
    pipe._dmap_device = device
    kwargs = {k: v.to(device) for k, v in embeds.tensors.items()}
    call_params = pyinspect.signature(type(pipe).__call__).parameters
    if "max_sequence_length" in call_params and max_seq:
        kwargs["max_sequence_length"] = max_seq

    def step_end(_pipe, step, _t, callback_kwargs):
        if TRACKED_STEPS is not None and step + 1 == TRACKED_STEPS:
            meter.stop()  # later steps repeat this one's graph on the same shapes: its peak is the stage's
        if on_step is not None:
            on_step(step + 1, steps)
        return callback_kwargs

    out = pipe(
        prompt=None, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
        num_images_per_prompt=1, generator=torch.Generator().manual_seed(request.seed), output_type="latent",
        callback_on_step_end=step_end, **kwargs,
    )
    return out.images


def _virtual_devices(model, device_map):
    """The tracer's split check on a component (dm_cli.trace.VirtualDevices), when it exists."""
    try:
        from .trace import VirtualDevices
    except ImportError:
        return None
    return VirtualDevices(model, device_map)


def _check_each_forward(model, checker, name: str, problems: list[str]) -> list:
    """The split check is active during each forward of the component (not the pipeline's glue around it)."""
    if checker is None:
        return []

    def pre(_module, _args):
        checker.__enter__()

    def post(_module, _args, _out):
        checker.__exit__(None, None, None)
        for problem in checker.problems:
            entry = f"{name}: {problem}"
            if entry not in problems:
                problems.append(entry)

    return [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]


def _oom(error, stage: str, planned: dict, request: RunRequest) -> DoesNotFitError:
    import re

    import torch

    match = re.search(r"GPU (\d+)", str(error))
    gpu = match.group(1) if match else "0"
    actual = torch.cuda.max_memory_allocated(int(gpu)) if torch.cuda.is_available() else 0
    plan_peak = planned.get(gpu, 0)
    smaller = int(plan_peak * 0.9) if plan_peak else 0
    hint = f"plan again with {gpu}={format_size(smaller)} in --max-memory" if smaller else "plan again with a smaller --max-memory for it"
    return DoesNotFitError(
        f"Out of memory on GPU {gpu} during {stage}: planned {format_size(plan_peak)}, reached {format_size(actual)} before "
        f"failing; {hint} so the plan keeps more room free.",
        {"stage": stage, "device": gpu, "planned_bytes": plan_peak, "actual_bytes": actual},
    )


# --- outputs -------------------------------------------------------------------------------


def _metadata(result: RunResult, request: RunRequest) -> dict[str, str]:
    meta = {
        "prompt": request.prompt, "seed": str(result.seed), "steps": str(result.steps),
        "guidance_scale": str(result.guidance_scale), "source": result.source, "pipeline": result.pipeline_class,
        "height": str(result.height), "width": str(result.width), "plan_digest": result.plan_digest,
        "dmap_version": __version__,
    }
    if request.negative_prompt:
        meta["negative_prompt"] = request.negative_prompt
    if result.demo:
        meta["weights"] = "random (dmap demo pipeline)"
    return meta


def image_paths(output: str, count: int) -> list[Path]:
    path = Path(output)
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}") for i in range(count)]


def save_images(images: list, output: str, metadata: dict[str, str]) -> list[str]:
    """PNG with text metadata, each written to a temp file beside it and renamed when complete."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(key, value)
    written = []
    for image, path in zip(images, image_paths(output, len(images))):
        _atomic_write(path, lambda tmp, image=image: image.save(tmp, format="PNG", pnginfo=info))
        written.append(str(path))
    return written


def save_latents(latents, output: str, metadata: dict[str, str]) -> str:
    from safetensors.torch import save_file

    path = Path(output)
    _atomic_write(path, lambda tmp: save_file({"latents": latents.contiguous()}, tmp, metadata=metadata))
    return str(path)


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    if path.parent and not path.parent.exists():
        raise UsageError(f"Cannot write {path}: folder {path.parent} does not exist.")
    atomic_write(path, write)

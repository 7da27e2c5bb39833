"""Meta-device forward passes: execution order, activation peaks and cross-device checks.

One engine (`_Session`, trace_session.py) runs a component's forward under a torch dispatch mode and module hooks:
- it records the order in which modules holding weights first run (UNets run down -> mid -> up,
  not in registration order);
- it counts live activation bytes per storage (`LiveStorages`: added when an op creates a storage,
  removed when the storage dies) and the peak while each module runs. On meta, scaled-dot-product
  attention decomposes and materialises the n^2 matrix that the CPU/CUDA fused kernels never
  allocate, so it is replaced by an empty output of the right shape;
- it tags every tensor with a virtual device (or, to find unsplittable modules, with the module it
  came from) and reports ops that combine tensors of two tags, moving inputs at module boundaries
  as accelerate's AlignDevicesHook does.

torch is imported inside functions only: `dmap --help` must not pay for it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from dm_cli.errors import SourceError
from dm_cli.families import call_spec
from dm_cli.families.calls import CallSpec, TensorSpec, generic_argument
from dm_cli.inputs import InputSpec
from dm_cli.io.cache import cache_key, read_cached, write_cached
from dm_cli.model.skeleton import _fp32_rules, _fp32_when, build_on_meta, guess_library, skeleton_for_component
from dm_cli.planning.trace.trace_session import _META, _Session
from dm_cli.units import parse_dtype

if TYPE_CHECKING:  # annotations only
    from dm_cli.model.sources import ComponentSource

TRACE_FORMAT_VERSION = 11  # 2: lists given to modules are no longer copied (the Wan VAE cache); 3: weightless
# modules are no provenance boundary; 4: they are again, and the planner gives a hook (a device_map key) to each
# one a split module's forward combines (LTX-2's norm_out); 5: module_outputs (a LoRA's transients scale with them);
# 6: work (FLOPs, bytes, ops: the step-time prediction); 7: work counts attention's query rows and convolutions apart;
# 8: and the work outside the block lists (every pipeline rank's); 9: the peaks on a GPU (gpu_kernels.py); 10: the
# elementwise work as a compiler fuses it (fused_bytes, fused_kernels: --compile's predicted step); 11: attention's
# FLOPs at the width the GPU's kernel computes (attention_kernel_flops: flash's built head dims)
WEIGHTS_ONLY_SIZE = 64  # pixels: order and split checks do not depend on size; small fits every model (tiny SD3 pos_embed too)


@dataclass
class ComponentTrace:
    execution_order: list[str]  # modules holding tensors directly, in first-call order, then never-called ones
    module_peaks: dict[str, int]  # module prefix -> peak live activation bytes while its forward ran
    activation_peak: int  # peak live activation bytes over the whole call (weights excluded)
    unsplittable: list[str]  # modules (not the root) whose own forward combines tensors of two children,
    # or of a child and its own inputs: splitting their children across devices fails
    fallback_warning: str | None = None  # set when no forward could run and registration order was used
    same_device_groups: dict[str, list[list[str]]] = field(default_factory=dict)  # module -> groups of its
    # children (or itself: its inputs/own tensors) that its forward combines: each group must share a device
    inputs: dict = field(default_factory=dict)  # the call that was traced (method, argument shapes)
    dtype: str = ""  # dtype the component ran in
    seconds: float = 0.0  # time the trace took (0 when it came from the cache)
    module_outputs: dict[str, int] = field(default_factory=dict)  # module prefix -> bytes of its largest output
    work: dict[str, int] = field(default_factory=dict)  # the call's FLOPs, memory-bound bytes and ops (_Session.work)
    # the same call on a GPU: allocator blocks, and what its kernels hold beside their outputs (gpu_kernels.py)
    gpu_module_peaks: dict[str, int] = field(default_factory=dict)
    gpu_activation_peak: int = 0
    gpu_peak_at: dict = field(default_factory=dict)  # module, op and kernel bytes at the GPU peak
    attention_backends: dict[str, int] = field(default_factory=dict)  # the GPU's attention kernel -> calls

    def to_json(self) -> dict:
        return {
            "format": "dmap-trace",
            "version": TRACE_FORMAT_VERSION,
            "execution_order": self.execution_order,
            "module_peaks": self.module_peaks,
            "activation_peak": self.activation_peak,
            "unsplittable": self.unsplittable,
            "fallback_warning": self.fallback_warning,
            "same_device_groups": self.same_device_groups,
            "inputs": self.inputs,
            "dtype": self.dtype,
            "seconds": self.seconds,
            "module_outputs": self.module_outputs,
            "work": self.work,
            "gpu_module_peaks": self.gpu_module_peaks,
            "gpu_activation_peak": self.gpu_activation_peak,
            "gpu_peak_at": self.gpu_peak_at,
            "attention_backends": self.attention_backends,
        }

    @classmethod
    def from_json(cls, data: dict) -> "ComponentTrace":
        if data.get("format") != "dmap-trace" or data.get("version") != TRACE_FORMAT_VERSION:
            raise ValueError("not a current dmap trace")
        return cls(
            execution_order=list(data["execution_order"]),
            module_peaks={k: int(v) for k, v in data["module_peaks"].items()},
            activation_peak=int(data["activation_peak"]),
            unsplittable=list(data["unsplittable"]),
            fallback_warning=data.get("fallback_warning"),
            same_device_groups={k: [list(g) for g in v] for k, v in data.get("same_device_groups", {}).items()},
            inputs=dict(data.get("inputs", {})),
            dtype=data.get("dtype", ""),
            seconds=float(data.get("seconds", 0.0)),
            module_outputs={k: int(v) for k, v in data.get("module_outputs", {}).items()},
            work={k: int(v) for k, v in data.get("work", {}).items()},
            gpu_module_peaks={k: int(v) for k, v in data.get("gpu_module_peaks", {}).items()},
            gpu_activation_peak=int(data.get("gpu_activation_peak", 0)),
            gpu_peak_at=dict(data.get("gpu_peak_at", {})),
            attention_backends={k: int(v) for k, v in data.get("attention_backends", {}).items()},
        )


# --- building the model and its inputs ---------------------------------------------------------


_MODEL_CACHE: "OrderedDict[str, object]" = OrderedDict()
_MODEL_CACHE_SIZE = 3


def _meta_model(comp: ComponentSource, dtype: str):
    """The component on meta, cast as loading casts it; a few kept in memory for repeated checks."""
    library = comp.library or guess_library(comp.cls)
    key = json.dumps([library, comp.cls, comp.config, dtype], sort_keys=True, default=str)
    model = _MODEL_CACHE.get(key)
    if model is not None:
        _MODEL_CACHE.move_to_end(key)
        return model
    model = build_on_meta(library, comp.cls, comp.config or {})
    cast_like_loading(model, library, dtype)
    model.eval()
    _MODEL_CACHE[key] = model
    while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return model


def cast_like_loading(model, library: str | None, dtype: str) -> None:
    """Floating tensors to `dtype`, keep-in-fp32 modules in float32, integer buffers untouched."""
    import torch  # here only: importing this module stays torch-free

    rules = _fp32_rules(model, library or "")
    for prefix, module in model.named_modules():
        for collection in (module._parameters, module._buffers):
            for name, tensor in list(collection.items()):
                if tensor is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                if tensor.is_floating_point():
                    target = "float32" if dtype in _fp32_when(full, rules) else dtype
                    tensor.data = tensor.data.to(getattr(torch, target))
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.requires_grad_(False)


def _materialise(value, dtype, device):
    import torch  # here only: importing this module stays torch-free

    if isinstance(value, TensorSpec):
        fixed = {"long": torch.long, "bool": torch.bool, "float32": torch.float32}.get(value.kind)
        return torch.zeros(value.shape, dtype=fixed or dtype, device=device)
    if isinstance(value, dict):
        return {k: _materialise(v, dtype, device) for k, v in value.items()}
    return value


def _generic_call(model, comp: ComponentSource, inputs: InputSpec) -> CallSpec | None:
    """Plausible arguments for an unknown model's forward, from its signature and config."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = generic_argument(name, comp, inputs)
        if value is None:
            if parameter.default is parameter.empty:
                return None
            continue
        if name == "return_dict" and parameter.default is parameter.empty:
            continue
        kwargs[name] = value
    if not any(isinstance(v, TensorSpec) for v in kwargs.values()):
        return None
    return CallSpec("forward", kwargs, description="generic inputs from the forward signature")


def _full_config(model, comp: ComponentSource) -> dict:
    """The built model's config (class defaults filled in) over the component's config.json."""
    config = getattr(model, "config", None)
    if config is None:
        return dict(comp.config or {})
    full = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    full.update(comp.config or {})
    return full


def _resolve_call(model, comp: ComponentSource, pipeline_class, inputs: InputSpec) -> CallSpec | None:
    spec = call_spec(comp, pipeline_class, inputs)
    if spec is None:
        spec = _generic_call(model, dataclasses.replace(comp, config=_full_config(model, comp)), inputs)
    return spec


def _run(model, spec: CallSpec, dtype: str, session: _Session):
    """Build the inputs inside the session (so they count as activations) and call the component."""
    import torch  # here only: importing this module stays torch-free

    device = next((p.device for p in model.parameters()), torch.device("meta"))
    with torch.no_grad(), session:
        session.enter_module("")
        try:
            kwargs = _materialise(spec.kwargs, getattr(torch, dtype), device)
            root_device = session.recolor.get("")
            if root_device is not None:  # accelerate's root hook: inputs go to the main device
                kwargs = session._move(kwargs, root_device)
            method = model if spec.method == "forward" else getattr(model, spec.method)
            output = method(**kwargs)
            del kwargs
            return output
        finally:
            session.exit_module("")


# --- public API --------------------------------------------------------------------------------


def _trace_key(comp: ComponentSource, pipeline_class, spec_shapes, dtype, weights_only, tiled=False) -> str:
    return cache_key({"library": comp.library, "class": comp.cls, "config": comp.config, "pipeline": pipeline_class,
                      "call": spec_shapes, "dtype": dtype, "weights_only": weights_only, "tiled": tiled,
                      "format": TRACE_FORMAT_VERSION})


def _weights_only_shape(inputs: InputSpec) -> InputSpec:
    """Small inputs for a weights-only trace (order and split checks do not depend on size); 5 frames for video."""
    return InputSpec(WEIGHTS_ONLY_SIZE, WEIGHTS_ONLY_SIZE, 1, 1, inputs.guidance_scale, inputs.max_sequence_length,
                     5 if inputs.num_frames else None)


def compute_dtype(spec: CallSpec | None, dtype: str) -> str:
    """The dtype the component runs in (an fp16 SDXL VAE decodes in fp32)."""
    if spec is not None and spec.upcast_fp16 and dtype == "float16":
        return "float32"
    return dtype


def trace_component(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str,
                    use_cache: bool = True, tiled: bool = False,
                    on_progress: Callable[[str], None] | None = None) -> ComponentTrace:
    """Execution order, activation peaks and unsplittable modules of one component for `inputs`.

    `tiled`: the same call with diffusers' tiling enabled on the model (`enable_tiling()`, a VAE's tiled
    decode); a model that cannot tile gets a `fallback_warning`. Cached in `cache_dir()/traces/` keyed by
    config, class, call shapes, dtype, tiling and library versions. `on_progress(message)` hears which
    trace runs (or that it came from the cache) before it starts.
    """
    dtype = _torch_dtype_name(dtype, comp)
    weights_only = inputs.weights_only
    shape_inputs = _weights_only_shape(inputs) if weights_only else inputs
    spec = call_spec(comp, pipeline_class, shape_inputs)
    run_dtype = compute_dtype(spec, dtype)
    key = _trace_key(comp, pipeline_class, spec.shapes() if spec else "generic:" + json.dumps(shape_inputs.to_json()),
                     run_dtype, weights_only, tiled)
    cached = read_cached("traces", key) if use_cache else None
    if cached is not None:
        try:
            trace = ComponentTrace.from_json(cached)
            trace.seconds = 0.0
            if on_progress is not None:
                on_progress(f"{comp.name} ({comp.cls}): {'tiled ' if tiled else ''}trace read from the cache")
            return trace
        except Exception:  # noqa: BLE001 - a damaged entry of any shape is rebuilt, never an error
            pass
    if on_progress is not None:
        on_progress(trace_message(comp, spec, shape_inputs, tiled))
    start = time.perf_counter()
    trace = _trace_uncached(comp, pipeline_class, shape_inputs, run_dtype, tiled)
    if weights_only:
        trace.activation_peak = 0
        trace.module_peaks = dict.fromkeys(trace.module_peaks, 0)
        trace.module_outputs = {}
        trace.gpu_activation_peak, trace.gpu_peak_at = 0, {}
        trace.gpu_module_peaks = dict.fromkeys(trace.gpu_module_peaks, 0)
    trace.seconds = round(time.perf_counter() - start, 3)
    if use_cache and trace.fallback_warning is None:
        write_cached("traces", key, trace.to_json())
    return trace


def trace_message(comp: ComponentSource, spec: CallSpec | None, inputs: InputSpec, tiled: bool = False) -> str:
    """What a trace about to run is, for progress: component, class and the call (shapes)."""
    if inputs.weights_only:
        what = "execution order only (weights-only plan)"
    elif spec is not None and spec.description:
        what = spec.description
    else:
        what = f"{inputs.height}x{inputs.width}" + (f", {inputs.num_frames} frames" if inputs.num_frames else "")
    return f"Tracing {comp.name} ({comp.cls}) on the meta device{' with tiling' if tiled else ''}: {what}"


def _torch_dtype_name(dtype: str | None, comp: ComponentSource) -> str:
    """bf16/fp16/fp32 or torch spellings -> torch name; None: the checkpoint's dominant dtype."""
    if dtype is None:
        try:
            return skeleton_for_component(comp)[0].dominant_dtype(None)
        except Exception:
            return "bfloat16"
    return parse_dtype(dtype)


def model_tiles(model) -> bool:
    """diffusers' tiling contract (`AutoencoderMixin.enable_tiling`): a `use_tiling` flag the decode reads,
    switched by `enable_tiling()`; classes without the flag raise NotImplementedError there."""
    return hasattr(model, "use_tiling") and callable(getattr(model, "enable_tiling", None)) \
        and callable(getattr(model, "disable_tiling", None))


def can_tile(comp: ComponentSource) -> bool:
    """Whether the component's class decodes in tiles when asked (`enable_tiling()`); built on meta, no weights."""
    if comp.config is None:
        return False
    try:
        return model_tiles(_meta_model(comp, "float32"))
    except SourceError:
        return False


def _trace_uncached(comp: ComponentSource, pipeline_class, inputs: InputSpec, dtype: str, tiled: bool = False) -> ComponentTrace:
    if comp.config is None:
        return ComponentTrace([], {}, 0, [], f"{comp.name} has no config.json: dmap cannot run it, so the "
                              "order is the checkpoint's and there is no activation estimate.", dtype=dtype)
    try:
        model = _meta_model(comp, dtype)
    except SourceError as error:
        return ComponentTrace([], {}, 0, [], f"{error} No execution order or activation estimate.", dtype=dtype)
    spec = _resolve_call(model, comp, pipeline_class, inputs)
    session = _Session(model, track_memory=True, replace_sdpa=True, tag_mode="provenance")
    warning = None
    if spec is None:
        warning = (f"dmap does not know how to call {comp.cls} ({comp.name}): using registration order, "
                   "no activation estimate.")
    elif tiled and not model_tiles(model):
        warning = f"{comp.cls} cannot decode in tiles (it has no enable_tiling)."
    else:
        if tiled:
            model.enable_tiling()  # the meta model is shared (_MODEL_CACHE): switched off again below
        try:
            _run(model, spec, dtype, session)  # the output is dropped at once: only the trace matters
        except Exception as error:  # any model code may fail on meta: fall back, say why
            warning = (f"Tracing {comp.cls} ({comp.name}) on the meta device failed ({type(error).__name__}: "
                       f"{str(error).splitlines()[0][:200] if str(error) else ''}): using registration order, "
                       "no activation estimate.")
        finally:
            if tiled:
                model.disable_tiling()
    if warning is not None:
        order = [prefix for prefix in session.classes if prefix in session.holds_tensors]
        return ComponentTrace(order, {}, 0, [], warning, {}, spec.shapes() if spec else {}, dtype)
    groups = session.same_device_groups()
    rank = {p: i for i, p in enumerate(session.classes)}
    unsplittable = sorted((p for p, g in groups.items() if p and g), key=lambda p: rank.get(p, 0))
    return ComponentTrace(
        execution_order=session.execution_order(),
        module_peaks=dict(session.module_peaks),
        activation_peak=session.memory.peak[_META],
        unsplittable=unsplittable,
        fallback_warning=None,
        same_device_groups=groups,
        inputs=spec.shapes(),
        dtype=dtype,
        module_outputs=dict(session.module_outputs),
        work=dict(session.work),
        gpu_module_peaks=dict(session.gpu_module_peaks),
        gpu_activation_peak=max(session.gpu_peak, session.memory.peak[_META]),
        gpu_peak_at=dict(session.gpu_peak_at),
        attention_backends=dict(session.attention_backends),
    )


def check_device_map(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str,
                     device_map: dict) -> list[str]:
    """Simulate `device_map` on the meta device; one message per op that mixes two devices ([] = it runs)."""
    dtype = _torch_dtype_name(dtype, comp)
    shape_inputs = _weights_only_shape(inputs) if inputs.weights_only else inputs
    spec0 = call_spec(comp, pipeline_class, shape_inputs)
    run_dtype = compute_dtype(spec0, dtype)
    if comp.config is None:
        return [f"{comp.name} has no config.json: dmap cannot run it, the split was not checked."]
    model = _meta_model(comp, run_dtype)
    spec = _resolve_call(model, comp, pipeline_class, shape_inputs)
    if spec is None:
        return [f"dmap cannot run {comp.cls} ({comp.name}) on the meta device: the split was not checked."]
    session = _Session(model, replace_sdpa=True, tag_mode="device", device_map=device_map)
    try:
        _run(model, spec, run_dtype, session)
    except Exception as error:
        session.problems.append(f"{comp.cls} ({comp.name}) failed on the meta device "
                                f"({type(error).__name__}): the split was not checked.")
    return list(session.problems)


class VirtualDevices:
    """Check a device_map during a real (CPU) forward: every tensor carries the device it would be on.

    Numerics are untouched (ops run as they are; inputs are only aliased at module boundaries).
    Usage: `with VirtualDevices(model, device_map) as vd: model(...)`, then `vd.problems`.
    """

    def __init__(self, model, device_map: dict):
        self.model = model
        self.device_map = dict(device_map)
        self.problems: list[str] = []
        self._seen: set = set()
        self._session = None

    def __enter__(self):
        # may be entered once per forward (the runner does): problems accumulate, each reported once
        self._session = _Session(self.model, tag_mode="device", device_map=self.device_map,
                                 problems=self.problems, seen_problems=self._seen)
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        self._session.__exit__(*exc)
        return False

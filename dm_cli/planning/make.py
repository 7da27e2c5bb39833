"""`dmap plan`: resolve a SOURCE, size and trace its components, place them, check the split.

The Plan (and its `dmap-plan` JSON v1, docs/CONTRACTS.md) lives here, with the orchestration around the
pure planner (`search.py`): skeletons, meta traces (`trace.py`), local devices, suggestions when a
plan does not fit, and the split check.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dm_cli.devices import device_key, device_label, device_rank, is_gpu
from dm_cli.errors import CheckpointError, DoesNotFitError, UsageError
from dm_cli.families import (
    FALLBACK_IMAGE_SIZE,
    family_for,
    family_parts,
    pipeline_stages,
    unknown_family_warning,
)
from dm_cli.families.stages import NAMED_VALUES
from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, StepCache
from dm_cli.io.atomic import atomic_write
from dm_cli.model.formats.weight_formats import (
    STORAGE_DTYPES,
    component_format,
    format_of,
    int8_offload_problem,
    layer_compute_bytes,
    parse_weights_spec,
    storage_dtype,
    transient_by_key,
)
from dm_cli.planning.parallel import ParallelLayout, ParallelRequest
from dm_cli.planning.search import (
    MODES,
    STRATEGIES,
    ComponentInput,
    ComponentPlacement,
    Device,
    DeviceUse,
    NoFit,
    Placement,
    StagePlacement,
    component_blocks,
    coverage_problems,
    plan_pipeline,
)
from dm_cli.units import (
    FLOATING_DTYPES,
    MAX_GPU_INDEX,
    MAX_SIZE_BYTES,
    MAX_SIZE_TEXT,
    DeviceBudget,
    format_size,
    parse_device_spec,
    parse_dtype,
    parse_size,
    shorten,
)

if TYPE_CHECKING:  # annotations only
    from dm_cli.model.sources import ComponentSource

PLAN_FORMAT = "dmap-plan"
PLAN_VERSION = 1
# Version 2 is version 1 plus `tiled_decode`, written only when a component decodes in tiles: a reader
# that does not know tiling then refuses the plan, instead of decoding untiled and running out of memory.
TILED_PLAN_VERSION = 2

# CUDA context (~300-600 MB) plus cuBLAS workspaces and caching-allocator slack, per GPU.
DEFAULT_GPU_OVERHEAD = 600 * 10**6


@dataclass
class PlanOptions:
    """What `make_plan` is asked: where (the placement), for what (the inputs), and how to work."""

    placement: PlacementSpec = field(default_factory=PlacementSpec)  # devices, strategy, mode, overhead, dtype, weights
    inputs: InputSpec = field(default_factory=InputSpec)
    component: str | None = None  # plan one component only
    check: bool = True
    use_cache: bool = True
    on_progress: Callable[[str], None] | None = None  # hears each step (resolving, sizing, each trace, the check)
    settings: dict = field(default_factory=dict)  # the family's own (Family.settings): checked as dmap run checks them
    negative_prompt: str | None = None  # checked as dmap run checks it (FLUX refuses one); true CFG is planned anyway
    parallel: ParallelRequest = field(default_factory=ParallelRequest)  # --world-size, --parallel (planning/parallel.py)
    pipeline: str | None = None  # --pipeline: SOURCE is a single file, the rest of the pipeline comes from here
    # --component-file: (component, file) pairs, these components from these single files
    component_files: tuple[tuple[str, str], ...] = ()
    loras: tuple = ()  # LoRA adapters (dm_cli.inputs.LoraAdapter, --lora): their bytes beside the layers they patch
    cache: StepCache | None = None  # --cache: a step cache on the denoiser, its state counted (planning/step_cache.py)

    @classmethod
    def of(cls, generation: Generation, placement: PlacementSpec, **rest) -> "PlanOptions":
        """Options for one generation, so that `dmap plan`, the API and `dmap run`'s inline plan cannot drop
        one of its settings (`with_generation`)."""
        return cls(placement, **rest).with_generation(generation)

    def with_generation(self, generation: Generation) -> "PlanOptions":
        """These options for `generation`: its inputs, its family settings and its negative prompt, all three
        read from the one Generation (the inverse of `generation()`)."""
        return replace(self, inputs=generation.inputs(), settings=dict(generation.settings),
                       negative_prompt=generation.negative_prompt, cache=generation.cache)

    def generation(self) -> Generation:
        """The generation these options plan for (the inverse of `with_generation`: input images as sizes only)."""
        inputs = self.inputs
        frames = inputs.image_frames[:len(inputs.image_sizes)]
        frames = (*frames, *[None] * (len(inputs.image_sizes) - len(frames)))
        return Generation(height=inputs.height, width=inputs.width, num_frames=inputs.num_frames, fps=inputs.fps,
                          guidance_scale=inputs.guidance_scale, max_sequence_length=inputs.max_sequence_length,
                          num_images=inputs.num_images, batch_size=inputs.batch_size,
                          negative_prompt=self.negative_prompt,
                          images=tuple(InputImage(w, h, frame=frame) for (w, h), frame in zip(inputs.image_sizes, frames)),
                          last_image=InputImage(*inputs.last_image_size) if inputs.last_image_size else None,
                          cache=self.cache).with_settings(self.settings)


@dataclass
class Plan:
    source: str
    dtype: str
    strategy: str
    mode: str
    devices: list[Device]
    inputs: InputSpec
    components: dict[str, ComponentPlacement]
    stages: list[StagePlacement]
    pipeline_class: str | None = None
    warnings: list[str] = field(default_factory=list)
    check: dict = field(default_factory=lambda: {"ran": False, "problems": []})
    activation_peaks: dict[str, int] = field(default_factory=dict)  # component -> whole-forward estimate
    config_digest: str | None = None  # sources.config_digest: `dmap run` refuses a plan for another model
    weights: dict[str, str | None] = field(default_factory=dict)  # component -> fp8/int8 storage (None: dtype)
    # components that decode in tiles (diffusers' enable_tiling()) -> the untiled decode's activation estimate
    # (0 when the plan file does not say); absent: untiled
    tiled_decode: dict[str, int] = field(default_factory=dict)
    parallel: ParallelLayout | None = None  # --world-size > 1: how the ranks share each step (written only then)
    # what the input images add to the denoiser's sequence (`input_image_report`; written only when they add any)
    input_images: dict = field(default_factory=dict)
    # the LoRA adapters counted (path, component, scale, digest, tensors, stored_bytes, bytes at the run dtype, fused:
    # merged into the weights at load, else kept as peft layers):
    # written only when there are some
    loras: list[dict] = field(default_factory=list)
    # --cache: {"name", "settings", "label", "components": {denoiser: {"bytes": {device: n}, "total_bytes", "contexts",
    # "holders": {module: n}}}} (planning/step_cache.py); written only with a cache
    step_cache: dict = field(default_factory=dict)

    @property
    def cache(self) -> StepCache | None:
        """The step cache the plan was made for (None: none)."""
        if not self.step_cache:
            return None
        return StepCache(self.step_cache["name"], tuple(sorted(self.step_cache.get("settings", {}).items())))

    @property
    def placement(self) -> PlacementSpec:
        """What the plan was made with, as a request would give it (sizes in bytes): a plan file's devices,
        strategy, mode, overhead, dtype and weight storage."""
        devices = ",".join(d.name if d.capacity is None else f"{d.name}={d.capacity}B" for d in self.devices)
        overhead = ",".join(f"{d.name}={d.overhead}B" for d in self.devices if d.capacity is not None)
        weights = ",".join(f"{name}={fmt}" for name, fmt in sorted(self.weights.items()) if fmt)
        return PlacementSpec(devices or None, self.strategy, self.mode, overhead or None, self.dtype, weights or None)

    @property
    def offloaded_bytes(self) -> int:
        return sum(c.offloaded_bytes for c in self.components.values())

    @property
    def hops(self) -> int:
        return sum(c.hops for c in self.components.values())

    @property
    def hf_device_map(self) -> dict:
        return {name: (c.devices[0] if len(c.devices) == 1 else c.devices) for name, c in self.components.items()}

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": TILED_PLAN_VERSION if self.tiled_decode else PLAN_VERSION,
            "source": self.source,
            "config_digest": self.config_digest,
            "pipeline_class": self.pipeline_class,
            "dtype": self.dtype,
            "strategy": self.strategy,
            "mode": self.mode,
            "devices": {
                d.name: {"capacity_bytes": d.capacity, "overhead_bytes": d.overhead} for d in self.devices
            },
            "inputs": self.inputs.to_json(),
            "hf_device_map": self.hf_device_map,
            "components": {
                name: {
                    "class": c.cls,
                    "weights_bytes": c.weights_bytes,
                    "storage_dtype": storage_dtype(self.weights.get(name), self.dtype),
                    "device_map": c.device_map,
                    "execution_device": c.execution_device,
                    "stage": c.stage,
                    **({"stages": list(c.stages)} if c.stages else {}),
                    "offloaded_bytes": c.offloaded_bytes,
                    "disk_bytes": c.disk_bytes,
                    "hops": c.hops,
                    "activation_peak_bytes": self.activation_peaks.get(name, 0),
                    "activation_bytes": c.activation_by_device,
                    **({"tiled_decode": True, "untiled_activation_peak_bytes": self.tiled_decode[name]}
                       if name in self.tiled_decode else {}),
                }
                for name, c in self.components.items()
            },
            "stages": [
                {
                    "name": s.name,
                    "components": s.components,
                    "peak_bytes": s.peak_bytes,
                    "breakdown": {k: {"weights": u.weights, "reserve": u.reserve, "activations": u.activations,
                                      "overhead": u.overhead, **({"cache": u.cache} if u.cache else {})}
                                  for k, u in s.use.items()},
                    "note": s.note,
                    "consumes": list(s.consumes),
                    "produces": list(s.produces),
                }
                for s in self.stages
            ],
            "offloaded_bytes": self.offloaded_bytes,
            "hops": self.hops,
            "check": self.check,
            "warnings": self.warnings,
            **({"parallel": self.parallel.to_json()} if self.parallel is not None else {}),
            **({"input_images": self.input_images} if self.input_images else {}),
            **({"loras": self.loras} if self.loras else {}),
            **({"step_cache": self.step_cache} if self.step_cache else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """Read a plan, checking every field's type and then every value as the command line that could have
        written it would (dtype, mode, strategy, inputs, devices): a plan file is input like any other
        (ValueError, or UsageError from the shared checks)."""
        data = _object(data, "the document")
        version = data.get("version")
        if data.get("format") != PLAN_FORMAT or type(version) is not int or version not in (PLAN_VERSION, TILED_PLAN_VERSION):
            raise ValueError(f"not a {PLAN_FORMAT} v{PLAN_VERSION} or v{TILED_PLAN_VERSION} document")
        dtype = _plan_dtype(data.get("dtype"))
        strategy = _choice(data.get("strategy", "auto"), "'strategy'", STRATEGIES)
        mode = _choice(data.get("mode", "staged"), "'mode'", MODES)
        devices = []
        for key, value in _object(data.get("devices"), "'devices'").items():
            value = _object(value, f"device {key!r}")
            capacity = value.get("capacity_bytes")
            devices.append(Device(_plan_device(key, f"device {key!r}"),
                                  None if capacity is None else _count(capacity, f"device {key!r} capacity_bytes"),
                                  _count(value.get("overhead_bytes", 0), f"device {key!r} overhead_bytes")))
        if not devices:
            raise ValueError("'devices' is empty")
        known = {d.key for d in devices}
        components = {}
        raw_components = _object(data.get("components"), "'components'")
        for name, c in raw_components.items():
            where = f"component {name!r}"
            c = _object(c, where)
            device_map = {_map_key(k, f"{where} device_map key"): _plan_device(v, where, known)
                          for k, v in _object(c.get("device_map"), f"{where} device_map").items()}
            if not device_map:
                raise ValueError(f"{where} has an empty device_map")
            execution = c.get("execution_device", next(iter(device_map.values())))
            _storage_dtype(c.get("storage_dtype"), dtype, where)
            components[name] = ComponentPlacement(
                name, _text(c.get("class", "?"), f"{where} class"),
                _count(c.get("weights_bytes", 0), f"{where} weights_bytes"), device_map,
                _plan_device(execution, f"{where} execution_device", known),
                {k: _count(v, f"{where} activation_bytes")
                 for k, v in _object(c.get("activation_bytes", {}), f"{where} activation_bytes").items()},
                _count(c.get("offloaded_bytes", 0), f"{where} offloaded_bytes"), _count(c.get("hops", 0), f"{where} hops"),
                _text(c.get("stage", ""), f"{where} stage"), _count(c.get("disk_bytes", 0), f"{where} disk_bytes"),
                _names(c.get("stages", []), f"{where} stages"),
            )
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            raise ValueError("'stages' must be a non-empty list")
        stages = [_stage(s, components, known) for s in raw_stages]
        warnings = data.get("warnings", [])
        if not isinstance(warnings, list):
            raise ValueError("'warnings' must be a list")
        inputs = InputSpec.from_json(_object(data.get("inputs", {}), "'inputs'"))
        if inputs.height is not None and inputs.width is not None:
            _check_weights_only(inputs)  # the family's rules are the run's to apply (Family.validate)
        return cls(
            _text(data.get("source", "?"), "'source'"), dtype, strategy, mode,
            devices, inputs, components, stages,
            data.get("pipeline_class") if isinstance(data.get("pipeline_class"), str) else None,
            [str(w) for w in warnings], dict(_object(data.get("check", {"ran": False, "problems": []}), "'check'")),
            {n: _count(c.get("activation_peak_bytes", 0), f"component {n!r} activation_peak_bytes")
             for n, c in raw_components.items()},
            data.get("config_digest") if isinstance(data.get("config_digest"), str) else None,
            {n: format_of(c.get("storage_dtype")) for n, c in raw_components.items()},
            {n: _count(c.get("untiled_activation_peak_bytes", 0), f"component {n!r} untiled_activation_peak_bytes")
             for n, c in raw_components.items() if _flag(c.get("tiled_decode", False), f"component {n!r} tiled_decode")},
            _parallel(data, known) if "parallel" in data else None,
            dict(_object(data.get("input_images", {}), "'input_images'")),
            _plan_loras(data.get("loras", []), set(components)),
            _plan_step_cache(data["step_cache"], set(components)) if "step_cache" in data else {},
        )


def _plan_loras(value, components: set) -> list[dict]:
    """A plan file's `loras`: what the run compares its own --lora against (component, digest, scale)."""
    if not isinstance(value, list):
        raise ValueError("'loras' must be a list")
    out = []
    for n, entry in enumerate(value):
        where = f"lora {n}"
        entry = _object(entry, where)
        component = _text(entry.get("component"), f"{where} component")
        if component not in components:
            raise ValueError(f"{where} patches '{component}', which the plan does not place")
        scale = entry.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"{where} scale must be a finite number")
        out.append({"path": _text(entry.get("path", ""), f"{where} path"), "component": component, "scale": float(scale),
                    "digest": _text(entry.get("digest"), f"{where} digest"),
                    "tensors": _count(entry.get("tensors", 0), f"{where} tensors"),
                    "stored_bytes": _count(entry.get("stored_bytes", 0), f"{where} stored_bytes"),
                    "bytes": _count(entry.get("bytes", 0), f"{where} bytes"),
                    "fused": _flag(entry.get("fused", False), f"{where} fused")})
    return out


def _plan_step_cache(value, components: set) -> dict:
    """A plan file's `step_cache`: the cache (checked as --cache is) and the bytes it counted per component and device."""
    from dm_cli.planning.step_cache import parse_cache

    value = _object(value, "'step_cache'")
    cache = parse_cache({"name": _text(value.get("name"), "step_cache name"),
                         **_object(value.get("settings", {}), "step_cache settings")}, "the plan's step_cache")
    placed = {}
    for name, entry in _object(value.get("components", {}), "step_cache components").items():
        if name not in components:
            raise ValueError(f"step_cache counts '{name}', which the plan does not place")
        entry = _object(entry, f"step_cache {name}")
        placed[name] = {"bytes": {k: _count(v, f"step_cache {name} bytes") for k, v in
                                  _object(entry.get("bytes", {}), f"step_cache {name} bytes").items()},
                        "total_bytes": _count(entry.get("total_bytes", 0), f"step_cache {name} total_bytes"),
                        "contexts": _count(entry.get("contexts", 1), f"step_cache {name} contexts"),
                        "holders": {str(k): _count(v, f"step_cache {name} holders") for k, v in
                                    _object(entry.get("holders", {}), f"step_cache {name} holders").items()}}
    return {"name": cache.name, "settings": dict(cache.settings), "label": cache.label, "components": placed}


def _parallel(data: dict, known: set) -> ParallelLayout:
    """The plan's `parallel`, checked, each rank's GPU among its 'devices' (rank r on GPU r)."""
    layout = ParallelLayout.from_json(data["parallel"])
    missing = [r for r in range(layout.world_size) if r not in known]
    if missing:
        raise ValueError(f"'parallel' puts rank {missing[0]} on GPU {missing[0]}, which its 'devices' do not list")
    return layout


def _stage(data, components: dict, known: set) -> StagePlacement:
    data = _object(data, "a stage")
    name = _text(data.get("name"), "a stage name")
    members = data.get("components")
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ValueError(f"stage {name!r} components must be a list of names")
    unknown = [m for m in members if m not in components]
    if unknown:
        raise ValueError(f"stage {name!r} names component {unknown[0]!r}, which the plan does not place")
    breakdown = data.get("breakdown")
    if breakdown is None:
        breakdown = {k: {"weights": v} for k, v in _object(data.get("peak_bytes"), f"stage {name!r} peak_bytes").items()}
    use = {}
    for key, value in _object(breakdown, f"stage {name!r} breakdown").items():
        value = _object(value, f"stage {name!r} device {key!r}")
        use[str(_plan_device(key, f"stage {name!r}", known))] = DeviceUse(*(_count(value.get(part, 0), f"stage {name!r} {part}")
                                                for part in ("weights", "reserve", "activations", "overhead", "cache")))
    note = data.get("note") or ""
    # what the stage takes and makes; a plan written before stages recorded it means what the name did then
    consumes, produces = NAMED_VALUES.get(name, ((), ())) if "produces" not in data else (
        _names(data.get("consumes", []), f"stage {name!r} consumes"), _names(data["produces"], f"stage {name!r} produces"))
    return StagePlacement(name, list(members), use, _text(note, f"stage {name!r} note"), consumes, produces)


def _names(value, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of names")
    return tuple(value)


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, found {_json_type(value)}")
    return value


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, found {_json_type(value)}")
    return value


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, found {_json_type(value)}")
    return value


def _count(value, what: str) -> int:
    """A byte count or counter: a whole number from 0 to 1 EiB (1e9 is fine; 1.5, -1, true, NaN or 1e30 are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or int(value) != value or value > MAX_SIZE_BYTES:
        shown = shorten(value, quote=True)
        raise ValueError(f"{what} must be a whole number >= 0 (at most {MAX_SIZE_TEXT}), found {shown}")
    return int(value)


def _plan_dtype(value) -> str:
    """The plan's dtype, as --dtype takes it (bf16, fp16, fp32 or their torch names), or another floating
    dtype a checkpoint is stored in: anything else would reach getattr(torch, ...) in the runner."""
    if isinstance(value, str) and value in FLOATING_DTYPES:
        return value
    return parse_dtype(value if isinstance(value, str) else _json_type(value))


def _choice(value, what: str, allowed) -> str:
    if _text(value, what) not in allowed:
        raise ValueError(f"{what} must be {', '.join(allowed[:-1])} or {allowed[-1]}, found {value[:40]!r}")
    return value


def _plan_device(value, what: str, known: set | None = None) -> int | str:
    """A device as --max-memory names it (device_key: ValueError "not a device"); with `known`, one of the
    plan's 'devices' (cpu and disk always exist)."""
    key = device_key(value)
    if isinstance(key, int) and key > MAX_GPU_INDEX:
        raise ValueError(f"{what} names GPU index {str(key)[:40]}, above {MAX_GPU_INDEX}: no machine has it")
    if known is not None and is_gpu(key) and key not in known:
        raise ValueError(f"{what} places weights on {device_label(key)}, which its 'devices' do not list")
    return key


# What a device_map key is: "" (the whole component) or a dotted module name, as torch names modules.
_MODULE_NAME = re.compile(r"^(?:[\w-]+(?:\.[\w-]+)*)?$")


def _map_key(value, what: str) -> str:
    if not _MODULE_NAME.match(_text(value, what)):
        raise ValueError(f"{what} {value[:60]!r} is not a module name")
    return value


def _storage_dtype(value, dtype: str, where: str) -> None:
    """What dmap plan writes: the run dtype, or fp8 / int8 storage (absent in older plans)."""
    allowed = (dtype, *STORAGE_DTYPES.values())
    if value is not None and value not in allowed:
        shown = shorten(value, quote=True)
        raise ValueError(f"{where} storage_dtype must be {', '.join(allowed[:-1])} or {allowed[-1]}, found {shown}")


def _json_type(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
             int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON written by `dmap plan --output` (exit 2 when it is not one)."""
    from dm_cli.io.checkpoint import read_json_object

    path = Path(path)
    try:
        data = read_json_object(path, "plan file")
    except CheckpointError as error:
        raise UsageError(f"Cannot read plan {error}") from None
    try:
        return Plan.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError, UsageError) as error:
        reason = str(error).rstrip(".")
        raise UsageError(f"{path} is not a dmap plan ({reason}): write one with dmap plan --output.") from None


def write_plan(plan: Plan, path: str | Path) -> None:
    """Atomically: a temp file next to the target, renamed when complete."""
    path = Path(path)
    text = json.dumps(plan.to_json(), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"Cannot write plan to {path}: {error.strerror or error}.") from None


# --- devices ------------------------------------------------------------------------------------


def local_devices() -> list[DeviceBudget]:
    """Free memory of each local GPU and the available RAM: the target when no --max-memory is given."""
    budgets: list[DeviceBudget] = []
    try:
        import torch

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                free, _total = torch.cuda.mem_get_info(index)
                budgets.append(DeviceBudget(index, int(free)))
    except Exception:  # a broken CUDA install plans for cpu only
        budgets = []
    budgets.append(DeviceBudget("cpu", available_ram()))
    return budgets


def available_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def parse_overhead(spec: str | None, budgets: list[DeviceBudget], weights_only: bool) -> dict[str, int]:
    """Per-device overhead: 600 MB per GPU by default (0 for weights-only plans), 0 for cpu and disk."""
    default = 0 if weights_only and spec is None else DEFAULT_GPU_OVERHEAD
    overhead = {b.key: (default if b.is_gpu else 0) for b in budgets}
    if spec is not None:
        for item in spec.split(","):
            name, sep, size = item.strip().partition("=")
            if not sep or not size.strip():
                raise UsageError(f"--overhead entry '{item.strip()}' needs a size, like 0=600MB.")
            try:
                key = str(device_key(name))
            except ValueError:
                key = None
            if key not in overhead:
                raise UsageError(f"--overhead names device '{name.strip()}', which is not in --max-memory.")
            overhead[key] = parse_size(size.strip())
    return overhead


# --- components -----------------------------------------------------------------------------------


def _splittable(comp: ComponentSource) -> bool:
    """The VAE is never split (AutoencoderKL does not split cleanly across GPUs)."""
    return not (comp.name == "vae" or comp.cls.startswith("Autoencoder"))


@dataclass
class TraceFacts:
    """What the planner needs from a trace (the tracer caches the traces themselves)."""

    execution_order: list[str] | None
    module_peaks: dict[str, int]
    activation_peak: int
    unsplittable: list[str]
    same_device_groups: dict[str, list[list[str]]]
    warning: str | None
    module_outputs: dict[str, int] = field(default_factory=dict)  # module -> bytes of its largest output


def trace_facts(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str, use_cache: bool = True,
                tiled: bool = False, on_progress: Callable[[str], None] | None = None) -> TraceFacts:
    """The meta trace of one component: execution order, activation peaks, what must not be split
    (`tiled`: of its decode with diffusers' enable_tiling())."""
    from dm_cli.planning.trace import trace_component

    result = trace_component(comp, pipeline_class, inputs, dtype, use_cache=use_cache, tiled=tiled,
                             on_progress=on_progress)
    return TraceFacts(list(result.execution_order) or None, dict(result.module_peaks), int(result.activation_peak),
                      list(result.unsplittable), dict(getattr(result, "same_device_groups", {}) or {}),
                      result.fallback_warning, dict(result.module_outputs))


@dataclass
class PreparedComponent:
    source: object  # ComponentSource
    skeleton: object  # Skeleton
    dtype: str
    facts: TraceFacts
    spec: ComponentInput
    warnings: list[str]
    weights: str | None = None  # fp8 / int8 storage (weight_formats.py); None: the run dtype
    effective_dtype: str | None = None  # the dtype its tensors are sized at (None: as stored)
    lora_bytes: tuple = ()  # (LoraAdapter, bytes it adds at the run dtype) for each LoRA patching it


def prepare_component(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str | None,
                      use_cache: bool = True, weights: dict[str, str | None] | None = None,
                      on_progress: Callable[[str], None] | None = None, loras: tuple = ()) -> PreparedComponent:
    """Skeleton + trace -> the planner's ComponentInput (blocks in execution order with activations).

    `weights` (from `parse_weights_spec`) stores some tensors in fp8 or int8: they are counted at
    those sizes, by the rule the runner applies, and the compute copy of the largest such layer
    (upcast while it runs) is added to the activations of every block that holds it.
    """
    from dm_cli.model.skeleton import as_loaded

    if on_progress is not None:
        on_progress(f"Sizing {comp.name} ({comp.cls}): counting its tensors")
    loaded = as_loaded(comp, use_cache=use_cache)  # what from_pretrained keeps (untied lm_head)
    comp, skeleton, checkpoint, tie_note = loaded.comp, loaded.skeleton, loaded.checkpoint, loaded.note
    if checkpoint is not None and checkpoint.problems:  # a plan for a broken checkpoint would be wrong
        from dm_cli.errors import CheckpointError

        listed = "; ".join(str(p) for p in checkpoint.problems)
        raise CheckpointError(f"Component '{comp.name}' has {len(checkpoint.problems)} checkpoint problem(s): {listed}.")
    fmt = component_format(weights or {}, comp.name, skeleton)
    if fmt and skeleton.quantized:
        raise UsageError(f"'{comp.name}' comes from a GGUF file, quantized already: drop --weights {comp.name}={fmt}.")
    effective = dtype if dtype is not None else skeleton.default_dtype()
    if fmt and effective is None:
        effective = skeleton.compute_dtype()  # a checkpoint stored in fp8 runs in its other tensors' dtype
    trace_dtype = effective or skeleton.dominant_dtype(None)
    warnings: list[str] = [skeleton.note] if skeleton.note and not skeleton.stored else []
    if tie_note:
        warnings.append(tie_note)
    if skeleton.quantized:
        warnings.append(_gguf_note(comp, skeleton, trace_dtype))
    if comp.config is None:
        facts = TraceFacts(None, {}, 0, [], {}, "no config: registration order, no activation estimate")
    else:
        facts = trace_facts(comp, pipeline_class, inputs, trace_dtype, use_cache, on_progress=on_progress)
    if facts.warning and not inputs.weights_only and "overflow" in facts.warning.lower():
        raise DoesNotFitError(_overflow_refusal(comp, inputs))  # never planned as if it needed nothing
    if facts.warning:
        warnings.append(f"{comp.name}: {facts.warning}")
    extra, lora_bytes = lora_extra_bytes(comp, skeleton, loras, effective or trace_dtype)
    transients = {} if inputs.weights_only else lora_transients(loras, facts.module_outputs, skeleton, trace_dtype)
    spec, block_warnings = _component_spec(comp, skeleton, facts, inputs, effective, fmt, trace_dtype, extra,
                                           transients)
    warnings += [f"{comp.name}: {w}" for w in block_warnings]
    return PreparedComponent(comp, skeleton, trace_dtype, facts, spec, warnings, fmt, effective, lora_bytes)


def lora_extra_bytes(comp: ComponentSource, skeleton, loras: tuple, dtype: str) -> tuple[dict[str, int], tuple]:
    """What the LoRAs patching a component add, unfused: lora_A and lora_B live beside the layer they patch, in its
    dtype (peft casts them to it), so their bytes go with that layer's weight (tensor name -> bytes) and the planner
    puts them in the block that holds it. A LoRA in a layout diffusers converts while loading (kohya's) is spread
    over the component's weights. Beside fp8 or int8 weights the adapters stay in the compute dtype (dm_cli.run.
    adapters). Refused, one sentence: layers that are not in the component (a LoRA for another model)."""
    from dm_cli.model.lora import layer_problems
    from dm_cli.units import DTYPE_BYTES

    if not loras:
        return {}, ()
    infos = {t.name: t for t in skeleton.tensors}
    shapes = {t.name: t.shape for t in skeleton.tensors}
    weights = [t for t in skeleton.tensors if t.kind == "param" and t.name.endswith(".weight") and len(t.shape) >= 2]
    extra: dict[str, int] = {}
    report = []
    for lora in loras:
        problem = layer_problems(lora, shapes)
        if problem:
            raise UsageError(problem)
        if lora.layers:
            added = {f"{layer.module}.weight": layer.numel * _adapter_itemsize(infos[f"{layer.module}.weight"], dtype)
                     for layer in lora.layers}
        else:  # a foreign layout: diffusers renames its keys only while loading
            total = lora.numel * DTYPE_BYTES[dtype]
            numels = sum(t.numel for t in weights) or 1
            added = {t.name: total * t.numel // numels for t in weights}
        for name, count in added.items():
            extra[name] = extra.get(name, 0) + count
        report.append((lora, sum(added.values())))
    return extra, tuple(report)


def lora_transients(loras: tuple, outputs: dict[str, int], skeleton, compute_dtype: str) -> dict[str, int]:
    """Layer -> bytes its unfused LoRAs add while it runs: peft computes `lora_B(lora_A(x)) * scale` beside the
    layer's output and adds it in, two more tensors of the output's size (in the adapter's dtype; one adapter
    at a time). A LoRA in a layout diffusers converts while loading names no layers here: it adds nothing."""
    from dm_cli.units import DTYPE_BYTES

    infos = {t.name: t for t in skeleton.tensors}
    out: dict[str, int] = {}
    for lora in loras:
        for layer in lora.layers:
            weight = infos.get(f"{layer.module}.weight")
            ratio = _adapter_itemsize(weight, compute_dtype) / DTYPE_BYTES[compute_dtype] if weight else 1
            added = int(2 * outputs.get(layer.module, 0) * max(1.0, ratio))
            out[layer.module] = max(out.get(layer.module, 0), added)
    return {layer: nbytes for layer, nbytes in out.items() if nbytes}


def with_lora_peaks(module_peaks: dict[str, int], lora_layers: dict[str, int]) -> dict[str, int]:
    """The trace's peaks with each patched layer's LoRA transients on top of what was live while it ran, and the
    modules around it at least as high: the LoRA raises a block's peak only where it exceeds the block's own."""
    peaks = dict(module_peaks)
    for layer, added in lora_layers.items():
        raised = module_peaks.get(layer, 0) + added
        prefix = layer
        while True:
            peaks[prefix] = max(peaks.get(prefix, 0), raised)
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
    return peaks


def _adapter_itemsize(weight, dtype: str) -> int:
    """Bytes per element of the adapter peft puts beside `weight`: its dtype at the run dtype; float32 beside a
    GGUF-quantized weight (peft builds adapters in float32 and casts them only to a floating layer dtype)."""
    from dm_cli.units import DTYPE_BYTES

    return DTYPE_BYTES["float32"] if weight.quantized_bytes else DTYPE_BYTES[weight.dtype_at(dtype)]


def _overflow_refusal(comp: ComponentSource, inputs: InputSpec) -> str:
    """A trace that overflowed (torch's storage size, a Python int to C) has no activation estimate, and
    its tensors are beyond any device: planning on without the estimate would report a fit."""
    what = f"{inputs.height}x{inputs.width}" + (f", {inputs.num_frames} frames" if inputs.num_frames else "")
    return (f"{comp.name} ({comp.cls}) does not fit: its activations for {what} at batch {inputs.effective_batch} "
            "are too large to count (its trace on the meta device overflowed); use a smaller size, --batch-size "
            "or --num-images.")


def _gguf_note(comp: ComponentSource, skeleton, compute_dtype: str) -> str:
    """What a plan says of a GGUF component: its types, and the per-layer dequantization it counts."""
    types = ", ".join(f"{count} {name}" for name, count in sorted(comp.single_file.quant_types().items()))
    largest = max(layer_compute_bytes(skeleton.tensors, None, compute_dtype).values(), default=0)
    return (f"{comp.name}: GGUF tensors ({types}) stay quantized; diffusers dequantizes each layer's weight to "
            f"{compute_dtype} while it runs (largest {format_size(largest)}), counted in its block's activations.")


def _component_spec(comp: ComponentSource, skeleton, facts: TraceFacts, inputs: InputSpec, effective: str | None, fmt: str | None,
                    trace_dtype: str, extra: dict[str, int] | None = None,
                    lora_layers: dict[str, int] | None = None) -> tuple[ComponentInput, list[str]]:
    """The planner's view of one component for one trace: blocks in execution order with their activations.
    `extra`: bytes held beside a tensor (a LoRA's, `lora_extra_bytes`), counted with it; `lora_layers`: bytes a
    LoRA adds while a layer runs (`lora_transients`), on top of what is live then (`with_lora_peaks`)."""
    peaks = {} if inputs.weights_only else with_lora_peaks(facts.module_peaks, lora_layers or {})
    extra = extra or {}
    tensor_bytes = [(t.name, t.bytes_at(effective, fmt) + extra.get(t.name, 0)) for t in skeleton.tensors]
    blocks, block_warnings = component_blocks(skeleton.modules, tensor_bytes, skeleton.no_split_modules,
                                              facts.execution_order, facts.unsplittable, peaks,
                                              facts.same_device_groups, skeleton.tie_groups)
    activation_peak = 0 if inputs.weights_only else max([facts.activation_peak, *peaks.values()])
    layers = {} if inputs.weights_only else layer_compute_bytes(skeleton.tensors, fmt, trace_dtype)
    if layers:
        extra = transient_by_key([b.keys for b in blocks], layers)
        blocks = [replace(b, activation=b.activation + e) for b, e in zip(blocks, extra)]
        activation_peak += max(layers.values())
    spec = ComponentInput(comp.name, skeleton.cls if skeleton.cls != "?" else comp.cls, blocks, _splittable(comp),
                          activation_peak)
    names = [t.name for t in skeleton.tensors] + [alias for group in skeleton.tie_groups for alias in group[1:]]
    problems = coverage_problems({k: 0 for b in blocks for k in b.keys}, names)
    if problems:  # a bug in block cutting, never the user's fault
        raise AssertionError(f"blocks of {comp.name} do not cover its tensors: {problems[:3]}")
    return spec, block_warnings


# --- planning -------------------------------------------------------------------------------------


def make_plan(source_spec: str, options: PlanOptions) -> Plan:
    """Resolve, size, trace, place and check: the one core call of `dmap plan`."""
    from dm_cli.model.single_file_weights import resolve_with_pipeline
    from dm_cli.model.sources import config_digest

    if options.placement.strategy not in STRATEGIES:
        raise UsageError(f"Unknown strategy '{options.placement.strategy}': use {', '.join(STRATEGIES)}.")
    if options.placement.mode not in MODES:
        raise UsageError(f"Unknown mode '{options.placement.mode}': use {', '.join(MODES)}.")
    progress = options.on_progress or (lambda message: None)
    progress(f"Resolving {source_spec}")
    source = resolve_with_pipeline(source_spec, options.pipeline, dict(options.component_files))
    comps = [source.component(options.component)] if options.component else list(source.components)
    options = settled_options(source, comps, options)
    if options.placement.dtype is not None:  # "" is an unknown dtype, not the default
        options = replace(options, placement=replace(options.placement, dtype=parse_dtype(options.placement.dtype)))
    asked = options.placement
    budgets = parse_device_spec(asked.max_memory) if asked.max_memory is not None else local_devices()
    overhead = parse_overhead(asked.overhead, budgets, options.inputs.weights_only)
    devices = [Device(b.device, b.capacity_bytes, overhead[b.key]) for b in budgets]
    parallel = _parallel_request(source, comps, devices, options)  # refused before any trace
    if parallel is not None:
        options, asked = parallel[0], parallel[0].placement
    formats = parse_weights_spec(asked.weights, [c.name for c in comps])
    loras = lora_targets(source, options.loras)
    prepared = [prepare_component(c, source.pipeline_class, options.inputs, asked.dtype, options.use_cache, formats,
                                  on_progress=options.on_progress,
                                  loras=tuple(lora for lora in loras if lora.component == c.name)) for c in comps]
    cut, prepared = _pipeline_cut(prepared, devices, *parallel) if parallel is not None else (None, prepared)
    specs = [p.spec for p in prepared]
    stages = pipeline_stages(source.pipeline_class, [c.name for c in comps])
    progress(f"Placing {len(specs)} component(s) on {', '.join(device_label(d.key) for d in devices)}")
    placement = _plan_or_none(specs, stages, devices, options)
    choice = TilingChoice(placement, specs)
    if placement is None or placement.offloaded_bytes:  # only then can a tiled decode be needed
        choice = choose_tiling(prepared, source.pipeline_class, stages, devices, options, placement)
    if choice.placement is None:
        progress("Nothing fits: looking for the nearest change that does")
        raise _does_not_fit(source_spec, source, comps, stages, devices, options, formats, choice.specs,
                            choice.warnings) from None
    placement, specs = choice.placement, choice.specs
    layout = None
    if parallel is not None:
        layout, placement, prepared = _parallel_layout(placement, specs, prepared, stages, devices, cut, *parallel)
    footprints = step_cache_footprints(source, prepared, options)
    if footprints:
        placement, cache_bytes = _fit_step_cache(source_spec, specs, stages, devices, options, placement, footprints)
    dtype = asked.dtype or (prepared[0].dtype if prepared else "bfloat16")
    plan = Plan(source_spec, dtype, asked.strategy, placement.mode, devices, options.inputs, placement.components,
                placement.stages, source.pipeline_class,
                [w for p in prepared for w in p.warnings] + placement.warnings + choice.warnings,
                activation_peaks={s.name: s.activation_peak for s in specs},
                config_digest=config_digest(source), weights={p.spec.name: p.weights for p in prepared},
                tiled_decode=choice.tiled)
    if source.pipeline_class and family_for(source.pipeline_class) is None:
        plan.warnings.insert(0, unknown_family_warning(source.pipeline_class))
    _explain_offload(plan, prepared, stages, options)
    for name, fmt in plan.weights.items():
        problem = int8_offload_problem(name, fmt, plan.components[name].device_map)
        if problem:
            plan.warnings.append(f"{problem} dmap run refuses this plan (except with --simulate).")
    plan.input_images = input_image_report(source, comps, prepared, options)
    unfused = {p.spec.name: lora_unfused_because(p, plan.components[p.spec.name].device_map)
               for p in prepared if p.lora_bytes}
    plan.loras = [{**lora.to_json(), "bytes": count, "fused": unfused[p.spec.name] is None}
                  for p in prepared for lora, count in p.lora_bytes]
    plan.warnings += [f"{name}: its LoRA stays unfused (peft's layers beside the weights, a little slower per step): "
                      f"{why}." for name, why in unfused.items() if why]
    if options.cache is not None:
        plan.step_cache = _step_cache_report(plan, source, prepared, options, footprints,
                                             cache_bytes if footprints else {})
    plan.parallel = layout
    plan.warnings += [f"The plan records a {layout.title} layout for {layout.world_size} ranks ('parallel'): run it with "
                      f"torchrun --nproc-per-node {layout.world_size} -m dm_cli run -d PLAN.json."
                      for layout in [layout] if layout is not None and layout.layout != "split"]
    if options.check:
        plan.check = run_split_check(plan, prepared, source.pipeline_class, options)
    return plan


def step_cache_footprints(source, prepared: list[PreparedComponent], options: PlanOptions) -> dict:
    """--cache: what its hooks hold in each denoiser (the family's `denoiser` and `experts`), measured on the meta
    device (planning/step_cache.py); {} without a cache or for a weights-only plan."""
    if options.cache is None or options.inputs.weights_only:
        return {}
    if options.parallel.active:
        raise UsageError(f"--cache {options.cache.name} with --world-size {options.parallel.world_size}: dmap does not "
                         "count a step cache's state per rank yet (and fbc's data-dependent skips would diverge between "
                         "context-parallel ranks); plan the cache for one process, or drop --cache.")
    from dm_cli.planning.step_cache import measure

    family = family_for(source.pipeline_class)
    if family is None:
        raise UsageError(f"dmap knows no pipeline family in {source.spec}, so it cannot apply --cache: drop it.")
    out = {}
    for prep in prepared:
        if prep.spec.name in (family.denoiser, *family.experts) and prep.source.config is not None:
            if options.on_progress is not None:
                options.on_progress(f"Counting what --cache {options.cache.name} holds in {prep.spec.name} on the meta device")
            out[prep.spec.name], _ = measure(prep.source, source.pipeline_class, options.inputs, prep.dtype,
                                             options.cache, family, options.use_cache)
    return out


def _fit_step_cache(source_spec: str, specs, stages, devices: list[Device], options: PlanOptions, placement: Placement,
                    footprints: dict) -> tuple[Placement, dict]:
    """The placement with room for the cache's state on the devices that hold it (step_cache.fit), or DoesNotFitError."""
    from dm_cli.planning.step_cache import fit

    fitted, cache_bytes = fit(lambda trial: _plan_or_none(specs, stages, trial, options), devices, footprints)
    if fitted is None:
        held = sum(fp.total for fp in footprints.values())
        raise DoesNotFitError(f"{source_spec} fits on these devices without a step cache, but not with --cache "
                              f"{options.cache.name}: its hooks hold {format_size(held)} beside the denoiser between "
                              "steps; use --cache taylorseer:lite=true (less state), a smaller size, or more memory.",
                              {"shortfall_bytes": {}, "suggestions": []})
    return fitted, cache_bytes


def _step_cache_report(plan: Plan, source, prepared, options: PlanOptions, footprints: dict, cache_bytes: dict) -> dict:
    """The plan's `step_cache`; a split that fbc or magcache cannot run is refused (one sentence), and the split check
    runs with the hooks on (its problems join the plan's check)."""
    from dm_cli.planning.step_cache import split_refusal

    cache = options.cache
    components = {}
    for name, footprint in footprints.items():
        placed = plan.components[name]
        refusal = split_refusal(cache, footprint, name, placed.device_map, placed.execution_device)
        if refusal:
            raise UsageError(refusal)
        components[name] = {"bytes": cache_bytes.get(name, {}), "total_bytes": footprint.total,
                            "contexts": footprint.contexts, "holders": footprint.holders}
    return {"name": cache.name, "settings": dict(cache.settings), "label": cache.label, "components": components}


def step_cache_check(plan: Plan, prepared, pipeline_class, options: PlanOptions) -> list[str]:
    """The split check of each cached, split denoiser run again with the cache's hooks on."""
    if options.cache is None or not plan.step_cache:
        return []
    from dm_cli.planning.step_cache import measure

    family = family_for(pipeline_class)
    problems = []
    for prep in prepared:
        placed = plan.components.get(prep.spec.name)
        if prep.spec.name not in plan.step_cache.get("components", {}) or len(set(placed.device_map.values())) < 2:
            continue
        if options.on_progress is not None:
            options.on_progress(f"Checking the split of {prep.spec.name} with --cache {options.cache.name} on")
        _, found = measure(prep.source, pipeline_class, options.inputs, prep.dtype, options.cache, family,
                           options.use_cache, placed.device_map)
        problems += [f"{prep.spec.name} with --cache {options.cache.name}: {p}" for p in found]
    return problems


def lora_unfused_because(prepared: PreparedComponent, device_map: dict) -> str | None:
    """Why the LoRAs of a component cannot be fused into its weights at load (diffusers' `fuse_lora`, then
    `unload_lora`: no peft layer left, no per-call cost), or None when they can: fusing needs every weight real and
    in a floating dtype."""
    from dm_cli.devices import streams_blocks

    if prepared.weights:
        return f"its layers are stored as {prepared.weights}, which peft cannot merge into"
    if prepared.skeleton.quantized:
        return "its layers are GGUF-quantized, which peft cannot merge into"
    if streams_blocks(device_map):
        return "its blocks stream from cpu or disk (their weights are on the meta device between calls)"
    return None


def lora_targets(source, loras: tuple) -> tuple:
    """The LoRAs with the component each patches (`dm_cli.model.lora.settle_targets`), as `dmap run` settles them."""
    if not loras:
        return ()
    from dm_cli.model.lora import settle_targets

    family, denoiser, _ = family_parts(source.pipeline_class, source.components)
    return settle_targets(tuple(loras), [c.name for c in source.components],
                          denoiser.name if denoiser is not None else None, family.experts if family is not None else (),
                          source.pipeline_class)


# --- parallel within a step (planning/parallel.py) ---------------------------------------------------


def _parallel_request(source, comps, devices: list[Device], options: PlanOptions):
    """For --world-size > 1: (options, family, guidance, denoiser shape), every refusal that needs no trace
    said first (one sentence, exit 2); the plan is staged (each rank loads the denoiser after the encoders are
    freed). None for one rank."""
    from dm_cli.planning.parallel import candidates, denoiser_shape, guidance_branches

    request = options.parallel.settled()
    if not request.active:
        return None
    world = request.world_size
    if options.component:
        raise UsageError(f"--world-size {world} plans a whole pipeline's denoise over ranks: drop --component.")
    if options.inputs.weights_only:
        raise UsageError(f"--world-size {world} needs an input size: a weights-only plan has no steps to share.")
    family, denoiser, _ = family_parts(source.pipeline_class, source.components if source.pipeline_class else comps)
    if family is None or denoiser is None:
        raise UsageError(f"dmap knows no pipeline family in {source.spec}, so it cannot tell its guidance branches "
                         "or attention: drop --world-size.")
    gpus = {d.key for d in devices if isinstance(d.key, int)}
    missing = [r for r in range(world) if r not in gpus]
    if missing:
        raise UsageError(f"--world-size {world} puts rank r on GPU r, and --max-memory (or this machine) lists "
                         f"{len(gpus)} GPU(s), without GPU {missing[0]}: list one GPU per rank.")
    placement = options.placement
    if placement.mode == "resident":
        raise UsageError(f"--world-size {world} plans the stages one after another (every rank loads the denoiser "
                         "whole once the encoders are freed): use --mode staged or auto.")
    guidance = guidance_branches(family, options.inputs, options.negative_prompt, options.settings)
    element = 4 if placement.dtype == "float32" else 2
    shape = denoiser_shape(denoiser, source.pipeline_class, options.inputs, family, element)
    names = {c.name for c in source.components}
    shape = replace(shape, experts=tuple(n for n in family.experts if n in names and n != denoiser.name))
    candidates(request, guidance, shape)  # an explicit choice that cannot run is refused here
    options = replace(options, placement=replace(placement, mode="staged"), parallel=request)
    return options, family, guidance, shape


def _parallel_layout(placement: Placement, specs: list[ComponentInput], prepared: list[PreparedComponent], stages,
                     devices: list[Device], cut, options: PlanOptions, family, guidance,
                     shape) -> tuple[ParallelLayout, Placement, list[PreparedComponent]]:
    """The layout for the traced placement (the denoiser's weights and activations, each rank's budget and the peaks
    of the other stages as the single-process plan places them), with the placement and components the plan keeps:
    when auto chooses pipeline parallel, the denoiser is placed again as its cut (`_with_cut`)."""
    from dm_cli.planning.parallel import DenoiserLoad, Rank, choose_layout

    experts = [n for n in (family.denoiser, *family.experts) if n in placement.components]
    placed = [placement.components[n] for n in experts]
    params = max(sum(t.numel for t in p.skeleton.tensors) for p in prepared if p.spec.name in experts)
    activation_peaks = {s.name: s.activation_peak for s in specs}
    split_peaks: dict[int, int] = {}
    other_peaks: dict[int, int] = {}
    for stage in placement.stages:
        denoise = any(n in stage.components for n in experts)
        for key, use in stage.use.items():
            gpu = device_key(key)
            if isinstance(gpu, int):
                split_peaks[gpu] = max(split_peaks.get(gpu, 0), use.peak)
                if not denoise:
                    other_peaks[gpu] = max(other_peaks.get(gpu, 0), use.peak)
    load = DenoiserLoad(tuple(c.weights_bytes for c in placed), max(activation_peaks.get(n, 0) for n in experts),
                        params, max(c.hops for c in placed), max(c.offloaded_bytes for c in placed), split_peaks)
    by_key = {d.key: d for d in devices}
    ranks = [Rank(r, by_key[r].capacity or 0, by_key[r].overhead, other_peaks.get(r, 0))
             for r in range(options.parallel.world_size)]
    layout = choose_layout(options.parallel, guidance, shape, load, ranks, cut)
    fixed = next((s for s in specs if s.name == family.denoiser), None)
    if layout.layout != "pipeline" or fixed is None or fixed.fixed_map is not None:
        return layout, placement, prepared
    cut_specs = [replace(s, fixed_map=dict(cut.block_map)) if s is fixed else s for s in specs]
    cut_placement = _plan_or_none(cut_specs, stages, devices, options)
    if cut_placement is None:  # the cut fits each rank, but not one process's device map: the split it is compared to
        layout = choose_layout(options.parallel, guidance, shape, load, ranks,
                               f"pipeline parallel's cut of {family.denoiser} fits each rank but not as one process's "
                               "device map, which the plan must stay.")
        return layout, placement, prepared
    return layout, cut_placement, _with_cut(prepared, family.denoiser, cut)


def _pipeline_cut(prepared: list[PreparedComponent], devices: list[Device], options: PlanOptions, family, guidance,
                  shape) -> tuple:
    """(pipeline parallel's cut of the denoiser (planning/parallel.py `pipeline_cut`) or the sentence why there is
    none, the components): the cut None when the request does not consider pipeline parallel. An explicit --parallel
    pipeline that cannot be cut, or does not fit a rank, is refused here, before any placement; else its components
    come back with the denoiser's map fixed to the cut (never searched)."""
    from dm_cli.planning.parallel import Rank, Unit, beside_slice, pipeline_candidate, pipeline_cut, weight_tokens

    request = options.parallel
    prep = next((p for p in prepared if p.spec.name == family.denoiser), None)
    if request.choice not in ("pipeline", "auto") or prep is None:
        return None, prepared
    owner = {key: block.name for block in prep.spec.blocks for key in block.keys}
    params = dict.fromkeys(owner.values(), 0)
    work = dict.fromkeys(owner.values(), 0)
    for tensor in prep.skeleton.tensors:  # each tensor's parameters to the block whose key covers it
        name = tensor.name
        while name and name not in owner:
            name = name.rpartition(".")[0]
        if name in owner:
            params[owner[name]] += tensor.numel
            work[owner[name]] += tensor.numel * weight_tokens(tensor.name, shape)
    units = [Unit(b.name, b.keys, b.bytes, params[b.name], work[b.name]) for b in prep.spec.blocks]
    by_key = {d.key: d for d in devices}
    shared = sum(u.bytes for u in units if not u.entries)
    extras = beside_slice(shared, prep.spec.activation_peak, shape, request.planned_in_flight)
    room = [max(0, (by_key[r].capacity or 0) - by_key[r].overhead - extras) if r in by_key else 0
            for r in range(request.world_size)]  # the block weights each rank can hold beside the rest
    cut = pipeline_cut(units, request.world_size, shape, room)
    if request.choice == "pipeline":
        ranks = [Rank(r, by_key[r].capacity or 0, by_key[r].overhead) for r in range(request.world_size)]
        pipeline_candidate(request, shape, prep.spec.activation_peak, ranks, cut, {})  # refuses, one sentence
        return cut, _with_cut(prepared, family.denoiser, cut)
    return cut, prepared


def _with_cut(prepared: list[PreparedComponent], denoiser: str, cut) -> list[PreparedComponent]:
    """The components with the denoiser's map fixed to the cut (the search keeps it and places the rest around it)."""
    return [replace(p, spec=replace(p.spec, fixed_map=dict(cut.block_map))) if p.spec.name == denoiser else p
            for p in prepared]


def input_image_report(source, comps, prepared: list[PreparedComponent], options: PlanOptions) -> dict:
    """What the input images add to the denoiser's sequence (`Family.reference_tokens`): the tokens of each, and
    the denoiser's activations with them (the plan's trace) and without them (a second trace); {} when they add
    none (no images, a weights-only plan, image-to-image)."""
    inputs = options.inputs
    family, denoiser, vae = family_parts(source.pipeline_class, source.components if source.pipeline_class else comps)
    if inputs.weights_only or not inputs.image_sizes or family is None or denoiser is None:
        return {}
    tokens = family.reference_tokens(inputs, vae.config if vae is not None else None)
    prep = next((p for p in prepared if p.spec.name == denoiser.name), None)
    if not tokens or prep is None:
        return {}
    bare = trace_facts(denoiser, source.pipeline_class, replace(inputs, image_sizes=()), prep.dtype, options.use_cache)
    return {"component": denoiser.name, "tokens": list(tokens), "activation_peak_bytes": prep.spec.activation_peak,
            "activation_peak_without_bytes": bare.activation_peak}


def make_named_plan(root: str, spec: str, options: PlanOptions) -> Plan:
    """make_plan for `root`, the plan (or its DoesNotFitError) naming SOURCE as the user gave it
    (`spec`: the bundled demo resolves to a cache path nobody typed)."""
    try:
        plan = make_plan(root, options)
    except DoesNotFitError as error:
        raise DoesNotFitError(str(error).replace(root, spec), error.details) from None
    plan.source = spec
    return plan


def _check_weights_only(inputs: InputSpec) -> None:
    """What InputSpec alone cannot refuse (it checks each field's range, fps included): fields that go together."""
    if (inputs.height == 0) != (inputs.width == 0):
        raise UsageError("Give --height 0 and --width 0 together for a weights-only plan.")


def settled_options(source, comps, options: PlanOptions) -> PlanOptions:
    """The generation settled and checked as `dmap run` settles and checks its own (`Family.settle`, then
    `Family.validate`): every default the run would fill in (size, frames, guidance, the family's settings) is
    the plan's, from the same Generation. Multiples of 8 for what no family knows."""
    inputs = options.inputs
    if 0 in (inputs.height, inputs.width) and None in (inputs.height, inputs.width):
        inputs = replace(inputs, height=0, width=0)  # --height 0 (or --width 0) alone: weights only
    _check_weights_only(inputs)
    options = replace(options, inputs=inputs)
    family, denoiser, vae = family_parts(source.pipeline_class, source.components if source.pipeline_class else comps)
    if family is None or denoiser is None:
        if options.settings:
            raise UsageError(f"dmap knows no pipeline family in {source.spec}: drop --{next(iter(options.settings))}.")
        inputs = replace(inputs, height=FALLBACK_IMAGE_SIZE if inputs.height is None else inputs.height,
                         width=FALLBACK_IMAGE_SIZE if inputs.width is None else inputs.width)
        if inputs.height % 8 or inputs.width % 8:
            raise UsageError(f"--height and --width must be multiples of 8 (got {inputs.height}x{inputs.width}).")
        if inputs.num_frames is not None or inputs.fps is not None:
            raise UsageError(f"dmap knows no video pipeline in {source.spec}: drop --frames and --fps.")
        return replace(options, inputs=inputs)
    vae_config = vae.config if vae is not None else None
    generation = family.settle(options.generation(), denoiser.config or {}, vae_config)
    family.validate(generation, source.pipeline_class or denoiser.cls, denoiser.config or {}, vae_config,
                    tuple(c.name for c in source.components))
    return options.with_generation(generation)


# --- tiled decode ---------------------------------------------------------------------------------


@dataclass
class TilingChoice:
    """Which decode components tile (name -> untiled activation estimate), the placement and specs that
    go with it (placement None: nothing fits), and what the plan should say about it."""

    placement: Placement | None
    specs: list[ComponentInput]
    tiled: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def decode_components(prepared: list[PreparedComponent], pipeline_class: str | None,
                      inputs: InputSpec) -> list[PreparedComponent]:
    """Components the pipeline calls through `decode` (the VAE): where diffusers' tiling applies."""
    from dm_cli.families import call_spec

    if inputs.weights_only:
        return []
    found = []
    for prep in prepared:
        if prep.source.config is None:
            continue
        spec = call_spec(prep.source, pipeline_class, inputs)
        if spec is not None and spec.method == "decode":
            found.append(prep)
    return found


def tiled_spec(prep: PreparedComponent, pipeline_class: str | None, inputs: InputSpec,
               use_cache: bool = True, on_progress: Callable[[str], None] | None = None) -> ComponentInput | str:
    """The component with the activations of its tiled decode (the same call traced with enable_tiling()),
    or a sentence saying why there is none (a class without enable_tiling; a cached trace imports no torch)."""
    facts = trace_facts(prep.source, pipeline_class, inputs, prep.dtype, use_cache, tiled=True, on_progress=on_progress)
    if facts.warning:
        return facts.warning
    spec, _ = _component_spec(prep.source, prep.skeleton, facts, inputs, prep.effective_dtype, prep.weights, prep.dtype)
    return spec


def choose_tiling(prepared: list[PreparedComponent], pipeline_class: str | None, stages, devices: list[Device],
                  options: PlanOptions, placement: Placement | None) -> TilingChoice:
    """Tile a decode only when the plan needs it: the untiled one does not fit (`placement` None) or offloads
    more than the tiled one. Tiles blend at their seams, so pixels change slightly: never tile otherwise.

    A tiled trace costs a minute for Wan 2.2 at 480x832x81 (15 tiles x 21 latent frames on meta), so it
    runs only for decodes whose activations matter: those without which the plan would do better.
    """
    inputs = options.inputs
    specs = [p.spec for p in prepared]
    what = f"{inputs.height}x{inputs.width}" + (f", {inputs.num_frames} frames" if inputs.num_frames else "")

    def attempt(trial: list[ComponentInput]) -> Placement | None:
        return _plan_or_none(trial, stages, devices, options)

    def better(trial: Placement | None) -> bool:
        return trial is not None and (placement is None or trial.offloaded_bytes < placement.offloaded_bytes)

    def swapped(replacements: dict[str, ComponentInput]) -> list[ComponentInput]:
        return [replacements.get(s.name, s) for s in specs]

    usable: dict[str, ComponentInput] = {}
    warnings: list[str] = []
    for prep in decode_components(prepared, pipeline_class, inputs):
        spec = prep.spec
        bare = _without_activations(spec, io_bytes=False)  # its inputs and outputs stay full size, tiled or not
        if not spec.activation_peak or not better(attempt(swapped({spec.name: bare}))):
            continue  # its activations are not what the plan lacks: tiling cannot help
        tiled = tiled_spec(prep, pipeline_class, inputs, options.use_cache, options.on_progress)
        if isinstance(tiled, str):
            outcome = "the plan does not fit" if placement is None else (
                f"the plan offloads {format_size(placement.offloaded_bytes)} because of them")
            warnings.append(f"{spec.name}: the decode at {what} needs {format_size(spec.activation_peak)} of activations "
                            f"and {outcome}; a tiled decode would need less, but {tiled}")
        elif tiled.activation_peak < spec.activation_peak:  # else tiling does not start at this size
            usable[spec.name] = tiled
    if not usable:
        return TilingChoice(placement, specs, {}, warnings)
    trial = swapped(usable)
    tiled_placement = attempt(trial)
    untiled = {name: _spec(prepared, name).activation_peak for name in usable}
    if not better(tiled_placement):
        if placement is None:  # even tiled it does not fit: the shortfall is the tiled plan's
            warnings += [f"(That is with {name} decoding in tiles: {format_size(spec.activation_peak)} of activations "
                         f"instead of {format_size(untiled[name])}.)" for name, spec in usable.items()]
            return TilingChoice(None, trial, {}, warnings)
        return TilingChoice(placement, specs, {}, warnings)
    for name, spec in usable.items():
        before, after = format_size(untiled[name]), format_size(spec.activation_peak)
        for stage in tiled_placement.stages:
            if name in stage.components:
                stage.note = "; ".join(filter(None, [stage.note, f"{name}: tiled decode, activations {after} "
                                                                  f"instead of {before}"]))
        outcome = "does not fit" if placement is None else (
            f"would offload {format_size(placement.offloaded_bytes)} instead of "
            f"{format_size(tiled_placement.offloaded_bytes)}")
        warnings.append(f"{name} decodes in tiles ({spec.cls}.enable_tiling()): at {what} an untiled decode needs "
                        f"{before} of activations and the plan {outcome}; tiled it needs {after}. Pixels near the "
                        "tile seams differ slightly from an untiled decode.")
    return TilingChoice(tiled_placement, trial, untiled, warnings)


def _spec(prepared: list[PreparedComponent], name: str) -> ComponentInput:
    return next(p.spec for p in prepared if p.spec.name == name)


def run_split_check(plan: Plan, prepared: list[PreparedComponent], pipeline_class: str | None,
                    options: PlanOptions) -> dict:
    """Simulate every split component on the meta device with virtual devices; list what mixes devices."""
    problems: list[str] = []
    checked: list[str] = []
    try:
        from dm_cli.planning.trace import check_device_map
    except ImportError:
        return {"ran": False, "problems": [], "reason": "the meta tracer is not available"}
    inputs = options.inputs
    for prep in prepared:
        placed = plan.components[prep.spec.name]
        devices = set(placed.device_map.values())
        if len(devices) < 2 or prep.source.config is None:
            continue
        checked.append(prep.spec.name)
        if options.on_progress is not None:
            options.on_progress(f"Checking the split of {prep.spec.name} ({prep.spec.cls}) over "
                                f"{len(devices)} devices on the meta device")
        found = _cached_check(prep, pipeline_class, inputs, placed.device_map, options.use_cache, check_device_map)
        problems.extend(f"{prep.spec.name}: {problem}" for problem in found)
    problems += step_cache_check(plan, prepared, pipeline_class, options)
    return {"ran": True, "components": checked, "problems": problems}


def _cached_check(prep, pipeline_class, inputs, device_map, use_cache: bool, check_device_map) -> list[str]:
    """A check runs a meta forward (seconds for FLUX): remember its verdict per map and inputs (the key
    includes the code that checks, see cache.producer)."""
    from dm_cli.io.cache import cache_key, read_cached, write_cached

    key = cache_key({"class": prep.source.cls, "config": prep.source.config, "pipeline": pipeline_class,
                     "inputs": inputs.to_json(), "dtype": prep.dtype, "map": list(device_map.items())})
    cached = read_cached("checks", key) if use_cache else None
    if cached is not None and isinstance(cached.get("problems"), list):
        return list(cached["problems"])
    problems = list(check_device_map(prep.source, pipeline_class, inputs, prep.dtype, device_map))
    if use_cache and not any("was not checked" in p for p in problems):
        write_cached("checks", key, {"problems": problems})
    return problems


def _explain_offload(plan: Plan, prepared, stages, options: PlanOptions) -> None:
    """When something is offloaded, say whether activations and overhead are the reason."""
    if not plan.offloaded_bytes or options.inputs.weights_only:
        return
    specs = [_without_activations(p.spec, io_bytes=True) for p in prepared]
    bare = [Device(d.key, d.capacity, 0) for d in plan.devices]
    weights_only = _plan_or_none(specs, stages, bare, options)
    if weights_only is None:
        return
    if weights_only.offloaded_bytes < plan.offloaded_bytes:
        act = max(plan.activation_peaks.values(), default=0)
        gpu_overhead = sum(d.overhead for d in plan.devices if d.is_gpu)
        plan.warnings.append(
            f"Weights alone would offload {format_size(weights_only.offloaded_bytes)} instead of "
            f"{format_size(plan.offloaded_bytes)}: the activations for {options.inputs.height}x{options.inputs.width} "
            f"(up to {format_size(act)} per component) and {format_size(gpu_overhead)} of GPU overhead cost the rest."
        )


def _does_not_fit(source_spec, source, comps, stages, devices, options, formats, specs,
                  notes: list[str] | tuple = ()) -> DoesNotFitError:
    """The shortfall per device and the nearest change that fits (for `specs`: a tiled decode's when tried)."""
    gpus = [d for d in devices if d.is_gpu]
    total_weights = sum(s.weights_bytes for s in specs)
    biggest_act = max((s.activation_peak for s in specs), default=0)
    suggestions: list[str] = []
    shortfall: dict[str, int] = {}

    def fits(trial_devices, trial_specs=specs) -> Placement | None:
        return _plan_or_none(trial_specs, stages, trial_devices, options)

    # more memory on one GPU
    upper = total_weights + biggest_act + sum(d.overhead for d in devices)
    for gpu in gpus:
        def with_extra(extra, gpu=gpu):
            return [Device(d.key, (d.capacity or 0) + extra, d.overhead) if d is gpu else d for d in devices]

        if fits(with_extra(upper)) is None:
            continue
        low, high = 0, upper
        while high - low > max(1, upper // 4000):
            mid = (low + high) // 2
            if fits(with_extra(mid)) is None:
                low = mid
            else:
                high = mid
        shortfall[gpu.name] = high
    if shortfall:
        best = min(shortfall, key=shortfall.get)
        suggestions.append(f"needs {format_size(shortfall[best])} more on GPU {best}")
    # cpu offload (a cpu not listed), or more cpu memory (a cpu listed, above its budget)
    cpu = next((d for d in devices if d.key == "cpu"), None)
    if cpu is None or cpu.capacity is not None:
        trial = [d for d in devices if d.key not in ("cpu",)] + [Device("cpu", max(upper * 2, cpu.capacity if cpu
                                                                                   else 0), cpu.overhead if cpu else 0)]
        trial.sort(key=lambda d: device_rank(d.key))
        placed = fits(trial)
        if placed is not None:
            needed = max((u.peak for s in placed.stages for k, u in s.use.items() if k == "cpu"), default=1)
            suggestion = _cpu_suggestion(cpu, needed)
            if suggestion:
                suggestions.append(suggestion)
    # smaller resolution
    if not options.inputs.weights_only and comps and comps[0].config is not None:
        for size in (1024, 768, 512):
            if size >= min(options.inputs.height, options.inputs.width):
                continue
            smaller = replace(options.inputs, height=size, width=size)
            try:
                trial_specs = [prepare_component(c, source.pipeline_class, smaller, options.placement.dtype, options.use_cache,
                                                 formats).spec for c in comps]
            except Exception:  # a failed trace only loses a suggestion
                break
            if fits(devices, trial_specs) is not None:
                suggestions.append(f"fits at {size}x{size}")
                break
    suggestions += _fewer_or_smaller_images(source, comps, options, formats, lambda s: fits(devices, s) is not None)
    names = "+".join(s.name for s in specs) if len(specs) <= 3 else f"{len(specs)} components"
    spec_text = ",".join(f"{d.name}={format_size(d.capacity)}" if d.capacity is not None else d.name for d in devices)
    where = f"{options.inputs.height}x{options.inputs.width}" if not options.inputs.weights_only else "weights only"
    need = (f"{format_size(total_weights)} of weights"
            + (f" + up to {format_size(biggest_act)} of activations" if biggest_act else ""))
    message = f"{source_spec} ({names}, {need}, {where}) does not fit on {spec_text}"
    if shortfall:
        message += "; shortfall per device: " + ", ".join(
            f"GPU {k} {format_size(v)}" for k, v in shortfall.items())
    message += ("; nearest change that fits: " + " or ".join(suggestions)) if suggestions else (
        "; no single change found that fits: add devices or a disk")
    message += "." + "".join(f" {note}" for note in notes)
    return DoesNotFitError(message, {"shortfall_bytes": shortfall, "suggestions": suggestions})


def _fewer_or_smaller_images(source, comps, options: PlanOptions, formats, fits: Callable) -> list[str]:
    """For input images that lengthen the denoiser's sequence (`Family.reference_tokens`): the most of them that
    fit (as many as the family needs at least), else all of them at 512x512; [] when neither fits or none apply."""
    inputs = options.inputs
    family, _, vae = family_parts(source.pipeline_class, source.components if source.pipeline_class else comps)
    if inputs.weights_only or family is None or not inputs.image_sizes or not comps or comps[0].config is None:
        return []
    if not family.reference_tokens(inputs, vae.config if vae is not None else None):
        return []

    def trial(sizes) -> bool:
        smaller = replace(inputs, image_sizes=tuple(sizes))
        try:
            return fits([prepare_component(c, source.pipeline_class, smaller, options.placement.dtype, options.use_cache,
                                           formats).spec for c in comps])
        except Exception:  # a failed trace only loses a suggestion
            return False

    sizes = inputs.image_sizes
    for count in range(len(sizes) - 1, max(family.min_input_images, 0) - 1, -1):
        if trial(sizes[:count]):
            return [f"fits with {count} input image(s) (the first {count})" if count else "fits without input images"]
    if any(w * h > 512 * 512 for w, h in sizes) and trial([(512, 512)] * len(sizes)):
        return [f"fits with the {len(sizes)} input image(s) at 512x512"]
    return []


def _cpu_suggestion(cpu: Device | None, needed: int) -> str | None:
    """What to change for `needed` bytes on the cpu: offload to it when it is not listed, more of it when its
    budget is smaller (None when it already has that much), and a note when this machine has less RAM."""
    if cpu is None:
        text = f"fits with cpu={_round_up_gb(needed)} offload"
    elif needed > cpu.capacity:
        text = f"needs {format_size(needed - cpu.capacity)} more on cpu (cpu={_round_up_gb(needed)})"
    else:
        return None
    ram = total_ram()
    if ram and needed > ram:
        text += f", more than this machine's {format_size(ram)} of RAM"
    return text


def total_ram() -> int | None:
    """This machine's physical memory (None when it cannot be read)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        try:
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None


def _plan_or_none(specs, stages, devices, options: PlanOptions) -> Placement | None:
    """plan_pipeline, None where nothing fits: the tiling choice and the suggestions try many variants."""
    try:
        return plan_pipeline(specs, stages, devices, options.placement.strategy, options.placement.mode)
    except NoFit:
        return None


def _without_activations(spec: ComponentInput, io_bytes: bool) -> ComponentInput:
    """The component with no activations (and with `io_bytes`, no inputs/outputs): what weights alone need."""
    return replace(spec, blocks=[replace(b, activation=0) for b in spec.blocks], activation_peak=0,
                   io_bytes=0 if io_bytes else spec.io_bytes)


def _round_up_gb(num_bytes: int) -> str:
    """A size for --max-memory, rounded up to one decimal in the largest fitting unit."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale or unit == "KB":
            tenths = -(-num_bytes * 10 // scale)
            return f"{tenths / 10:g}{unit}"
    raise AssertionError("unreachable")

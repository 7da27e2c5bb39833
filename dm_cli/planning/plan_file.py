"""The Plan and its `dmap-plan` JSON (v1; v2 with tiled decode; docs/CONTRACTS.md): written by `dmap plan
--output`, read back as input like any other, every field checked as the command line that wrote it checks it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dm_cli.devices import device_key, device_label, is_gpu
from dm_cli.errors import CheckpointError, UsageError
from dm_cli.families.stages import NAMED_VALUES
from dm_cli.inputs import InputSpec, PlacementSpec, StepCache
from dm_cli.io.atomic import atomic_write
from dm_cli.io.checkpoint import read_json_object
from dm_cli.io.strict_json import json_text
from dm_cli.model.formats.weight_formats import STORAGE_DTYPES, format_of, storage_dtype
from dm_cli.planning.modes import Mode, Strategy
from dm_cli.planning.parallel.parallel_layout import ParallelLayout
from dm_cli.planning.placement.placement import ComponentPlacement, DeviceUse, StagePlacement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.step_cache import parse_cache
from dm_cli.planning.time.overlap import MODES as OFFLOAD_MODES
from dm_cli.units import (
    FLOATING_DTYPES,
    MAX_GPU_INDEX,
    MAX_SIZE_BYTES,
    MAX_SIZE_TEXT,
    format_size,
    parse_dtype,
    shorten,
)

PLAN_FORMAT = "dmap-plan"
PLAN_VERSION = 1
# Version 2 is version 1 plus `tiled_decode`, written only when a component decodes in tiles: a reader
# that does not know tiling then refuses the plan, instead of decoding untiled and running out of memory.
TILED_PLAN_VERSION = 2


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
    # the denoise stage's predicted seconds per step, image and queue on a device profile (planning/time/step_time.py);
    # written only when there is one (a known family, traced)
    predicted_time: dict = field(default_factory=dict)
    # on a plan whose activations CUDA's kernels were counted for (gpu_kernels.py): component -> {"attention":
    # {kernel: calls}, "peak_at": {"module", "op", "kernel_bytes"}}; written only then
    kernels: dict = field(default_factory=dict)

    def peak_set_by(self, stage) -> dict:
        """What sets a stage's activation peak on a GPU: its component with the most activations, the module and op
        at its peak and the bytes the kernel held beside its output ({} without CUDA's kernels)."""
        counted = [name for name in stage.components if self.kernels.get(name, {}).get("peak_at")]
        if not counted:
            return {}
        name = max(counted, key=lambda n: self.activation_peaks.get(n, 0))
        return {"component": name, "activation_bytes": self.activation_peaks.get(name, 0),
                **self.kernels[name]["peak_at"]}

    def peak_lines(self) -> list[str]:
        """One sentence per GPU: the stage of its highest peak and what sets it (from `peak_set_by`)."""
        lines = []
        for device in sorted({k for s in self.stages for k in s.peak_bytes if k.isdigit()}, key=int):
            stage = max((s for s in self.stages if device in s.peak_bytes), key=lambda s: s.peak_bytes[device])
            cause = self.peak_set_by(stage)
            if not cause:
                continue
            kernel = cause.get("kernel_bytes", 0)
            held = f", its kernel holding {format_size(kernel, True)} beside its output" if kernel else ""
            lines.append(f"GPU {device}'s peak, {format_size(stage.peak_bytes[device], True)}, is the {stage.name} "
                         f"stage's: {cause['component']}'s activations reach {format_size(cause['activation_bytes'], True)} "
                         f"at {cause.get('module') or 'its root'} ({cause.get('op', '?')}{held}), counted as CUDA's "
                         f"kernels hold them at {self.inputs.height}x{self.inputs.width}.")
        return lines

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
                    **({"offload": c.offload} if c.offload else {}),
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
                    **({"peak_set_by": self.peak_set_by(s), "attention": _attention_of(self.kernels, s.components)}
                       if self.kernels else {}),
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
            **({"predicted_time": self.predicted_time} if self.predicted_time else {}),
            **({"kernels": self.kernels} if self.kernels else {}),
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
        strategy = _choice(data.get("strategy", "auto"), "'strategy'", Strategy.words())
        mode = _choice(data.get("mode", "staged"), "'mode'", Mode.words())
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
                _offload(c["offload"], f"{where} offload") if "offload" in c else {},
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
            check_weights_only(inputs)  # the family's rules are the run's to apply (Family.validate)
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
            _predicted_time(data["predicted_time"]) if "predicted_time" in data else {},
            _kernels(data.get("kernels", {}), set(components)),
        )


def _attention_of(kernels: dict, components) -> dict:
    """The attention kernels a stage's components were counted with: kernel -> calls, over its components."""
    out: dict[str, int] = {}
    for name in components:
        for kernel, calls in kernels.get(name, {}).get("attention", {}).items():
            out[kernel] = out.get(kernel, 0) + calls
    return out


def _kernels(value, components: set) -> dict:
    """A plan file's `kernels` (informational): per planned component, attention kernel -> calls and the peak's
    module, op and kernel bytes, as short strings and counts (ValueError otherwise)."""
    value = _object(value, "'kernels'")
    out = {}
    for name, entry in value.items():
        if name not in components:
            raise ValueError(f"'kernels' names '{name}', which the plan does not place")
        entry = _object(entry, f"kernels {name}")
        peak = _object(entry.get("peak_at", {}), f"kernels {name} peak_at")
        out[name] = {"attention": {_text(k, f"kernels {name} attention"): _count(v, f"kernels {name} attention")
                                   for k, v in _object(entry.get("attention", {}), f"kernels {name} attention").items()},
                     "peak_at": {"module": _text(peak.get("module", ""), f"kernels {name} module"),
                                 "op": _text(peak.get("op", ""), f"kernels {name} op"),
                                 "kernel_bytes": _count(peak.get("kernel_bytes", 0), f"kernels {name} kernel_bytes")}
                     if peak else {}}
    return out


def _predicted_time(value, depth: int = 0) -> dict:
    """A plan file's `predicted_time` (planning/time/step_time.py): informational, read back as JSON of numbers and short
    strings, at most 3 levels and 200 entries deep (ValueError otherwise)."""
    value = _object(value, "'predicted_time'")
    if len(value) > 200 or depth > 2:
        raise ValueError("'predicted_time' is larger than a prediction")
    out = {}
    for key, entry in value.items():
        if isinstance(entry, dict):
            out[key] = _predicted_time(entry, depth + 1)
        elif isinstance(entry, bool) or not isinstance(entry, (int, float, str)) or (
                isinstance(entry, float) and not math.isfinite(entry)) or (isinstance(entry, str) and len(entry) > 1000):
            raise ValueError(f"'predicted_time' {key!r} must be a finite number or a short string")
        else:
            out[key] = entry
    return out


def _offload(value, where: str) -> dict:
    """A component's `offload` (planning/time/overlap.py): its mode among the two, a short reason, two byte counts."""
    value = _object(value, where)
    return {"mode": _choice(value.get("mode"), f"{where} mode", OFFLOAD_MODES),
            "reason": _text(value.get("reason", ""), f"{where} reason")[:1000],
            "prefetch_bytes": _count(value.get("prefetch_bytes", 0), f"{where} prefetch_bytes"),
            "pinned_bytes": _count(value.get("pinned_bytes", 0), f"{where} pinned_bytes")}


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
    text = json_text(plan.to_json(), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"Cannot write plan to {path}: {error.strerror or error}.") from None


def check_weights_only(inputs: InputSpec) -> None:
    """What InputSpec alone cannot refuse (it checks each field's range, fps included): fields that go together."""
    if (inputs.height == 0) != (inputs.width == 0):
        raise UsageError("Give --height 0 and --width 0 together for a weights-only plan.")

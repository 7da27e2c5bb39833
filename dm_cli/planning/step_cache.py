"""Step caches (`--cache NAME[:K=V,...]`): which of diffusers' cache hooks a request asks for, what they hold and where.

diffusers (0.42) ships the hooks: `FirstBlockCacheConfig` (fbc), `TaylorSeerCacheConfig` (taylorseer) and
`MagCacheConfig` (magcache), applied with `ModelMixin.enable_cache`. dmap writes none of the caching: it parses the
spec (`parse_cache`, one sentence per bad input), builds diffusers' config (`diffusers_config`), and counts what the
hooks keep between steps by running them on the meta device (`measure`): the denoiser's forward with the hooks on,
once per guidance branch (each branch is a cache context with its own state), then the tensors their states hold,
attributed to the block that holds them (fbc and magcache: the first block's input/output and the last block's
residuals; taylorseer: each hooked attention's Taylor terms, `max_order + 1` of them). `placed_bytes` puts those
bytes on the device of their block (a block streamed from cpu or disk keeps them on its execution device), and
`fit` makes the search leave room for them. The split check runs with the hooks on (`check`). `enable` puts the
hooks on, at plan and at run time alike: on a denoiser split over devices, fbc's and magcache's first and last
blocks each take the other's tensors onto their own device (`_across_devices`).

FasterCache and Pyramid Attention Broadcast are not offered: both need a timestep callback into the pipeline's
loop (`current_timestep_callback`) and FasterCache a batched CFG, which FLUX, Wan and Qwen-Image do not run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from dm_cli.devices import device_of, is_gpu
from dm_cli.errors import UsageError
from dm_cli.families import call_spec
from dm_cli.inputs import InputSpec, StepCache
from dm_cli.io.cache import cache_key, read_cached, write_cached
from dm_cli.planning.placement.search import DeviceUse
from dm_cli.planning.trace import trace  # the module: tests replace its _run to see that no trace runs
from dm_cli.planning.trace.trace_session import iter_tensors
from dm_cli.units import shorten

AUTO = "auto"  # a setting left to the family (Key.auto)


@dataclass(frozen=True)
class Key:
    """One setting of a cache: its type, default and bounds (`low_open`: the low bound is excluded). `auto`: the key
    also takes "auto", the family's choice (resolved where the family is known: `resolved_lite`)."""

    type: type
    default: object
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    help: str = ""
    auto: bool = False

    def check(self, value, where: str):
        """The value as this key's type, within bounds, else UsageError (one sentence)."""
        if self.auto and isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        if self.type is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                value = value.lower() in ("true", "1", "yes", "on")
            if not isinstance(value, bool):
                raise UsageError(f"{where} must be true{', false or auto' if self.auto else ' or false'}, "
                                 f"not {shorten(value, quote=True)}.")
            return value
        number = value
        if isinstance(value, str):
            try:
                number = int(value) if self.type is int else float(value)
            except ValueError:
                number = None
        if self.type is int and (isinstance(number, bool) or not isinstance(number, int)):
            raise UsageError(f"{where} must be {self.bounds('a whole number')}, not {shorten(value, quote=True)}.")
        if self.type is float and (isinstance(number, bool) or not isinstance(number, (int, float))
                                   or not math.isfinite(number)):
            raise UsageError(f"{where} must be {self.bounds('a number')}, not {shorten(value, quote=True)}.")
        if (self.low is not None and (number < self.low or (self.low_open and number == self.low))) or (
                self.high is not None and number > self.high):
            raise UsageError(f"{where} must be {self.bounds('a number' if self.type is float else 'a whole number')}, "
                             f"not {shorten(value, quote=True)}.")
        return float(number) if self.type is float else int(number)

    def bounds(self, what: str) -> str:
        if self.low is None:
            return what + ("" if self.high is None else f" at most {self.high:g}")
        if self.low_open:
            return what + f" above {self.low:g}" + ("" if self.high is None else f" and at most {self.high:g}")
        return what + (f" from {self.low:g} to {self.high:g}" if self.high is not None else f" of at least {self.low:g}")


@dataclass(frozen=True)
class CacheKind:
    """A step cache dmap offers: diffusers' config class and the settings it takes from the command line."""

    name: str
    title: str
    config: str  # the diffusers config class
    keys: dict = field(default_factory=dict)  # setting -> Key
    data_dependent: bool = False  # whether it skips on the tensors' values (ranks under context parallel diverge)
    head_and_tail: bool = False  # True: one state shared by the first and the last block (fbc, magcache)


CACHES: dict[str, CacheKind] = {
    "fbc": CacheKind("fbc", "First-Block Cache", "FirstBlockCacheConfig", {
        "threshold": Key(float, 0.05, 0.0, 1.0, low_open=True,
                         help="skip the remaining blocks when the first block's residual changed less than this"),
    }, data_dependent=True, head_and_tail=True),
    "taylorseer": CacheKind("taylorseer", "TaylorSeer", "TaylorSeerCacheConfig", {
        "cache_interval": Key(int, 5, 1, 1000, help="steps between full computations"),
        "disable_cache_before_step": Key(int, 3, 0, 10_000, help="steps computed in full first"),
        "max_order": Key(int, 1, 0, 4, help="order of the Taylor expansion (terms kept: max_order + 1)"),
        # auto: the family's (Family.step_caches["taylorseer"]["lite"]): lite where the MLPs, which full mode still
        # runs, are most of a block's work (FLUX, Qwen-Image: full mode could not reach 1.5x there, issue 40)
        "lite": Key(bool, AUTO, auto=True, help="predict proj_out only and skip whole blocks (less memory); auto: "
                    "the family's choice"),
    }),
    "magcache": CacheKind("magcache", "MagCache", "MagCacheConfig", {
        "threshold": Key(float, 0.06, 0.0, 1.0, low_open=True, help="accumulated error below which a step is skipped"),
        "max_skip_steps": Key(int, 3, 1, 1000, help="most consecutive steps skipped"),
        "retention_ratio": Key(float, 0.2, 0.0, 1.0, help="fraction of the first steps never skipped"),
    }, head_and_tail=True),
}
NAMES = tuple(CACHES)
# diffusers' other cache hooks, which dmap does not offer, and why; keyed by the name without "-" and "_"
_TIMESTEP = "needs a timestep callback into the pipeline's loop, which dmap does not wire into its hooks yet"
NOT_OFFERED = {
    "fastercache": f"diffusers' FasterCache {_TIMESTEP}, and a batched CFG, which FLUX, Wan and Qwen-Image do not run",
    "pyramidattentionbroadcast": f"diffusers' Pyramid Attention Broadcast {_TIMESTEP}",
}
NOT_OFFERED["pab"] = NOT_OFFERED["pyramidattentionbroadcast"]


def parse_cache(value, where: str = "--cache") -> StepCache | None:
    """A step cache from `--cache NAME[:K=V,...]`, the API's `cache=` (that string, a StepCache, or a dict
    {"name": NAME, K: V, ...}) or a queue item's "cache"; None or "none": no cache. Every default filled in. An
    empty name is refused (not read as "none"), and "none" takes no settings."""
    if value is None:
        return None
    if isinstance(value, StepCache):
        return parse_cache({"name": value.name, **dict(value.settings)}, where)
    if isinstance(value, dict):
        given = dict(value)
        name = given.pop("name", None)
        if not isinstance(name, str):
            raise UsageError(f"{where} must name its cache: {{\"name\": \"fbc\", ...}} (one of {', '.join(NAMES)}).")
    elif isinstance(value, str):
        text = value.strip()
        name, _, rest = text.partition(":")
        given = {}
        for item in filter(None, (part.strip() for part in rest.split(","))) if rest.strip() else ():
            key, sep, raw = item.partition("=")
            if not sep or not key.strip() or not raw.strip():
                raise UsageError(f"{where} {shorten(text)}: '{shorten(item)}' needs a value, like {key.strip() or 'KEY'}=VALUE.")
            if key.strip() in given:
                raise UsageError(f"{where} {shorten(text)} gives '{key.strip()}' twice.")
            given[key.strip()] = raw.strip()
        if rest and not given:
            raise UsageError(f"{where} {shorten(text)}: after ':' come settings KEY=VALUE, comma-separated.")
    else:
        raise UsageError(f"{where} takes NAME[:KEY=VALUE,...] (a string), not a {type(value).__name__}.")
    name = name.strip().lower()
    if not name:  # `--cache ''` is no choice at all, not a quiet "none"
        raise UsageError(f"{where} is empty: give a cache name ({', '.join(NAMES)}, with settings as "
                         "NAME:KEY=VALUE,...) or none.")
    if name == "none":
        if given or (isinstance(value, str) and ":" in value):
            raise UsageError(f"{where} none takes no settings: give none alone, or a cache ({', '.join(NAMES)}) "
                             "with its settings.")
        return None
    kind = CACHES.get(name)
    bare = name.replace("-", "").replace("_", "")
    if bare in NOT_OFFERED:
        raise UsageError(f"{where} {name}: {NOT_OFFERED[bare]}; use {', '.join(NAMES)} or none.")
    if kind is None:
        raise UsageError(f"Unknown step cache {shorten(name, quote=True)} for {where}: use {', '.join(NAMES)} "
                         "(with settings as NAME:KEY=VALUE,..., e.g. fbc:threshold=0.05) or none.")
    unknown = sorted(str(k) for k in given if k not in kind.keys)
    if unknown:
        raise UsageError(f"{where} {name} has no setting {shorten(unknown[0], quote=True)}: its settings are "
                         f"{', '.join(kind.keys)}.")
    settings = {k: key.check(given[k], f"{where} {name}:{k}") if k in given else key.default
                for k, key in kind.keys.items()}
    return StepCache(name, tuple(sorted(settings.items())))


# --- diffusers' configs --------------------------------------------------------------------------


def diffusers_config(cache: StepCache, family, steps: int | None = None, dtype: str | None = None):
    """diffusers' config for `cache` on `family`'s denoiser (the family's own defaults under the user's settings):
    magcache is given the family's magnitude ratios and the run's number of steps."""
    import diffusers  # lazy: diffusers (heavy, off start-up)

    kind = CACHES[cache.name]
    own = dict((getattr(family, "step_caches", {}) or {}).get(cache.name, {}))
    values = dict(cache.settings)
    cls = getattr(diffusers, kind.config)
    if cache.name == "fbc":
        return cls(threshold=values["threshold"])
    if cache.name == "taylorseer":
        import torch  # lazy: torch (heavy, off start-up)

        lite = resolved_lite(cache, family)
        kwargs = {"cache_interval": values["cache_interval"], "disable_cache_before_step": values["disable_cache_before_step"],
                  "max_order": values["max_order"], "use_lite_mode": lite,
                  "taylor_factors_dtype": getattr(torch, dtype) if dtype else torch.bfloat16}
        if own.get("cache_identifiers") and not lite:
            kwargs["cache_identifiers"] = list(own["cache_identifiers"])
        return cls(**kwargs)
    if cache.name == "magcache":
        ratios = own.get("mag_ratios")
        if ratios == "flux":
            from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS  # lazy: diffusers (heavy, off start-up)

            ratios = FLUX_MAG_RATIOS
        return cls(threshold=values["threshold"], max_skip_steps=values["max_skip_steps"],
                   retention_ratio=values["retention_ratio"], num_inference_steps=steps or 28, mag_ratios=ratios)
    raise AssertionError(f"no config for {cache.name}")


def resolved_lite(cache: StepCache, family) -> bool:
    """taylorseer's `lite` as it runs: the user's true or false, else (auto) the family's choice
    (`step_caches["taylorseer"]["lite"]`, False where the family names none). Lite skips whole blocks on predicted
    steps; full mode predicts only the attentions and still runs the MLPs, which in FLUX.1 [dev] at 1024x1024 are
    58% of a call's FLOPs: full mode skips at most 1.36x at 16 steps and 1.43x at 28 (scripts/bench_cache.py
    --flops), lite 2.67x and 3.5x. Wan's attentions over 81 frames are most of its work: full mode there gains 1.95x
    at 16 steps and keeps the MLPs exact."""
    value = cache.setting("lite", AUTO)
    if value == AUTO:
        return bool(((getattr(family, "step_caches", {}) or {}).get("taylorseer") or {}).get("lite", False))
    return bool(value)


def enable(model, cache: StepCache, family, steps: int | None = None, dtype: str | None = None) -> None:
    """diffusers' hooks for `cache` on `model` (`enable_cache`), fbc's and magcache's made to run on a split."""
    model.enable_cache(diffusers_config(cache, family, steps, dtype))
    if CACHES[cache.name].head_and_tail:
        _across_devices(model)


# fbc, magcache: the tensors one end block's hook keeps in the shared state for the other end block
_SHARED = ("head_block_output", "head_block_input", "tail_block_residuals", "previous_residual")


def _across_devices(model) -> int:
    """fbc and magcache keep one state for the first and the last block, and each of the two hooks computes with
    the other's tensors (the last block subtracts the first's output or input; the first adds the last's residuals
    when it skips). On a denoiser split over two devices those sit on two devices: each end block's hook here takes
    its call's tensors and the other end's state onto its own execution device for that call (a copy only where
    they differ), and leaves the state where it was, as the plan counts it. Returns the hooks wrapped."""
    wrapped = 0
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            ends = "Head" in type(hook).__name__ or getattr(hook, "is_tail", False)
            if ends and getattr(hook, "state_manager", None) is not None and not getattr(hook, "_dmap_devices", False):
                # the registry calls `fn_ref.forward` (the hook's new_forward, bound to the module when registered)
                hook.fn_ref.forward = functools.partial(_on_own_device(hook, hook.fn_ref.forward), module)
                hook._dmap_devices = True
                wrapped += 1
    return wrapped


def _on_own_device(hook, forward):
    def new_forward(module, *args, **kwargs):
        device = _execution_device(module)
        manager = hook.state_manager
        if device is None or manager._context is None:
            return forward(*args, **kwargs)
        args, kwargs = _to_device(args, device), _to_device(kwargs, device)
        state = manager.get_state()
        swapped = {}
        for name in _SHARED:
            value = getattr(state, name, None)
            if value is not None:
                swapped[name] = (value, _to_device(value, device))
                setattr(state, name, swapped[name][1])
        try:
            return forward(*args, **kwargs)
        finally:
            for name, (value, moved) in swapped.items():
                if getattr(state, name, None) is moved:  # not replaced by this call: back to where it is kept
                    setattr(state, name, value)

    return new_forward


def _execution_device(module):
    """Where `module` computes: accelerate's execution device (a split or streamed block), else its weights'."""
    import torch  # lazy: torch (heavy, off start-up)

    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    weight = next(module.parameters(), None)
    return weight.device if weight is not None else None


def _to_device(value, device):
    """`value` with each tensor in it on `device` (`to` even where it is there already: under the split check's
    virtual devices that is what says the hook moves it)."""
    import torch  # lazy: torch (heavy, off start-up)

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


# --- what the hooks hold --------------------------------------------------------------------------

HEAD_STATE = ("head_block_output", "head_block_residual", "head_block_input")  # fbc, magcache: the first block's
TAIL_STATE = ("tail_block_residuals", "previous_residual")  # fbc, magcache: the last block's
# --parallel pipeline: the first block's output (fbc) or input (magcache) travels with the activations to the rank of
# the last block, which alone computes with it (dm_cli.run.hooks.step_cache.SliceRelay): held there, not on the first's
TRAVEL = ("head_block_output", "head_block_input")


@dataclass
class Footprint:
    """What a cache holds between steps in one denoiser: module (the block or attention that holds it) -> bytes,
    summed over the guidance branches (cache contexts), and the branches counted."""

    holders: dict[str, int] = field(default_factory=dict)
    contexts: int = 1

    @property
    def total(self) -> int:
        return sum(self.holders.values())

    def to_json(self) -> dict:
        return {"holders": dict(self.holders), "contexts": self.contexts}

    @classmethod
    def from_json(cls, data: dict) -> "Footprint":
        return cls({str(k): int(v) for k, v in data.get("holders", {}).items()}, int(data.get("contexts", 1)))


def contexts(family, inputs: InputSpec) -> tuple[str, ...]:
    """The cache contexts of one step, as the pipelines name them: "cond", and "uncond" under separate CFG calls."""
    return ("cond", "uncond")[:max(1, min(2, family.denoiser_calls(inputs)))]


def measure(comp, pipeline_class: str | None, inputs: InputSpec, dtype: str, cache: StepCache, family,
            use_cache: bool = True, device_map: dict | None = None,
            sliced: bool = False) -> tuple[Footprint, list[str]]:
    """Run the denoiser on the meta device with the cache's hooks on, once per cache context: (what the hooks'
    states hold, by holder; the split check's problems when `device_map` places it on several devices). `sliced`:
    for --parallel pipeline, where the first block's tensors that the last block takes travel to its rank (`TRAVEL`)."""
    key = cache_key({"what": "step-cache", "class": comp.cls, "config": comp.config, "pipeline": pipeline_class,
                     "inputs": inputs.to_json(), "dtype": dtype, "cache": cache.label,
                     "map": list((device_map or {}).items()), **({"sliced": True} if sliced else {})})
    cached = read_cached("checks", key) if use_cache else None
    if cached is not None and isinstance(cached.get("footprint"), dict):
        return Footprint.from_json(cached["footprint"]), list(cached.get("problems", []))
    footprint, problems = _measure(comp, pipeline_class, inputs, dtype, cache, family, device_map, sliced)
    if use_cache and not any("failed on the meta device" in p for p in problems):
        write_cached("checks", key, {"footprint": footprint.to_json(), "problems": problems})
    return footprint, problems


def _measure(comp, pipeline_class, inputs: InputSpec, dtype: str, cache: StepCache, family,
             device_map: dict | None, sliced: bool = False) -> tuple[Footprint, list[str]]:
    import torch  # lazy: torch (heavy, off start-up)

    dtype = trace._torch_dtype_name(dtype, comp)
    run_dtype = trace.compute_dtype(call_spec(comp, pipeline_class, inputs), dtype)
    model = trace._meta_model(comp, run_dtype)
    spec = trace._resolve_call(model, comp, pipeline_class, inputs)
    if spec is None:
        raise UsageError(f"dmap cannot run {comp.cls} on the meta device, so it cannot count what --cache "
                         f"{cache.name} holds: drop --cache.")
    names = contexts(family, inputs)
    problems: list[str] = []
    seen: set = set()
    split = device_map is not None and len(set(device_map.values())) > 1
    enable(model, cache, family, 28, run_dtype)
    try:
        for name in names:
            session = trace._Session(model, replace_sdpa=True, tag_mode="device" if split else None,
                                     device_map=device_map if split else None, problems=problems, seen_problems=seen)
            with model.cache_context(name):
                try:
                    trace._run(model, spec, run_dtype, session)
                except Exception as error:  # noqa: BLE001 - said as the check's problem, never a traceback
                    problems.append(f"{comp.cls} ({comp.name}) with --cache {cache.name} failed on the meta device "
                                    f"({type(error).__name__}: {shorten(str(error), 120)}).")
                    break
        holders = _held(model, cache, torch, sliced)
    finally:
        model.disable_cache()
    return Footprint(holders, len(names)), problems


def _held(model, cache: StepCache, torch, sliced: bool = False) -> dict[str, int]:
    """Bytes each hooked module's state holds now (each tensor once); taylorseer's after one update hold one term of
    `max_order + 1`, so they count that many times. `sliced`: the tensors of `TRAVEL` go to the last block."""
    from diffusers.hooks.hooks import StateManager  # lazy: diffusers (heavy, off start-up)

    terms = cache.setting("max_order", 0) + 1 if cache.name == "taylorseer" else 1
    head = tail = None
    found: list[tuple[str, str, object]] = []  # (module, state attribute, value)
    states_seen: set = set()
    for prefix, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook in registry.hooks.values():
            kind = type(hook).__name__
            if "Head" in kind:
                head = prefix
            if getattr(hook, "is_tail", False):
                tail = prefix
            for attr in vars(hook).values():
                if not isinstance(attr, StateManager):
                    continue
                for state in attr._state_cache.values():
                    if id(state) in states_seen:
                        continue
                    states_seen.add(id(state))
                    found += [(prefix, name, value) for name, value in vars(state).items()]
    holders: dict[str, int] = {}
    tensors_seen: set = set()
    for prefix, name, value in found:
        where = tail if sliced and name in TRAVEL else head if name in HEAD_STATE else tail if name in TAIL_STATE else prefix
        nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(value, torch) if not (
            id(t) in tensors_seen or tensors_seen.add(id(t))))
        if nbytes and where is not None:
            holders[where] = holders.get(where, 0) + nbytes * (terms if cache.name == "taylorseer" else 1)
    return holders


# --- where the bytes go ---------------------------------------------------------------------------


def placed_bytes(footprint: Footprint, device_map: dict, execution_device) -> dict[str, int]:
    """Device name -> bytes the cache holds there: each holder on its block's device; a block streamed from cpu or
    disk computes (and keeps its state) on the execution device."""
    out: dict[str, int] = {}
    for holder, nbytes in footprint.holders.items():
        device = device_of(holder, device_map, execution_device)
        if device in ("cpu", "disk") and is_gpu(execution_device):
            device = execution_device
        out[str(device)] = out.get(str(device), 0) + nbytes
    return out


def fit(place: Callable, devices: list, denoisers: dict[str, Footprint], rounds: int = 6):
    """Place with room for the caches: `place(devices)` -> Placement or None; `denoisers`: component -> footprint.
    Each stage that runs a cached denoiser gets its bytes (`DeviceUse.cache`) on the devices that hold them; where
    that goes over a device's capacity, the search runs again with that much less there. (placement or None, the
    cache bytes per component and device)."""
    reduced = {d.key: 0 for d in devices}
    placement = place(devices)
    for _ in range(rounds):
        if placement is None:
            return None, {}
        per_component = {name: placed_bytes(fp, placement.components[name].device_map,
                                            placement.components[name].execution_device)
                         for name, fp in denoisers.items() if name in placement.components}
        over: dict = {}
        for stage in placement.stages:
            extra = _stage_cache(stage, per_component)
            for device in devices:
                use = stage.use.get(device.name)
                added = extra.get(device.name, 0)
                short = (use.peak if use else 0) + added - (device.capacity if device.capacity is not None else 0)
                if added and device.capacity is not None and short > 0:
                    over[device.key] = max(over.get(device.key, 0), short)
        if not over:
            for stage in placement.stages:
                for key, added in _stage_cache(stage, per_component).items():
                    stage.use.setdefault(key, _device_use()).cache = added
            return placement, per_component
        for key, short in over.items():
            reduced[key] += short
        placement = place([replace(d, capacity=None if d.capacity is None else max(0, d.capacity - reduced[d.key]))
                           for d in devices])
    return None, {}


def _stage_cache(stage, per_component: dict[str, dict[str, int]]) -> dict[str, int]:
    """Cache bytes per device while this stage runs: the caches of the cached denoisers it runs (two experts of one
    stage run one after another, their states both live: summed)."""
    out: dict[str, int] = {}
    for name in stage.components:
        for key, nbytes in per_component.get(name, {}).items():
            out[key] = out.get(key, 0) + nbytes
    return out


def _device_use():
    return DeviceUse()

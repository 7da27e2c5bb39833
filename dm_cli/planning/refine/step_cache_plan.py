"""A step cache (--cache) in a plan: what its hooks hold in each denoiser (measured by `step_cache.py`), room for
it on the devices that hold it, the plan's `step_cache`, and the split check run again with its hooks on."""

from __future__ import annotations

from dataclasses import replace

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import family_for
from dm_cli.planning.modes import Layout
from dm_cli.planning.placement.components import PreparedComponent
from dm_cli.planning.placement.placement import Placement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_file import Plan
from dm_cli.planning.plan_options import PlanOptions, place_or_none
from dm_cli.planning.step_cache import fit, measure
from dm_cli.units import format_size


def step_cache_footprints(source, prepared: list[PreparedComponent], options: PlanOptions, layout=None) -> dict:
    """--cache: what its hooks hold in each denoiser (the family's `denoiser` and `experts`), measured on the meta
    device (planning/step_cache.py); {} without a cache or for a weights-only plan. Under a pipeline `layout` the
    state is counted where each slice's rank holds it (the bytes on GPU r are rank r's)."""
    if options.cache is None or options.inputs.weights_only:
        return {}
    sliced = getattr(layout, "layout", None) == Layout.PIPELINE
    family = family_for(source.pipeline_class)
    if family is None:
        raise UsageError(f"dmap knows no pipeline family in {source.spec}, so it cannot apply --cache: drop it.")
    out = {}
    for prep in prepared:
        if prep.spec.name in (family.denoiser, *family.experts) and prep.source.config is not None:
            if options.on_progress is not None:
                options.on_progress(f"Counting what --cache {options.cache.name} holds in {prep.spec.name} on the meta device")
            out[prep.spec.name], _ = measure(prep.source, source.pipeline_class, options.inputs, prep.dtype,
                                             options.cache, family, options.use_cache, sliced=sliced)
    return out


def fit_step_cache(source_spec: str, specs, stages, devices: list[Device], options: PlanOptions, placement: Placement,
                    footprints: dict) -> tuple[Placement, dict]:
    """The placement with room for the cache's state on the devices that hold it (step_cache.fit), or DoesNotFitError."""
    fitted, cache_bytes = fit(lambda trial: place_or_none(specs, stages, trial, options), devices, footprints)
    if fitted is None:
        held = sum(fp.total for fp in footprints.values())
        raise DoesNotFitError(f"{source_spec} fits on these devices without a step cache, but not with --cache "
                              f"{options.cache.name}: its hooks hold {format_size(held)} beside the denoiser between "
                              "steps; use --cache taylorseer:lite=true (less state), a smaller size, or more memory.",
                              {"shortfall_bytes": {}, "suggestions": []})
    return fitted, cache_bytes


def step_cache_report(plan: Plan, source, prepared, options: PlanOptions, footprints: dict, cache_bytes: dict) -> dict:
    """The plan's `step_cache` (the split check runs with the hooks on: its problems join the plan's check). Under
    --world-size N each component says what each rank holds (`ranks`): under pipeline parallel the bytes on GPU r,
    the state of rank r's slice; under cfg or context parallel every rank runs the whole denoiser and holds at most
    what one process holds."""
    cache = options.cache
    layout = plan.parallel
    components = {}
    for name, footprint in footprints.items():
        placed = cache_bytes.get(name, {})
        components[name] = {"bytes": placed, "total_bytes": footprint.total,
                            "contexts": footprint.contexts, "holders": footprint.holders}
        if layout is not None and layout.world_size > 1:
            components[name]["ranks"] = {str(r): placed.get(str(r), 0) if layout.layout == Layout.PIPELINE
                                         else footprint.total for r in range(layout.world_size)}
    return {"name": cache.name, "settings": dict(cache.settings), "label": cache.label, "components": components}


def step_cache_check(plan: Plan, prepared, pipeline_class, options: PlanOptions) -> list[str]:
    """The split check of each cached, split denoiser run again with the cache's hooks on."""
    if options.cache is None or not plan.step_cache:
        return []
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


def with_cache_per_rank(layout, step_cache: dict):
    """The layout's peak per rank with what the cache holds on that rank added (`step_cache_report`'s `ranks`)."""
    if layout is None or not step_cache or not layout.per_rank_peak_bytes:
        return layout
    peaks = dict(layout.per_rank_peak_bytes)
    for component in step_cache.get("components", {}).values():
        for rank, nbytes in component.get("ranks", {}).items():
            if rank in peaks:
                peaks[rank] += nbytes
    return replace(layout, per_rank_peak_bytes=peaks)

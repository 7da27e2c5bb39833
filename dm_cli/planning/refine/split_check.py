"""The split check: each component split over devices runs on the meta device with virtual devices
(`trace.check_device_map`), its verdict cached per map and inputs; a step cache's hooks are checked too."""

from __future__ import annotations

from dm_cli.io.cache import cache_key, read_cached, write_cached
from dm_cli.planning.placement.components import PreparedComponent
from dm_cli.planning.plan_file import Plan
from dm_cli.planning.plan_options import PlanOptions
from dm_cli.planning.refine.step_cache_plan import step_cache_check
from dm_cli.planning.trace import trace


def run_split_check(plan: Plan, prepared: list[PreparedComponent], pipeline_class: str | None,
                    options: PlanOptions) -> dict:
    """Simulate every split component on the meta device with virtual devices; list what mixes devices."""
    problems: list[str] = []
    checked: list[str] = []
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
        found = cached_check(prep, pipeline_class, inputs, placed.device_map, options.use_cache,
                             trace.check_device_map)
        problems.extend(f"{prep.spec.name}: {problem}" for problem in found)
    problems += step_cache_check(plan, prepared, pipeline_class, options)
    return {"ran": True, "components": checked, "problems": problems}


def cached_check(prep, pipeline_class, inputs, device_map, use_cache: bool, check_device_map) -> list[str]:
    """A check runs a meta forward (seconds for FLUX): remember its verdict per map and inputs (the key
    includes the code that checks, see cache.producer)."""
    key = cache_key({"class": prep.source.cls, "config": prep.source.config, "pipeline": pipeline_class,
                     "inputs": inputs.to_json(), "dtype": prep.dtype, "map": list(device_map.items())})
    cached = read_cached("checks", key) if use_cache else None
    if cached is not None and isinstance(cached.get("problems"), list):
        return list(cached["problems"])
    problems = list(check_device_map(prep.source, pipeline_class, inputs, prep.dtype, device_map))
    if use_cache and not any("was not checked" in p for p in problems):
        write_cached("checks", key, {"problems": problems})
    return problems

"""`dmap plan`: resolve a SOURCE, size and trace its components, place them, check the split (`make_plan`).

The steps live beside it: the Plan and its file (`plan_file.py`), what it is asked (`plan_options.py`), local
devices (`budgets.py`), components (`components.py`, `lora_sizing.py`), parallel ranks (`parallel_placement.py`),
a step cache (`step_cache_plan.py`), tiled decode (`tiling.py`), the split check (`split_check.py`) and the advice
when nothing fits (`advice.py`), around the pure search (`search.py`).
"""

from __future__ import annotations

import os
from dataclasses import replace

from dm_cli.devices import device_label
from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import (
    FALLBACK_IMAGE_SIZE,
    family_for,
    family_parts,
    pipeline_stages,
    unknown_family_warning,
)
from dm_cli.model.formats.weight_formats import int8_offload_problem, parse_weights_spec
from dm_cli.model.single_file_weights import resolve_with_pipeline
from dm_cli.model.sources import config_digest
from dm_cli.planning.modes import Layout, Mode, Strategy
from dm_cli.planning.placement.budgets import local_devices, parse_overhead
from dm_cli.planning.placement.components import PreparedComponent, prepare_component, trace_facts
from dm_cli.planning.placement.lora_sizing import lora_targets, lora_unfused_because
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_file import Plan, check_weights_only
from dm_cli.planning.plan_options import PlanOptions, place_or_none
from dm_cli.planning.refine.advice import does_not_fit, explain_offload
from dm_cli.planning.refine.parallel_placement import denoiser_cut, parallel_layout, parallel_request
from dm_cli.planning.refine.split_check import run_split_check
from dm_cli.planning.refine.step_cache_plan import (
    fit_step_cache,
    step_cache_footprints,
    step_cache_report,
    with_cache_per_rank,
)
from dm_cli.planning.refine.tiling import TilingChoice, choose_tiling
from dm_cli.planning.step_cache import fit
from dm_cli.planning.time.overlap import OVERLAPPED, choose_overlap, faster_line, room_wanted
from dm_cli.planning.time.plan_prediction import plan_prediction, rated_for_plan, with_profile_rates
from dm_cli.planning.time.profiles import cached_profile_problem
from dm_cli.units import parse_device_spec, parse_dtype, shorten


def cuda_kernels(devices: list[Device]) -> bool:
    """Whether activations are counted as CUDA's kernels hold them (gpu_kernels.py): when the plan names a CUDA GPU,
    unless DMAP_KERNELS=cpu says the plan's GPUs will be CPUs standing in for them (`dmap run --simulate`, tests), whose
    kernels hold what the meta trace counts."""
    rules = os.environ.get("DMAP_KERNELS", "").strip().lower()
    if rules not in ("", "cuda", "cpu"):
        raise UsageError(f"DMAP_KERNELS={shorten(rules, quote=True)} names no kernels: use cuda or cpu.")
    return rules != "cpu" and any(isinstance(d.key, int) for d in devices)


def check_words(options: PlanOptions) -> None:
    """--strategy and --mode among their words (UsageError, one sentence)."""
    if options.placement.strategy not in Strategy.words():
        raise UsageError(f"Unknown strategy '{options.placement.strategy}': use {', '.join(Strategy.words())}.")
    if options.placement.mode not in Mode.words():
        raise UsageError(f"Unknown mode '{options.placement.mode}': use {', '.join(Mode.words())}.")


def kernel_report(prepared: list[PreparedComponent]) -> dict:
    """Per component traced for CUDA's kernels: its attention kernels and what sets its activation peak."""
    return {p.spec.name: {"attention": p.facts.attention_backends, "peak_at": p.facts.peak_at}
            for p in prepared if p.facts.peak_at}


def launch_warning(layout) -> str:
    """What a plan file of several ranks needs to run as planned; `dmap run` under torchrun, which is launched so
    already, leaves it out (dm_cli.run.settle.checks.make_run_plan)."""
    return (f"The plan records a {layout.title} layout for {layout.world_size} ranks ('parallel'): run it with "
            f"torchrun --nproc-per-node {layout.world_size} -m dm_cli run -d PLAN.json.")


def make_plan(source_spec: str, options: PlanOptions) -> Plan:
    """Resolve, size, trace, place and check: the one core call of `dmap plan`."""
    check_words(options)
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
    options = replace(options, on_gpu=cuda_kernels(devices))
    given, options = options.parallel, with_profile_rates(options)  # the profile's rates where not given (flags)
    parallel = parallel_request(source, comps, devices, options)  # refused before any trace
    if parallel is not None:
        options, asked = parallel[0], parallel[0].placement
    formats = parse_weights_spec(asked.weights, [c.name for c in comps])
    loras = lora_targets(source, options.loras)
    prepared = [prepare_component(c, source.pipeline_class, options.inputs, asked.dtype, options.use_cache, formats,
                                  on_progress=options.on_progress, on_gpu=options.on_gpu,
                                  loras=tuple(lora for lora in loras if lora.component == c.name)) for c in comps]
    if parallel is not None and prepared:  # at the dtype the plan will have (below) and the traced compute
        parallel = rated_for_plan(parallel, given, asked.dtype or prepared[0].dtype, prepared)
    cut, prepared = denoiser_cut(prepared, devices, *parallel) if parallel is not None else (None, prepared)
    specs = [p.spec for p in prepared]
    stages = pipeline_stages(source.pipeline_class, [c.name for c in comps])
    progress(f"Placing {len(specs)} component(s) on {', '.join(device_label(d.key) for d in devices)}")
    placement = place_or_none(specs, stages, devices, options)
    choice = TilingChoice(placement, specs)
    if placement is None or placement.offloaded_bytes:  # only then can a tiled decode be needed
        choice = choose_tiling(prepared, source.pipeline_class, stages, devices, options, placement)
    if choice.placement is None:
        progress("Nothing fits: looking for the nearest change that does")
        raise does_not_fit(source_spec, source, comps, stages, devices, options, formats, choice.specs,
                            choice.warnings) from None
    placement, specs = choice.placement, choice.specs
    layout = None
    if parallel is not None:
        layout, placement, prepared = parallel_layout(placement, specs, prepared, stages, devices, cut, *parallel)
    footprints = step_cache_footprints(source, prepared, options, layout)
    if footprints:  # the pipeline's cut stays the denoiser's map while the search makes room for the cache
        cut_specs = {p.spec.name: p.spec for p in prepared if p.spec.fixed_map is not None}
        placement, cache_bytes = fit_step_cache(source_spec, [cut_specs.get(s.name, s) for s in specs], stages,
                                                devices, options, placement, footprints)
    dtype = asked.dtype or (prepared[0].dtype if prepared else "bfloat16")
    plan = Plan(source_spec, dtype, asked.strategy, placement.mode, devices, options.inputs, placement.components,
                placement.stages, source.pipeline_class,
                [w for p in prepared for w in p.warnings] + placement.warnings + choice.warnings,
                activation_peaks={s.name: s.activation_peak for s in specs},
                config_digest=config_digest(source), weights={p.spec.name: p.weights for p in prepared},
                tiled_decode=choice.tiled, kernels=kernel_report(prepared))
    if source.pipeline_class and family_for(source.pipeline_class) is None:
        plan.warnings.insert(0, unknown_family_warning(source.pipeline_class))
    cache_bytes = offload_notes(plan, source, prepared, specs, stages, options, footprints,
                                cache_bytes if footprints else {})
    for name, fmt in plan.weights.items():
        problem = int8_offload_problem(name, fmt, plan.components[name].device_map)
        if problem:
            plan.warnings.append(f"{problem} dmap run refuses this plan (except with --simulate).")
    plan.input_images = input_image_report(source, comps, prepared, options)
    unfused = {p.spec.name: lora_unfused_because(p, plan.components[p.spec.name].device_map, options.switch_loras)
               for p in prepared if p.lora_bytes}
    plan.loras = [{**lora.to_json(), "bytes": count, "fused": unfused[p.spec.name] is None}
                  for p in prepared for lora, count in p.lora_bytes]
    plan.warnings += [f"{name}: its LoRA stays unfused (peft's layers beside the weights, a little slower per step): "
                      f"{why}." for name, why in unfused.items() if why]
    plan.parallel = layout
    if options.cache is not None:
        plan.step_cache = step_cache_report(plan, source, prepared, options, footprints, cache_bytes)
        plan.parallel = with_cache_per_rank(layout, plan.step_cache)
    plan.warnings += [launch_warning(layout) for layout in [layout] if layout is not None and layout.layout != Layout.SPLIT]
    plan.predicted_time = _prediction(plan, source, prepared, options)
    if options.check:
        plan.check = run_split_check(plan, prepared, source.pipeline_class, options)
    return plan


def offload_notes(plan: Plan, source, prepared: list[PreparedComponent], specs, stages, options: PlanOptions,
                  footprints: dict, cache_bytes: dict) -> dict:
    """Whether each offloading component's copies overlap its compute (overlap.py: the prefetched block charged
    before the split check and the prediction see the plan), then why anything is offloaded at all (advice.py).
    The step cache's bytes per component and device, for the placement kept."""
    choose_overlap(plan, specs)
    cache_bytes = overlap_with_room(plan, source, prepared, specs, stages, options, footprints, cache_bytes)
    explain_offload(plan, prepared, stages, options)
    return cache_bytes


def overlap_with_room(plan: Plan, source, prepared: list[PreparedComponent], specs, stages, options: PlanOptions,
                      footprints: dict, cache_bytes: dict) -> dict:
    """Where a prefetched block did not fit beside the running one: the placement that leaves it room (a block or so
    more offloaded), its copies overlapped, replaces the plan's when the time model predicts it faster than the
    fuller GPU copying each block in its turn. With a step cache (`footprints`) the trial makes room for the cache's
    state too, as the plan's own placement did (step_cache.fit). A pipeline cut is left as it was. Returns the
    cache's bytes for the placement kept."""
    wanted = room_wanted(plan, specs)
    if not wanted or any(p.spec.fixed_map is not None for p in prepared):
        return cache_bytes
    devices = [replace(d, capacity=d.capacity - wanted[d.name]) if d.name in wanted and d.capacity else d
               for d in plan.devices]
    if footprints:
        placement, trial_cache = fit(lambda trial: place_or_none(specs, stages, trial, options), devices, footprints)
    else:
        placement, trial_cache = place_or_none(specs, stages, devices, options), {}
    if placement is None:
        return cache_bytes
    trial = replace(plan, components=placement.components, stages=placement.stages, warnings=[])
    choose_overlap(trial, specs)
    overlapped = [n for n, c in trial.components.items() if c.offload.get("mode") == OVERLAPPED]
    if not overlapped:
        return cache_bytes
    before = plan_prediction(plan, source, prepared, options, options.prediction).get("step_s")
    after = plan_prediction(trial, source, prepared, options, options.prediction).get("step_s")
    if not before or not after or after >= before:
        return cache_bytes
    more = trial.offloaded_bytes - plan.offloaded_bytes
    plan.components, plan.stages = trial.components, trial.stages
    plan.warnings += trial.warnings + [faster_line(overlapped, before, after, more)]
    return trial_cache


def _prediction(plan: Plan, source, prepared: list[PreparedComponent], options: PlanOptions) -> dict:
    """The plan's `predicted_time`; a damaged calibrated profile, ignored (never fatal), said in the plan's warnings."""
    predicted = plan_prediction(plan, source, prepared, options, options.prediction)
    if options.prediction.profile is None:
        plan.warnings += [problem for problem in [cached_profile_problem()] if problem]
    return predicted


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
    bare = trace_facts(denoiser, source.pipeline_class, replace(inputs, image_sizes=()), prep.dtype, options.use_cache,
                       on_gpu=options.on_gpu)
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


def settled_options(source, comps, options: PlanOptions) -> PlanOptions:
    """The generation settled and checked as `dmap run` settles and checks its own (`Family.settle`, then
    `Family.validate`): every default the run would fill in (size, frames, guidance, the family's settings) is
    the plan's, from the same Generation. Multiples of 8 for what no family knows."""
    generation = options.generation
    if 0 in (generation.height, generation.width) and None in (generation.height, generation.width):
        generation = replace(generation, height=0, width=0)  # --height 0 (or --width 0) alone: weights only
    check_weights_only(generation.inputs())
    family, denoiser, vae = family_parts(source.pipeline_class, source.components if source.pipeline_class else comps)
    if family is None or denoiser is None:
        if generation.settings:
            raise UsageError(f"dmap knows no pipeline family in {source.spec}: drop --{generation.settings[0][0]}.")
        generation = replace(generation, height=FALLBACK_IMAGE_SIZE if generation.height is None else generation.height,
                             width=FALLBACK_IMAGE_SIZE if generation.width is None else generation.width)
        if generation.height % 8 or generation.width % 8:
            raise UsageError(f"--height and --width must be multiples of 8 (got {generation.height}x{generation.width}).")
        if generation.num_frames is not None or generation.fps is not None:
            raise UsageError(f"dmap knows no video pipeline in {source.spec}: drop --frames and --fps.")
        return replace(options, generation=generation)
    vae_config = vae.config if vae is not None else None
    generation = family.settle(generation, denoiser.config or {}, vae_config)
    family.validate(generation, source.pipeline_class or denoiser.cls, denoiser.config or {}, vae_config,
                    tuple(c.name for c in source.components))
    return replace(options, generation=generation)

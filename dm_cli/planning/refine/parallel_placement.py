"""Parallel within a step in a plan (--world-size; the layouts are `parallel.py`'s): the refusals that need no
trace, pipeline parallel's cut of the traced denoiser, and the layout chosen for the traced placement."""

from __future__ import annotations

from dataclasses import replace

from dm_cli.devices import device_key
from dm_cli.errors import UsageError
from dm_cli.families import family_parts
from dm_cli.planning.modes import Layout, Mode, Parallel
from dm_cli.planning.parallel.parallel import (
    DenoiserLoad,
    Rank,
    Unit,
    beside_slice,
    candidates,
    denoiser_shape,
    guidance_branches,
    pipeline_cut,
    weight_tokens,
)
from dm_cli.planning.parallel.parallel_layout import ParallelLayout, choose_layout, pipeline_candidate
from dm_cli.planning.placement.blocks import ComponentInput
from dm_cli.planning.placement.components import PreparedComponent
from dm_cli.planning.placement.placement import Placement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_options import PlanOptions, place_or_none


def parallel_request(source, comps, devices: list[Device], options: PlanOptions):
    """For --world-size > 1: (options, family, guidance, denoiser shape), every refusal that needs no trace
    said first (one sentence, exit 2); the plan is staged (each rank loads the denoiser after the encoders are
    freed). None for one rank."""
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
    if placement.mode == Mode.RESIDENT:
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


def parallel_layout(placement: Placement, specs: list[ComponentInput], prepared: list[PreparedComponent], stages,
                     devices: list[Device], cut, options: PlanOptions, family, guidance,
                     shape) -> tuple[ParallelLayout, Placement, list[PreparedComponent]]:
    """The layout for the traced placement (the denoiser's weights and activations, each rank's budget and the peaks
    of the other stages as the single-process plan places them), with the placement and components the plan keeps:
    when auto chooses pipeline parallel, the denoiser is placed again as its cut (`_with_cut`)."""
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
    if layout.layout != Layout.PIPELINE or fixed is None or fixed.fixed_map is not None:
        return layout, placement, prepared
    cut_specs = [replace(s, fixed_map=dict(cut.block_map)) if s.name in experts else s for s in specs]
    cut_placement = place_or_none(cut_specs, stages, devices, options)
    if cut_placement is None:  # the cut fits each rank, but not one process's device map: the split it is compared to
        layout = choose_layout(options.parallel, guidance, shape, load, ranks,
                               f"pipeline parallel's cut of {family.denoiser} fits each rank but not as one process's "
                               "device map, which the plan must stay.")
        return layout, placement, prepared
    return layout, cut_placement, _with_cut(prepared, experts, cut)


def denoiser_cut(prepared: list[PreparedComponent], devices: list[Device], options: PlanOptions, family, guidance,
                  shape) -> tuple:
    """(pipeline parallel's cut of the denoiser (planning/parallel/parallel.py `pipeline_cut`) or the sentence why there is
    none, the components): the cut None when the request does not consider pipeline parallel. An explicit --parallel
    pipeline that cannot be cut, or does not fit a rank, is refused here, before any placement; else its components
    come back with the denoiser's map fixed to the cut (never searched)."""
    request = options.parallel
    prep = next((p for p in prepared if p.spec.name == family.denoiser), None)
    if request.choice not in (Parallel.PIPELINE, Parallel.AUTO) or prep is None:
        return None, prepared
    names = [family.denoiser, *(p.spec.name for p in prepared if p.spec.name in family.experts)]
    experts = [p for p in prepared if p.spec.name in names[1:]]
    if any([(b.name, b.keys) for b in p.spec.blocks] != [(b.name, b.keys) for b in prep.spec.blocks] for p in experts):
        problem = (f"pipeline parallel cuts {', '.join(names)} at the same blocks, and their blocks differ: use "
                   "--parallel cfg or context.")
        if request.choice == Parallel.PIPELINE:
            raise UsageError(problem)
        return problem, prepared
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
    # Wan 2.2's experts are cut alike and both held (prompts in flight may be on either side of the switch): a
    # unit's bytes are those of its block in every expert; one expert computes at a time (its FLOPs, its activations)
    held = {b.name: b.bytes for b in prep.spec.blocks}
    for expert in experts:
        for block in expert.spec.blocks:
            held[block.name] += block.bytes
    units = [Unit(b.name, b.keys, held[b.name], params[b.name], work[b.name]) for b in prep.spec.blocks]
    activation_peak = max(p.spec.activation_peak for p in (prep, *experts))
    by_key = {d.key: d for d in devices}
    shared = sum(u.bytes for u in units if not u.entries)
    extras = beside_slice(shared, activation_peak, shape, request.planned_in_flight)
    room = [max(0, (by_key[r].capacity or 0) - by_key[r].overhead - extras) if r in by_key else 0
            for r in range(request.world_size)]  # the block weights each rank can hold beside the rest
    cut = pipeline_cut(units, request.world_size, shape, room)
    if request.choice == Parallel.PIPELINE:
        ranks = [Rank(r, by_key[r].capacity or 0, by_key[r].overhead) for r in range(request.world_size)]
        pipeline_candidate(request, shape, activation_peak, ranks, cut, {})  # refuses, one sentence
        return cut, _with_cut(prepared, names, cut)
    return cut, prepared


def _with_cut(prepared: list[PreparedComponent], denoisers, cut) -> list[PreparedComponent]:
    """The components with the denoiser's map (each expert's) fixed to the cut (the search keeps it and places the
    rest around it)."""
    return [replace(p, spec=replace(p.spec, fixed_map=dict(cut.block_map))) if p.spec.name in denoisers else p
            for p in prepared]

"""Tiled decode in a plan: a VAE decodes in tiles (diffusers' enable_tiling()) only when the plan needs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dm_cli.families import call_spec
from dm_cli.inputs import InputSpec
from dm_cli.planning.placement.blocks import ComponentInput
from dm_cli.planning.placement.components import PreparedComponent, component_spec, trace_facts, without_activations
from dm_cli.planning.placement.placement import Placement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_options import PlanOptions, place_or_none
from dm_cli.units import format_size


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
               use_cache: bool = True, on_progress: Callable[[str], None] | None = None,
               on_gpu: bool = False) -> ComponentInput | str:
    """The component with the activations of its tiled decode (the same call traced with enable_tiling()),
    or a sentence saying why there is none (a class without enable_tiling; a cached trace imports no torch)."""
    facts = trace_facts(prep.source, pipeline_class, inputs, prep.dtype, use_cache, tiled=True, on_progress=on_progress,
                        on_gpu=on_gpu)
    if facts.warning:
        return facts.warning
    spec, _ = component_spec(prep.source, prep.skeleton, facts, inputs, prep.effective_dtype, prep.weights, prep.dtype)
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
        return place_or_none(trial, stages, devices, options)

    def better(trial: Placement | None) -> bool:
        return trial is not None and (placement is None or trial.offloaded_bytes < placement.offloaded_bytes)

    def swapped(replacements: dict[str, ComponentInput]) -> list[ComponentInput]:
        return [replacements.get(s.name, s) for s in specs]

    usable: dict[str, ComponentInput] = {}
    warnings: list[str] = []
    for prep in decode_components(prepared, pipeline_class, inputs):
        spec = prep.spec
        bare = without_activations(spec, io_bytes=False)  # its inputs and outputs stay full size, tiled or not
        if not spec.activation_peak or not better(attempt(swapped({spec.name: bare}))):
            continue  # its activations are not what the plan lacks: tiling cannot help
        tiled = tiled_spec(prep, pipeline_class, inputs, options.use_cache, options.on_progress, options.on_gpu)
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

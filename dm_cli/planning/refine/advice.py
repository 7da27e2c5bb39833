"""What a plan that does not fit is told (the shortfall per device, the nearest change that fits), and what a
plan that offloads says about why."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from dm_cli.devices import device_rank
from dm_cli.errors import DoesNotFitError
from dm_cli.families import family_parts
from dm_cli.planning.placement.budgets import total_ram
from dm_cli.planning.placement.components import prepare_component, without_activations
from dm_cli.planning.placement.placement import Placement
from dm_cli.planning.placement.search import Device
from dm_cli.planning.plan_file import Plan
from dm_cli.planning.plan_options import PlanOptions, place_or_none
from dm_cli.units import format_size


def explain_offload(plan: Plan, prepared, stages, options: PlanOptions) -> None:
    """When something is offloaded, say whether activations and overhead are the reason."""
    if not plan.offloaded_bytes or options.inputs.weights_only:
        return
    specs = [without_activations(p.spec, io_bytes=True) for p in prepared]
    bare = [Device(d.key, d.capacity, 0) for d in plan.devices]
    weights_only = place_or_none(specs, stages, bare, options)
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


def does_not_fit(source_spec, source, comps, stages, devices, options, formats, specs,
                  notes: list[str] | tuple = ()) -> DoesNotFitError:
    """The shortfall per device and the nearest change that fits (for `specs`: a tiled decode's when tried)."""
    gpus = [d for d in devices if d.is_gpu]
    total_weights = sum(s.weights_bytes for s in specs)
    biggest_act = max((s.activation_peak for s in specs), default=0)
    suggestions: list[str] = []
    shortfall: dict[str, int] = {}

    def fits(trial_devices, trial_specs=specs) -> Placement | None:
        return place_or_none(trial_specs, stages, trial_devices, options)

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
                                                 formats, on_gpu=options.on_gpu).spec for c in comps]
            except Exception:  # a failed trace only loses a suggestion
                break
            if fits(devices, trial_specs) is not None:
                suggestions.append(f"fits at {size}x{size}")
                break
    suggestions += _fewer_or_smaller_images(source, comps, options, formats, lambda s: fits(devices, s) is not None)
    suggestions += _nf4_largest(source, comps, options, formats, specs, lambda s: fits(devices, s) is not None)
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
                                           formats, on_gpu=options.on_gpu).spec for c in comps])
        except Exception:  # a failed trace only loses a suggestion
            return False

    sizes = inputs.image_sizes
    for count in range(len(sizes) - 1, max(family.min_input_images, 0) - 1, -1):
        if trial(sizes[:count]):
            return [f"fits with {count} input image(s) (the first {count})" if count else "fits without input images"]
    if any(w * h > 512 * 512 for w, h in sizes) and trial([(512, 512)] * len(sizes)):
        return [f"fits with the {len(sizes)} input image(s) at 512x512"]
    return []


def _nf4_largest(source, comps, options: PlanOptions, formats: dict, specs, fits: Callable) -> list[str]:
    """`--weights ...,LARGEST=nf4` (the user's own formats kept), when 4-bit NF4 on the largest component alone fits."""
    largest = max(specs, key=lambda s: s.weights_bytes, default=None)
    if largest is None or formats.get(largest.name) == "nf4" or not any(c.name == largest.name for c in comps):
        return []
    trial = {**formats, largest.name: "nf4"}
    try:  # a component quantized already (GGUF, a saved folder) or without a config refuses: no suggestion
        trial_specs = [prepare_component(c, source.pipeline_class, options.inputs, options.placement.dtype,
                                         options.use_cache, trial, on_gpu=options.on_gpu).spec for c in comps]
    except Exception:  # noqa: BLE001 - a failed trial only loses a suggestion
        return []
    if not fits(trial_specs):
        return []
    return ["fits with --weights " + ",".join(f"{name}={fmt or 'none'}" for name, fmt in trial.items())]


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


def _round_up_gb(num_bytes: int) -> str:
    """A size for --max-memory, rounded up to one decimal in the largest fitting unit."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= scale or unit == "KB":
            tenths = -(-num_bytes * 10 // scale)
            return f"{tenths / 10:g}{unit}"
    raise AssertionError("unreachable")

"""The checks `settle` applies to a run, once, in the order its docstring states (dm_cli.run.settle.settle): SOURCE
(`source_of_plan`, `prepare`), the devices of a given plan (`check_devices_present`), the generation
(`settle_generation`), the outputs as settled (`refuse_existing_outputs`), the plan against the run
(`check_plan_matches`) and its step cache (`check_plan_cache`); the weights' files (`check_weight_files`); then a
given plan's tiled decode (`check_tiled_decode`), or the plan made here (`make_run_plan`) and its devices. The facts
they compare (the request, its inputs, the visible devices) stay with the `RunRequest` in dm_cli.run.request;
`settle` calls these through this module, the seam tests patch (`make_run_plan`, `check_devices_present`,
`check_component_files`)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dm_cli.devices import device_key
from dm_cli.errors import CheckpointError, SourceError, UsageError
from dm_cli.families import Family, family_for, supported_pipelines
from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec
from dm_cli.io.atomic import refuse_existing
from dm_cli.io.checkpoint import open_checkpoint
from dm_cli.io.images import check_image_output, check_metadata_room, existing_image_paths
from dm_cli.io.video import sidecar_path
from dm_cli.model.demo import DEMO_NOTICE, is_demo, source_root
from dm_cli.model.formats.weight_formats import parse_weights_spec, storage_dtype
from dm_cli.model.single_file_weights import named_component_files, resolve_with_pipeline, without_weights
from dm_cli.model.sources import PRESETS, config_digest, looks_like_path, preset_refusal
from dm_cli.planning.make import launch_warning, make_named_plan
from dm_cli.planning.modes import CompileMode, Layout, Parallel
from dm_cli.planning.parallel.parallel import ParallelRequest
from dm_cli.planning.plan_command import lora_flags, plan_command
from dm_cli.planning.plan_options import PlanOptions
from dm_cli.planning.time.plan_prediction import MAX_QUEUE, PredictionRequest
from dm_cli.planning.trace.trace import can_tile
from dm_cli.units import parse_dtype

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
    from dm_cli.model.sources import Source
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.settle.layout import StepSharing
from dm_cli.run.request import (
    RunRequest,
    cpu_rank_devices,
    output_path,
    visible_gpus,
)


def source_of_plan(plan: Plan, plan_file: str | None) -> str:
    """The SOURCE a plan was made for, to run when none is given (`dmap run -d PLAN.json`): a relative path is
    found from the working folder or, failing that, beside the plan file; a path that is in neither is refused
    in one sentence naming both."""
    source, where = str(plan.source), plan_file or "The plan"
    if not source or source == "?":
        raise UsageError(f"{where} does not say which model it was made for: give SOURCE (dmap run SOURCE -d {where}).")
    path = Path(source).expanduser()
    if is_demo(source) or path.exists():
        return source
    beside = Path(plan_file).parent / path if plan_file is not None and not path.is_absolute() else None
    if beside is not None and beside.exists():
        return str(beside)
    if source in PRESETS or not looks_like_path(source):  # a preset (refused by `prepare` in its own words) or a
        return source                                      # Hub id, resolved from the local cache like any SOURCE
    places = f"{Path.cwd()}" + (f" or beside {plan_file}" if beside is not None else "")
    raise UsageError(f"{where} was made for {source}, which does not exist (looked from {places}): give the "
                     f"model's SOURCE (dmap run SOURCE -d {where} ...), or plan it again.")


def prepare(request: RunRequest, status: Callable[[str | None], None] = lambda message: None):
    """Resolve SOURCE (the demo when None), refuse what cannot run; (source, family, demo, defaults, notices)."""
    demo = is_demo(request.source)
    spec, root, defaults = source_root(request.source, status)
    source = resolve_with_pipeline(root, request.pipeline, request.component_files)
    source.spec = spec
    notices = [DEMO_NOTICE] if demo else []
    if source.kind != "pipeline":
        raise UsageError(f"dmap run needs a pipeline folder (model_index.json); {request.source} is a single {source.kind}.")
    missing = without_weights(source)
    if missing:
        raise UsageError(missing)
    if source.preset and all(c.weights is None for c in source.components):
        raise UsageError(preset_refusal(source.preset))
    family = family_for(source.pipeline_class)
    if family is None or not family.runs(source.pipeline_class):
        raise UsageError(f"dmap run does not support {source.pipeline_class}: it runs {', '.join(supported_pipelines())}.")
    refusal = family.refusal(request.generation, tuple(c.name for c in source.components))
    if refusal:  # before a plan file is read or anything is shown (Family.validate says the same later)
        raise UsageError(refusal)
    return source, family, demo, defaults, notices


def check_devices_present(plan: Plan, cpu_ranks: int = 0) -> None:
    """Without --simulate, every device the plan names must exist here. Checked before the plan is shown
    and, when the answer is known without it (no GPU driver, `cuda_devices_without_torch`), before torch
    is imported. `cpu_ranks`: the pipeline ranks of a machine without GPUs stand in for GPUs 0 .. N - 1
    (dm_cli.run.ranks.pipeline)."""
    devices = {device_key(dev) for comp in plan.components.values() for dev in comp.device_map.values()}
    gpus = None
    for dev in sorted(devices, key=str):
        if dev in ("cpu", "disk"):
            continue
        if dev == "mps":
            if sys.platform != "darwin" or not _mps_available():
                raise UsageError("The plan places weights on mps, which this machine lacks: add --simulate to run it on the CPU.")
            continue
        if gpus is None:
            gpus = visible_gpus()
        if int(dev) >= max(gpus, cpu_ranks):
            raise UsageError(
                f"The plan places weights on GPU {dev} but this machine has {gpus} GPU(s): add --simulate to run "
                "it on the CPU with the split check, or plan for this machine (omit --max-memory)."
            )


def _mps_available() -> bool:
    import torch  # lazy: torch (heavy, off start-up)

    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def settle_generation(generation: Generation, source: Source, family: Family, defaults: dict,
                      per_prompt_images: bool = False) -> Generation:
    """Every default filled in (given, else the demo's or the plan file's, else the family's) and the family's
    rules checked: `Family.settle` and `Family.validate`, as `dmap plan` applies them."""
    comps = {c.name: c for c in source.components}
    denoiser, vae = comps.get(family.denoiser), comps.get("vae")
    if denoiser is None or vae is None:
        raise SourceError(f"{source.spec} has no {family.denoiser} or no vae: dmap run needs both.")
    settled = family.settle(generation, denoiser.config or {}, vae.config, defaults)
    if settled.weights_only:
        raise UsageError("--height 0 and --width 0 make a weights-only plan; dmap run needs an image size.")
    family.validate(settled, source.pipeline_class, denoiser.config or {}, vae.config, tuple(comps), per_prompt_images)
    return settled


def refuse_existing_outputs(request: RunRequest, family: Family, num_images: int) -> None:
    """Every file this run will write, as settled (a plan's num_images, a video and its sidecar), before any work."""
    outputs: list = [Path(request.save_latents)] if request.save_latents else []
    if request.output and family.default_num_frames is not None:
        output = output_path(request, family)  # a .png for a video is refused here
        outputs += [output.rstrip("/"), sidecar_path(output)]
    elif request.output:
        check_image_output(request.output, num_images)  # the suffix, now that the pipeline makes images
        check_metadata_room(request.output, request.prompt, request.negative_prompt, "--output")
        outputs += existing_image_paths(request.output, num_images)  # one scan of the folder, whatever the count
    refuse_existing(outputs, request.overwrite)


def check_plan_matches(plan: Plan, source: Source, inputs: InputSpec, placement: PlacementSpec, where: str,
                       loras: tuple = (), plan_file: str | None = None, source_from_plan: bool = False) -> None:
    """A plan made for another model, other inputs, another dtype, other weight storage (what `placement`
    asks beside the plan file) or other LoRAs (`loras`, settled: their bytes are in the plan) is refused, with
    every mismatch at once. `source_from_plan`: SOURCE was taken from the plan (none given)."""
    dtype, weights = placement.dtype, placement.weights
    problems: list[str] = []
    ours = config_digest(source)
    names = {c.name for c in source.components}
    planned = set(plan.components)
    other_model = plan.config_digest is not None and plan.config_digest != ours
    same_source = source_from_plan or str(plan.source) == source.spec
    if other_model and same_source:
        problems.append(f"it was made for {plan.source} when its configs had digest {plan.config_digest}, and {source.spec} "
                        f"now has {ours}: another model (it changed since, or other --pipeline or --component-file "
                        "files)")
    elif other_model:
        problems.append(f"it was made for {plan.source} (config digest {plan.config_digest}), not {source.spec} "
                        f"({ours})")
    if planned != names:
        problems.append(f"it places components {sorted(planned)} but {source.spec} has {sorted(names)} "
                        "(a plan for another model)")
    for name, comp in plan.components.items():
        actual = next((c.cls for c in source.components if c.name == name), None)
        if actual is not None and comp.cls and comp.cls != "?" and comp.cls != actual:
            problems.append(f"it plans '{name}' as {comp.cls} but {source.spec} has {actual}")
    for key, value in (("height", inputs.height), ("width", inputs.width),
                       ("batch_size", inputs.batch_size), ("num_images", inputs.num_images),
                       ("num_frames", inputs.num_frames)):
        wanted = getattr(plan.inputs, key)
        if wanted not in (None, value, 0):
            flag = {"num_images": "--num-images", "num_frames": "--frames"}.get(key, f"--{key.replace('_', '-')}")
            problems.append(f"it was made for {key}={wanted}, this run asks for {value}"
                            + (f" (drop {flag} or give {wanted})" if key != "batch_size" else " (dmap run makes batch 1)"))
    if dtype and plan.dtype and parse_dtype(dtype) != plan.dtype:
        problems.append(f"it was made for {plan.dtype}, this run asks for {dtype} (drop --dtype)")
    if weights is not None:
        for name, fmt in parse_weights_spec(weights, sorted(names)).items():
            stored, wanted = storage_dtype(plan.weights.get(name), plan.dtype), storage_dtype(fmt, plan.dtype)
            if stored != wanted:
                problems.append(f"it stores '{name}' as {stored}, this run asks for {wanted} (drop --weights)")
    planned_loras = sorted((lora["component"], lora["digest"], lora["scale"]) for lora in plan.loras)
    if planned_loras != sorted((lora.component, lora.digest, lora.scale) for lora in loras):
        shown = lambda items: ", ".join(f"{c}:{d[:12]}:{s:g}" for c, d, s in items) or "none"  # noqa: E731
        flags = " ".join(shlex.quote(word) for word in lora_flags(plan))
        problems.append(f"it was made for LoRA(s) {shown(planned_loras)}, this run asks for "
                        f"{shown(sorted((lora.component, lora.digest, lora.scale) for lora in loras))} "
                        + (f"(give the plan's LoRAs: {flags})" if flags else "(drop --lora)"))
    # the plan file does not record --pipeline nor --component-file: no `dmap plan` rebuilt from it would hold them
    rebuildable = not any(c.single_file is not None for c in source.components)
    if problems and other_model and not same_source and rebuildable:
        raise UsageError(f"{where} does not match this run: " + "; ".join(problems) + f". Run the plan's model: the "
                         f"same command with SOURCE {plan.source} (or none); or plan {source.spec} with this plan's "
                         f"flags and run with that plan: {_plan_again(plan, source, plan_file, False)}")
    if problems and other_model and rebuildable:
        raise UsageError(f"{where} does not match this run: " + "; ".join(problems) + ". Plan it again: "
                         + _plan_again(plan, source, plan_file, True))
    if problems:
        command, target = _plan_for_run(plan, source, inputs, placement, loras, plan_file)
        raise UsageError(f"{where} does not match this run: " + "; ".join(problems)
                         + f". Or plan it for this run, with the plan's other flags: {command}, then run with -d "
                         f"{shlex.quote(target)} (or run without --device-map).")


def _plan_again(plan: Plan, source: Source, plan_file: str | None, same_model: bool) -> str:
    """The pasteable `dmap plan` that makes this plan again for `source`: over the plan file when the model is
    the one it was made for (it changed since), into a file of its own beside it otherwise."""
    if plan_file is None:
        return plan_command(plan, source.spec, "PLAN.json")
    if same_model:
        return plan_command(plan, source.spec, plan_file, overwrite=True)
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(source.spec).name.strip(".")) or "model"
    target = Path(plan_file).with_name(f"{Path(plan_file).stem}-{name}.json")
    return plan_command(plan, source.spec, str(target))


def _plan_for_run(plan: Plan, source: Source, inputs: InputSpec, placement: PlacementSpec, loras: tuple,
                  plan_file: str | None) -> tuple[str, str]:
    """(the pasteable `dmap plan` that makes `plan` again with this run's inputs, dtype, weights and LoRAs and the
    plan's own devices, mode, cache and the rest, the file it writes): beside the plan file, never over it."""
    names = sorted(c.name for c in source.components)
    fields: dict = {"inputs": replace(plan.inputs, height=inputs.height, width=inputs.width, batch_size=1,
                                      num_images=inputs.num_images, num_frames=inputs.num_frames),
                    "loras": [{"component": lora.component, "path": lora.path, "scale": lora.scale} for lora in loras]}
    if placement.dtype:
        fields["dtype"] = parse_dtype(placement.dtype)
    if placement.weights is not None:
        fields["weights"] = {**plan.weights, **parse_weights_spec(placement.weights, names)}
    target = Path(plan_file or "plan.json")
    target = str(target.with_name(f"{target.stem}-run.json"))
    return plan_command(replace(plan, **fields), source.spec, target, overwrite=Path(target).exists()), target


def check_plan_cache(plan: Plan, asked, where: str, off: bool = False) -> Plan:
    """The plan a run follows, as to its step cache: the plan's cache (`Plan.step_cache`, its state counted on its
    devices), which `asked` (--cache, settled; None: not given) must be; the plan's cache is kept when none is asked.
    `off` (--cache none, which settles to None like no --cache): the plan without its cache, neither hooks nor their
    state, so the run is a run of the same placement planned without one."""
    planned = plan.cache
    if off and planned is not None:
        stages = [replace(stage, use={device: replace(use, cache=0) for device, use in stage.use.items()})
                  for stage in plan.stages]
        return replace(plan, step_cache={}, stages=stages)
    if asked is None or asked == planned:
        return plan
    raise UsageError(f"{where} was made for --cache {planned.label if planned else 'none'}, this run asks for "
                     f"--cache {asked.label} (its state is counted in the plan): drop --cache (--cache none runs it "
                     "without one), or plan again with it.")


def check_tiled_decode(plan: Plan, source: Source, where: str) -> None:
    """A plan that decodes a component in tiles needs a class that can (diffusers' enable_tiling())."""
    comps = {c.name: c for c in source.components}
    for name in plan.tiled_decode:
        comp = comps.get(name)
        if comp is not None and not can_tile(comp):
            raise UsageError(f"{where} decodes '{name}' in tiles, but {comp.cls} cannot (it has no enable_tiling): "
                             f"plan again with dmap plan {source.spec} --output PLAN.json.")


def make_run_plan(source: Source, request: RunRequest, generation: Generation, family: Family | None = None,
                  sharing: StepSharing | None = None) -> Plan:
    """Plan with dmap's planner (`dm_cli.planning.make.make_plan`) for this settled generation (batch 1) and the
    request's devices: `PlanOptions.of`, as `dmap plan` and `dm_cli.plan` make theirs, so that no setting of the
    generation is left out of an inline plan; `sharing` (settle's decision) says whether it is cut for pipeline ranks.

    A session whose prompts bring their own input images (`per_prompt_images`) and gave none is planned for
    the images the family needs, each of the output's size (what an image-to-image pipeline resizes it to)."""
    # dmap run makes batch 1; the LoRAs as asked (make_plan settles their targets, as for dmap plan)
    generation = replace(generation, batch_size=1, loras=request.generation.loras)
    needed = family.min_input_images if family is not None and request.per_prompt_images else 0
    if needed and not generation.images:
        generation = replace(generation, images=(InputImage(generation.width, generation.height),) * needed)

    single = next((c.single_file for c in source.components if c.single_file is not None and not c.single_file.named),
                  None)
    root, pipeline = (str(single.path), str(source.root)) if single is not None else (str(source.root), None)
    files = tuple(named_component_files(source).items())  # --component-file's, planned as given
    parallel = _planned_parallel(sharing)
    placement = request.placement
    if parallel.active and placement.max_memory is None and visible_gpus() == 0:
        placement = replace(placement, max_memory=cpu_rank_devices(parallel.world_size))
    prediction = PredictionRequest(steps=generation.steps, queue=min(max(1, request.queue), MAX_QUEUE),
                                   prompt=request.prompt or None, compile=_planned_compile(request))
    plan = make_named_plan(root, source.spec, PlanOptions.of(generation, placement, pipeline=pipeline,
                                                             component_files=files,
                                                             switch_loras=request.switch_loras,
                                                             parallel=parallel, prediction=prediction))
    if plan.parallel is not None:  # planned for the ranks of this very launch: no advice to launch it
        plan.warnings = [w for w in plan.warnings if w != launch_warning(plan.parallel)]
    return plan


def _planned_parallel(sharing: StepSharing | None) -> ParallelRequest:
    """What the inline plan plans for the ranks, read from the sharing settle decided (dm_cli.run.settle.layout): a
    pipeline under torchrun cuts the denoiser into one slice per rank (dm_cli.run.ranks.pipeline); the other layouts
    run the single-process plan."""
    if sharing is not None and sharing.layout is Layout.PIPELINE and sharing.ranks.world_size > 1:
        return ParallelRequest(sharing.ranks.world_size, Parallel.PIPELINE)
    return ParallelRequest()


def _planned_compile(request) -> CompileMode:
    """--compile as the run's own plan predicts it: none where the activation tracker makes the run eager whatever
    the plan (run/hooks/compile.py `eager_reason`; the plan says the reasons it can see itself)."""
    if request.simulate or request.track_activations:
        return CompileMode.NONE
    return request.compile


def check_weight_files(source) -> dict[str, int]:
    """Every component's weights checked (one sentence for missing or corrupt files, before the libraries are
    imported): the largest shard of each, what its load may add to the host's peak."""
    return {comp.name: check_component_files(comp) for comp in source.components}


def check_component_files(comp) -> int:
    """Headers of a component's safetensors validated; returns the largest shard's size."""
    if comp.single_file is not None:  # its header was read (and checked) when SOURCE was resolved
        return comp.single_file.path.stat().st_size
    if comp.weights is None:
        raise CheckpointError(
            f"Component '{comp.name}' has no safetensors weights in {comp.folder}: add them (dmap shard converts .bin files) "
            "or pick the folder that has them."
        )
    checkpoint = open_checkpoint(comp.weights, strict=True)
    return max((p.stat().st_size for p in checkpoint.files), default=0)

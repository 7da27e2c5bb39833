"""`dmap run`: staged encode -> denoise -> decode across devices, following a dmap plan.

The diffusers "distributed inference" recipe (load the text encoders, encode, free them; load the
denoiser, denoise to latents, free it; load the VAE, decode) for any pipeline a family in
`dm_cli.families` knows: this module holds the request and the facts its checks compare (SOURCE,
defaults, the plan against the run), which `dm_cli.run.settle.settle` applies once, in order; `dm_cli.run.loops.stages`
loads each stage's components to their planned devices and runs it; `dm_cli.run.load.loading` loads and
frees components; `dm_cli.run.load.meter` measures. `simulate=True` runs every
virtual device on the CPU with the tracer's split check active, so a two-GPU plan can be proven on
a laptop. No Typer, no Rich here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dm_cli.devices import device_key
from dm_cli.errors import CheckpointError, SourceError, UsageError
from dm_cli.families import Family, family_for, supported_pipelines
from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, check_text
from dm_cli.io.atomic import refuse_existing
from dm_cli.io.checkpoint import open_checkpoint
from dm_cli.io.images import check_image_output, check_metadata_room, existing_image_paths
from dm_cli.io.input_images import describe_image, split_keyframe
from dm_cli.io.video import sidecar_path
from dm_cli.model.demo import DEMO_NOTICE, is_demo, source_root
from dm_cli.model.formats.weight_formats import parse_weights_spec, storage_dtype
from dm_cli.model.lora import read_loras
from dm_cli.model.single_file_weights import named_component_files, resolve_with_pipeline, without_weights
from dm_cli.model.sources import PRESETS, config_digest, looks_like_path, preset_refusal
from dm_cli.planning.make import launch_warning, make_named_plan
from dm_cli.planning.modes import Parallel, Strategy
from dm_cli.planning.parallel.parallel import ParallelRequest
from dm_cli.planning.plan_command import lora_flags, plan_command
from dm_cli.planning.plan_options import PlanOptions
from dm_cli.planning.step_cache import parse_cache
from dm_cli.planning.time.plan_prediction import MAX_QUEUE, PredictionRequest
from dm_cli.planning.trace.trace import can_tile
from dm_cli.run.distributed import Ranks
from dm_cli.run.hooks.compile import parse_compile
from dm_cli.units import parse_dtype

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
    from dm_cli.model.sources import Source
    from dm_cli.planning.plan_file import Plan

# Peak host RAM during a component's load may exceed the largest shard by this much: the Python
# heap, safetensors' mmap bookkeeping and one tensor in flight during a dtype cast.
LOAD_RSS_MARGIN_BYTES = 64 * 1024 * 1024
# The activation tracker (MemoryMeter) costs Python work on every op, so in denoise it runs for the
# first TRACKED_STEPS steps only. Two, not one: from the second step on, the previous step's outputs
# (noise_pred, the CFG halves) are still alive in the pipeline's loop while the denoiser runs again,
# so step 2 is the steady state that every later step repeats (same graph, same shapes).
# None tracks every step (what the tests compare against).
TRACKED_STEPS: int | None = 2


# --- request / result ----------------------------------------------------------------------


# The names `RunRequest.of` sorts flat options into (the command line's, the API's, the tests')
GENERATION_FIELDS = ("height", "width", "num_frames", "fps", "steps", "guidance_scale", "negative_prompt",
                     "max_sequence_length", "num_images")
PLACEMENT_FIELDS = ("max_memory", "mode", "overhead", "dtype", "weights")


@dataclass
class RunRequest:
    """Everything `dmap run` was asked for: a prompt and a seed, one generation (`inputs.Generation`, unsettled:
    None is the pipeline's, the demo's or the plan file's default), one placement (`inputs.PlacementSpec`) or a
    plan file, and where the outputs go."""

    source: str | None
    prompt: str
    seed: int = 0
    generation: Generation = field(default_factory=Generation)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    plan_file: str | None = None  # --device-map PLAN.json: follow it (else plan here with `placement`)
    output: str | None = "dmap.png"  # video families: "dmap.png" is read as the default, dmap.mp4
    save_latents: str | None = None
    simulate: bool = False
    overwrite: bool = False  # replace an existing --output / --save-latents
    track_activations: bool = False  # per-op activation tracking on CPU (always on under simulate)
    # the input images may come with each prompt (dm_cli.load's generate(image=...), queue items): a family that
    # needs one checks each prompt's, not the session's default generation
    per_prompt_images: bool = False
    # --parallel (dm_cli.run.ranks.parallel): how torchrun ranks share each step; None follows the plan file's `parallel`
    parallel: str | None = None
    pipeline: str | None = None  # --pipeline: SOURCE is a single file, the rest of the pipeline comes from here
    component_files: dict | None = None  # --component-file NAME=FILE: these components from these single files
    cache_off: bool = False  # --cache none: a plan file's step cache is switched off (check_plan_cache)
    switch_loras: bool = False  # the inline plan keeps the LoRAs unfused: served requests, queue items choose
    compile: str = "none"  # --compile: none | regional | auto | full (dm_cli.run.hooks.compile)
    queue: int = 1  # the prompts this run generates (a queue's items): the predicted time is for them

    def __post_init__(self) -> None:
        """The prompt is text the tokenizer takes (the check queue items and `dmap serve` share), before SOURCE."""
        check_text(self.prompt, "--prompt")

    @classmethod
    def of(cls, source: str | None, prompt: str, *, device_map: str = "auto", settings: dict | None = None,
           **options) -> "RunRequest":
        """A request from flat options, as `dmap run` and `dm_cli.load` take them: the generation's names
        (GENERATION_FIELDS, `images`, `last_image`, `settings`: the family's own), the placement's (PLACEMENT_FIELDS), `device_map` (a
        strategy, else a plan file) and the request's own (seed, output, ...)."""
        images = input_images(options.pop("images", None))  # paths and PIL images read here, before SOURCE
        last = last_input_image(options.pop("last_image", None))

        loras = read_loras(options.pop("loras", None))

        if "compile" in options:  # a bad compile= refused before SOURCE is resolved (the CLI's parser did it there)
            options["compile"] = parse_compile(options["compile"]).value
        asked_cache = options.pop("cache", None)
        cache = parse_cache(asked_cache)
        options["cache_off"] = asked_cache is not None and cache is None  # "none" settles to None, as no --cache
        generation = Generation(images=images, last_image=last, loras=loras, cache=cache,
                                **{k: options.pop(k) for k in GENERATION_FIELDS if k in options})
        placement = {k: options.pop(k) for k in PLACEMENT_FIELDS if k in options}
        strategy, plan_file = (device_map, None) if device_map in Strategy.words() else ("auto", device_map)
        return cls(source, prompt, generation=generation.with_settings(settings or {}),
                   placement=PlacementSpec(strategy=strategy, **placement), plan_file=plan_file, **options)

    @property
    def negative_prompt(self) -> str | None:
        return self.generation.negative_prompt


def input_images(values, where: str = "--image") -> tuple[InputImage, ...]:
    """Input images as a generation holds them: each a path (read as hostile input by
    `dm_cli.io.input_images.describe_image`: its size after EXIF orientation and its digest), an in-memory PIL
    image (the API's `image=`), or an InputImage; one value or a list of them, in order. A keyframe (LTX-2) is a
    string `PATH@FRAME[:STRENGTH]` (`dm_cli.io.input_images.split_keyframe`) or, for the API, a dict
    {"image": PATH or PIL image, "frame": N, "strength": S} (its path taken as it is, '@' and all)."""
    if values is None:
        return ()
    if isinstance(values, (str, os.PathLike, InputImage, dict)) or hasattr(values, "getpixel"):
        values = [values]
    return tuple(_input_image(value, where) for value in values)


def _input_image(value, where: str, split: bool = True) -> InputImage:
    if isinstance(value, InputImage):
        return value
    if isinstance(value, (str, os.PathLike)):
        path, frame, strength = split_keyframe(value, where) if split and isinstance(value, str) else (value, None, None)
        image = describe_image(path, where)
        return replace(image, frame=frame, strength=strength) if frame is not None else image
    if hasattr(value, "getpixel"):  # a PIL image
        return in_memory_image(value)
    if isinstance(value, dict):
        unknown = sorted(set(map(str, value)) - {"image", "frame", "strength"})
        if unknown or "image" not in value or isinstance(value["image"], dict):
            raise UsageError(f"{where}: a keyframe is {{\"image\": PATH or PIL image, \"frame\": N, \"strength\": S}}"
                             + (f", not with {', '.join(unknown)}." if unknown else "."))
        return replace(_input_image(value["image"], where, split=False), frame=value.get("frame"),
                       strength=value.get("strength"))
    raise UsageError(f"{where} takes image paths or PIL images, not a {type(value).__name__}.")


def last_input_image(value, where: str = "--last-image") -> InputImage | None:
    """A video's last frame (`--last-image`, the API's `last_image=`, a queue item's "last_image"): one path, PIL
    image or InputImage, read as `input_images` reads each; None: none."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        raise UsageError(f"{where} takes one image (the video's last frame), not a list.")
    return input_images(value, where)[0]


def in_memory_image(image) -> InputImage:
    """A PIL image given in memory, converted to RGB as diffusers' load_image does; its digest is the pixels'."""
    rgb = image.convert("RGB") if image.mode != "RGB" else image
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()
    return InputImage(rgb.width, rgb.height, None, digest, pixels=rgb)


# --- plan handling -------------------------------------------------------------------------


def plan_digest(plan: Plan) -> str:
    """A hash of what decides the placement (model, dtype, mode, inputs, device maps, stages): the same plan
    made twice on this machine has the same digest, whatever memory happened to be free."""
    data = plan.to_json()
    decisive = {key: data.get(key) for key in ("format", "version", "config_digest", "dtype", "mode", "inputs")}
    decisive["components"] = {name: [c.get("class"), c.get("device_map")] for name, c in data["components"].items()}
    decisive["stages"] = [[s["name"], s["components"]] for s in data["stages"]]
    if plan.tiled_decode:  # tiles change pixels at their seams (absent: the digests of untiled plans stay as they were)
        decisive["tiled_decode"] = sorted(plan.tiled_decode)
    if plan.loras:  # their bytes sit beside the layers they patch (absent: the digests of plans without stay as they were)
        decisive["loras"] = [[lora["component"], lora["digest"], lora["scale"], lora["fused"]] for lora in plan.loras]
    return hashlib.sha256(json.dumps(decisive, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_run_plan(source: Source, request: RunRequest, generation: Generation, family: Family | None = None) -> Plan:
    """Plan with dmap's planner (`dm_cli.planning.make.make_plan`) for this settled generation (batch 1) and the
    request's devices: `PlanOptions.of`, as `dmap plan` and `dm_cli.plan` make theirs, so that no setting of the
    generation is left out of an inline plan.

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
    parallel = _planned_parallel(request)
    placement = request.placement
    if parallel.active and placement.max_memory is None and visible_gpus() == 0:
        placement = replace(placement, max_memory=cpu_rank_devices(parallel.world_size))
    prediction = PredictionRequest(steps=generation.steps, queue=min(max(1, request.queue), MAX_QUEUE),
                                   prompt=request.prompt or None, compile=_planned_compile(request))
    plan = make_named_plan(root, source.spec, PlanOptions.of(generation, placement, pipeline=pipeline,
                                                             component_files=files, loras=generation.loras,
                                                             switch_loras=request.switch_loras,
                                                             parallel=parallel, prediction=prediction))
    if plan.parallel is not None:  # planned for the ranks of this very launch: no advice to launch it
        plan.warnings = [w for w in plan.warnings if w != launch_warning(plan.parallel)]
    return plan


def cpu_rank_devices(world_size: int) -> str:
    """Pipeline ranks on a machine without GPUs: each rank's CPU stands for GPU r (as the run places them,
    `dm_cli.run.ranks.parallel.cpu_ranks`), with an equal share of the available RAM."""
    from dm_cli.planning.placement.budgets import available_ram  # lazy: looked up per call (tests patch available_ram)

    share = available_ram() // world_size
    return ",".join(f"{rank}={share}B" for rank in range(world_size))


def _planned_parallel(request: RunRequest):
    """What the inline plan plans for the ranks: `--parallel pipeline` under torchrun cuts the denoiser into one
    slice per rank (dm_cli.run.ranks.pipeline); the other layouts run the single-process plan."""
    ranks = Ranks.from_env()
    if request.parallel == Parallel.PIPELINE and ranks.world_size > 1:
        return ParallelRequest(ranks.world_size, "pipeline")
    return ParallelRequest()


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


def run_inputs(generation: Generation) -> InputSpec:
    """A settled generation as the planner sees it for `dmap run` (batch 1; fps is no input of a plan)."""
    return replace(generation.inputs(), batch_size=1, fps=None)


def inputs_from_plan(plan: Plan) -> dict:
    """What a plan file says about the run's inputs: the defaults `dmap run -d PLAN.json` takes from it (its
    `inputs`, and the steps its predicted time is for: `dmap plan --steps 8 -o p.json` then `dmap run -d p.json` runs
    8 steps, the time the plan predicted)."""
    given = {"height": plan.inputs.height, "width": plan.inputs.width, "num_images": plan.inputs.num_images,
             "guidance_scale": plan.inputs.guidance_scale, "max_sequence_length": plan.inputs.max_sequence_length,
             "num_frames": plan.inputs.num_frames, "fps": plan.inputs.fps,
             "steps": (plan.predicted_time or {}).get("steps")}
    if plan.inputs.weights_only:  # a weights-only plan says nothing about the image size
        given.pop("height"), given.pop("width")
    return {k: v for k, v in given.items() if v is not None}


def _planned_compile(request) -> str:
    """--compile as the run's own plan predicts it: none where the activation tracker makes the run eager whatever
    the plan (run/hooks/compile.py `eager_reason`; the plan says the reasons it can see itself)."""
    if request.simulate or request.track_activations:
        return "none"
    return parse_compile(request.compile).value


def prediction_at(predicted: dict, steps: int | None = None, queue: int | None = None) -> dict:
    """A plan's `predicted_time` at `steps` steps and a queue of `queue` prompts (None: the prediction's own): its
    seconds per step times the steps, over the images one call makes, and times the queue; each layout's the same
    way. The one function `dmap plan` and `dmap run` print a prediction through, so that a run's printed time is
    for the steps and prompts it runs, whether it planned here or follows a plan file made at other steps."""
    if not predicted or "step_s" not in predicted:
        return predicted
    steps = steps or predicted.get("steps") or 1
    queue = queue or predicted.get("queue") or 1
    per_call = max(1, predicted.get("images_per_call") or 1)

    def times(step_s: float) -> dict[str, float]:
        return {"step_s": step_s, "image_s": _four_figures(steps * step_s / per_call),
                "queue_s": _four_figures(steps * step_s * queue)}

    retimed = {**predicted, "steps": steps, "queue": queue, **times(predicted["step_s"])}
    if "pipeline_s" in predicted:  # one whole call: the encoders and the decode once, every step between
        retimed["pipeline_s"] = _four_figures(predicted.get("encode_s", 0) + steps * predicted["step_s"]
                                              + predicted.get("decode_s", 0))
    if isinstance(predicted.get("layouts"), dict):
        retimed["layouts"] = {name: times(layout["step_s"]) for name, layout in predicted["layouts"].items()
                              if isinstance(layout, dict) and "step_s" in layout}
    return retimed


def _four_figures(value: float) -> float:
    """Four significant figures, as the plan's own prediction keeps them."""
    return float(f"{value:.4g}")


def cuda_devices_without_torch() -> int | None:
    """How many CUDA (or ROCm) GPUs this process can see, when that is known without importing torch
    (~9 s): 0 when CUDA_VISIBLE_DEVICES hides every GPU or, on Linux, no GPU driver is loaded (no
    /proc/driver/nvidia, /dev/nvidia*, /dev/kfd nor /dev/dxg); None when only torch can say."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return 0  # CUDA stops at the first invalid entry: "" and "-1" hide every GPU
    if not sys.platform.startswith("linux"):
        return None
    if Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists() or Path("/dev/dxg").exists():
        return None
    try:
        if any(name.startswith("nvidia") for name in os.listdir("/dev")):
            return None
    except OSError:
        return None
    return 0


def visible_gpus() -> int:
    """CUDA GPUs this process sees (without importing torch when the driver answers)."""
    gpus = cuda_devices_without_torch()
    if gpus is None:
        import torch  # lazy: torch (heavy, off start-up)

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus


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


# --- settling the request ------------------------------------------------------------------


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


def output_path(request: RunRequest, family: Family) -> str:
    """The output the user asked for; for a video family the default dmap.png becomes dmap.mp4."""
    if family.default_num_frames is not None and request.output == RunRequest.output:
        return "dmap.mp4"
    return request.output


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

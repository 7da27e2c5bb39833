"""`dmap run`: staged encode -> denoise -> decode across devices, following a dmap plan.

The diffusers "distributed inference" recipe (load the text encoders, encode, free them; load the
denoiser, denoise to latents, free it; load the VAE, decode) for any pipeline a family in
`dm_cli.families` knows: this module holds the request, `RunRequest`, and the facts its checks compare (its
inputs, the plan's digest and prediction, the visible devices); the checks are `dm_cli.run.settle.checks`', which
`dm_cli.run.settle.settle` applies once, in order; `dm_cli.run.loops.stages` loads each stage's components to their
planned devices and runs it; `dm_cli.run.load.loading` loads and frees components; `dm_cli.run.load.meter` measures. `simulate=True` runs every
virtual device on the CPU with the tracer's split check active, so a two-GPU plan can be proven on
a laptop. No Typer, no Rich here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dm_cli.errors import UsageError
from dm_cli.families import Family
from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, check_text
from dm_cli.io.input_images import describe_image, split_keyframe
from dm_cli.model.lora import read_loras
from dm_cli.planning.modes import CompileMode, Parallel, Strategy, parse_compile
from dm_cli.planning.placement import budgets  # the module: tests patch its available_ram
from dm_cli.planning.step_cache import parse_cache

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
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
    parallel: Parallel | None = None
    pipeline: str | None = None  # --pipeline: SOURCE is a single file, the rest of the pipeline comes from here
    component_files: dict | None = None  # --component-file NAME=FILE: these components from these single files
    cache_off: bool = False  # --cache none: a plan file's step cache is switched off (check_plan_cache)
    switch_loras: bool = False  # the inline plan keeps the LoRAs unfused: served requests, queue items choose
    compile: CompileMode = CompileMode.NONE  # --compile (dm_cli.run.hooks.compile)
    queue: int = 1  # the prompts this run generates (a queue's items): the predicted time is for them

    def __post_init__(self) -> None:
        """The prompt is text the tokenizer takes (the check queue items and `dmap serve` share), before SOURCE;
        --parallel's and --compile's words become their members here, at the door, so that the checks inside
        compare members."""
        check_text(self.prompt, "--prompt")
        self.parallel = parallel_choice(self.parallel)
        self.compile = parse_compile(self.compile)

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
            options["compile"] = parse_compile(options["compile"])
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


def parallel_choice(word: str | None) -> Parallel | None:
    """--parallel's word (the CLI's parser, the API's `parallel=`, a queue's choice) as its member; a word that is
    none of them refused in one sentence, as the CLI's parser words it."""
    if word is None or isinstance(word, Parallel):
        return word
    if word not in Parallel.words():
        raise UsageError(f"--parallel must be {', '.join(Parallel.words()[:-1])} or auto, not {word!r}.")
    return Parallel(word)


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


def cpu_rank_devices(world_size: int) -> str:
    """Pipeline ranks on a machine without GPUs: each rank's CPU stands for GPU r (as the run places them,
    `dm_cli.run.settle.layout.cpu_ranks`), with an equal share of the available RAM."""
    share = budgets.available_ram() // world_size
    return ",".join(f"{rank}={share}B" for rank in range(world_size))


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


# --- settling the request ------------------------------------------------------------------


def output_path(request: RunRequest, family: Family) -> str:
    """The output the user asked for; for a video family the default dmap.png becomes dmap.mp4."""
    if family.default_num_frames is not None and request.output == RunRequest.output:
        return "dmap.mp4"
    return request.output

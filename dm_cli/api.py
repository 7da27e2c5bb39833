"""dmap's Python API: `dm_cli.plan`, `dm_cli.load`, `dm_cli.dispatch` (the names in `dm_cli.__all__`).

- `plan(source, max_memory=..., height=..., ...)` -> `Plan`: what `dmap plan` prints and writes.
- `load(source, plan)` -> `Session`: keeps components placed per the plan (resident) or loads them
  per stage (staged); `Session.generate(prompts, ...)` yields `Generated` (PIL images and their
  metadata), stage-major in staged mode (each stage's components loaded once per chunk of prompts),
  and can be called again without reloading resident components.
- `dispatch(pipe, plan)`: places an existing diffusers pipeline's components per the plan, for
  users who call `pipe(...)` themselves.

`dmap run` is a thin layer over the same `Session`: `--prompts` goes through `load` and
`generate` (`dm_cli.run.sessions.queue_runner`), `--prompt` through `Session.run_job` with every stage
measured (`dm_cli.run.sessions.single`), so the CLI and a script get the same images for the same seeds.
Everything else in dm_cli may change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dm_cli.devices import normalise_map
from dm_cli.errors import UsageError
from dm_cli.inputs import Generation, InputImage, PlacementSpec
from dm_cli.io.input_images import parse_image_size
from dm_cli.model.demo import source_root
from dm_cli.model.lora import read_loras
from dm_cli.model.single_file_weights import parse_component_files
from dm_cli.planning import plan_file as plan_files  # the modules, not their functions: tests patch these
from dm_cli.planning.make import make_named_plan
from dm_cli.planning.modes import parse_compile
from dm_cli.planning.parallel.parallel import ParallelRequest
from dm_cli.planning.plan_options import PlanOptions
from dm_cli.planning.step_cache import parse_cache
from dm_cli.planning.time.plan_prediction import PredictionRequest
from dm_cli.planning.trace import trace as tracing
from dm_cli.run.load.loading import execution_device
from dm_cli.run.options import refuse_untaken
from dm_cli.run.request import RunRequest, input_images, last_input_image
from dm_cli.run.sessions.session import Session
from dm_cli.run.settle import checks as settle_checks
from dm_cli.run.settle import settle as settling
from dm_cli.run.settle.settle import Entry
from dm_cli.units import parse_dtype

if TYPE_CHECKING:  # annotations only: the plan module costs start-up time
    from dm_cli.planning.plan_file import Plan

# --- plan ---------------------------------------------------------------------------------------


def plan(source: str | None = None, *, max_memory: str | None = None, height: int | None = None,
         width: int | None = None, batch_size: int = 1, num_images: int = 1, guidance_scale: float | None = None,
         max_sequence_length: int | None = None, strategy: str = "auto", mode: str = "auto", dtype: str | None = None,
         overhead: str | None = None, component: str | None = None, check: bool = True, use_cache: bool = True,
         num_frames: int | None = None, fps: int | None = None, weights: str | None = None,
         negative_prompt: str | None = None, image=None, image_size=None, last_image=None, last_image_size=None,
         on_progress: Callable[[str], None] | None = None, world_size: int = 1, parallel: str | None = None,
         device_tflops: float | None = None, link_gbps: float | None = None, pipeline: str | None = None,
         component_files: dict | None = None, lora=None, cache=None, in_flight: int | None = None,
         profile: str | None = None, steps: int | None = None, queue: int = 1, prompt: str | None = None,
         compile: str = "none", **settings) -> Plan:
    """Plan where every component and block of SOURCE goes (None: the bundled random-weight demo).

    `max_memory` is a device spec ("0=16GB,1=16GB,cpu=64GB"; None: this machine). `height`/`width`
    None: the pipeline's default size (the one `dmap run` uses); 0 plans weights only. Raises
    `DoesNotFitError` (with the nearest change that fits) when nothing fits. `on_progress(message)`
    hears each step as it starts (resolving, sizing and tracing each component, the split check).
    `settings` are the pipeline family's own (true_cfg_scale=..., guidance_scale_2=...: see
    `dm_cli.families.Setting`), checked as `load` and `dmap run` check them; so is `negative_prompt`.
    `image` (paths or PIL images, one or a list) and `image_size` ("WxH", one or a list): the input images
    (references, the image to edit), of which a plan needs only the sizes; images first, then sizes. `last_image`
    (a path or PIL image) or `last_image_size` ("WxH"): a first-last-frame video's last frame (Wan 2.2 image-to-video).
    `world_size` > 1 with `parallel` ("cfg", "context", "cfg+context", "pipeline" or "auto", the default above one
    rank) adds `Plan.parallel`: how that many torchrun ranks share each denoising step (or, "pipeline", a slice of the
    denoiser's blocks each, with `in_flight` queue prompts in flight: default world_size), with per-rank memory
    and step times predicted at `device_tflops` per GPU and `link_gbps` between GPUs (dm_cli.planning.parallel.parallel; None:
    the device profile's). `profile` (a file `dmap calibrate` wrote, or "table:h100-sxm"; None: this machine's
    calibrated one, else dmap's defaults), `steps` (None: the pipeline's default) and `queue` (prompts): the plan's
    `predicted_time`, the denoise stage's seconds per step, image and queue (dm_cli.planning.time.step_time); `prompt`:
    the prompt it is for (Qwen-Image and Z-Image run the text at the prompt's length, not the maximum).
    `pipeline` (a preset or a folder): SOURCE is a single file (original-layout safetensors or GGUF) holding one
    component, the rest of the pipeline comes from here. `component_files` ({"transformer_2": "LOW.gguf"}): these
    components from these single files (each checked against its config; SOURCE's file then goes to the first
    matching component they do not name). `lora`: LoRA adapters, one or a list of "[COMPONENT=]FILE[:SCALE]"
    strings (as `--lora`): their bytes are counted beside the layers they patch. `cache`: a step cache on the denoiser,
    "NAME[:KEY=VALUE,...]" as `--cache` takes it (fbc, taylorseer, magcache): what its hooks hold is counted on the
    devices of the blocks that hold it (`Plan.step_cache`). `compile` (as `--compile`; None: none): the predicted step
    as a run that compiles its denoiser takes it (elementwise ops fused between matmuls), or eager's and why.
    """
    refuse_untaken("api.plan", settings)  # an option of dmap run's (seed=, ...): refused with its reason

    spec, root, defaults = source_root(source)
    pick = lambda given, key: defaults.get(key) if given is None else given  # noqa: E731 - the demo's defaults
    last = _last_image_size(last_image, last_image_size)
    generation = Generation(height=pick(height, "height"), width=pick(width, "width"), batch_size=batch_size,
                            num_images=num_images, guidance_scale=pick(guidance_scale, "guidance_scale"),
                            max_sequence_length=pick(max_sequence_length, "max_sequence_length"),
                            num_frames=num_frames, fps=fps, negative_prompt=negative_prompt,
                            images=_input_image_sizes(image, image_size),
                            last_image=InputImage(*last) if last is not None else None,
                            loras=read_loras(lora, "lora"), cache=parse_cache(cache)).with_settings(settings)
    placement = PlacementSpec(max_memory, strategy, mode, overhead, parse_dtype(dtype) if dtype is not None else None,
                              weights)
    options = PlanOptions.of(generation, placement, component=component, check=check, use_cache=use_cache,
                             on_progress=on_progress, parallel=ParallelRequest(world_size, parallel, device_tflops, link_gbps,
                                                                              in_flight),
                             pipeline=pipeline, component_files=tuple(parse_component_files(component_files).items()),
                             prediction=PredictionRequest(profile, pick(steps, "steps"), queue, prompt,
                                                          parse_compile(compile)))
    return make_named_plan(root, spec, options)


def _input_image_sizes(image, image_size) -> tuple:
    """The input images as a plan sees them (`InputImage`s without pixels: each one's size and, for an LTX-2
    keyframe `PATH@FRAME`, its frame): the images' (read as `dmap run` reads them), then the sizes'."""
    sized = [InputImage(*i.size, frame=i.frame) for i in input_images(image)]
    if image_size is not None:
        sized += [parse_image_size(text) for text in ([image_size] if isinstance(image_size, str) else image_size)]
    return tuple(sized)


def _last_image_size(last_image, last_image_size) -> tuple[int, int] | None:
    """(width, height) of a video's last frame: the image's (read as `dmap run` reads it), else the size's."""
    if last_image is not None and last_image_size is not None:
        raise UsageError("Give last_image or last_image_size, not both (a video has one last frame).")

    if last_image_size is not None:
        return parse_image_size(last_image_size, "--last-image-size").size
    if isinstance(last_image, str) and not Path(last_image).exists() and _is_size(last_image):
        return parse_image_size(last_image, "--last-image").size  # `dmap plan --last-image 832x480`: a size
    last = last_input_image(last_image)
    return last.size if last is not None else None


def _is_size(text: str) -> bool:
    return re.fullmatch(r"\d+x\d+", text.strip(), re.IGNORECASE) is not None


# --- load ---------------------------------------------------------------------------------------


def load(source: str | None = None, plan: Plan | str | Path | None = None, *, simulate: bool = False, max_memory: str | None = None,
         mode: str = "auto", strategy: str = "auto", dtype: str | None = None, overhead: str | None = None,
         height: int | None = None, width: int | None = None, guidance_scale: float | None = None,
         max_sequence_length: int | None = None, weights: str | None = None, num_frames: int | None = None,
         fps: int | None = None, negative_prompt: str | None = None, image=None, last_image=None, on_plan: Callable | None = None, on_status: Callable[[str | None], None] | None = None,
         parallel: str | None = None, pipeline: str | None = None, component_files: dict | None = None,
         lora=None, cache=None, compile: str = "none", **settings) -> Session:
    """A pipeline placed per `plan` (a Plan, a plan JSON path, or None: plan here with the options).

    SOURCE None is the plan's source when a plan is given (it records it), else the bundled random-weight demo. A plan made for another model, size or dtype is
    refused (UsageError); one naming GPUs this machine lacks too, unless `simulate` (every planned
    device on the CPU, with the split check active). `weights` ("fp8", "transformer=fp8", ...) plans
    low-precision storage, or must match the given plan's. Nothing is loaded yet: resident components
    load on the first `generate` and stay; staged ones load per stage and chunk. `settings` are the pipeline
    family's own (true_cfg_scale=4.0 for Qwen-Image, guidance_scale_2=3.0 for Wan 2.2: `dm_cli.families.Setting`),
    the defaults of every `generate` call, as `negative_prompt` and `image` (input images: paths or PIL images,
    one or a list) and `last_image` (a first-last-frame video's last frame, Wan 2.2 image-to-video) are. `parallel` ("cfg", "context", "cfg+context", "auto"; None: the plan's `parallel`, "none": one
    process per image): under torchrun, how the ranks share each denoising step; every rank calls `generate` with
    the same prompts and seeds, and only rank 0's `Generated` carry images (the others' have none).
    `pipeline` (a folder with weights): SOURCE is a single file (original-layout safetensors or GGUF) holding one
    component, loaded as diffusers' `from_single_file` loads it; `component_files` ({"transformer_2": "LOW.gguf"}):
    these components from these single files, loaded the same way. `lora`: LoRA adapters, one or a list of
    "[COMPONENT=]FILE[:SCALE]" strings (as `--lora`), loaded into the denoiser by diffusers' `load_lora_weights`
    each time it loads, at their scales (`set_adapters`), unfused. `cache`: a step cache on the denoiser
    ("NAME[:KEY=VALUE,...]", as `--cache`; None: the plan's), applied with diffusers' `enable_cache` each time it loads.
    `compile` ("none", "regional", "auto", "full", as `--compile`; None: none): torch.compile on the denoiser as it
    loads (dm_cli.run.hooks.compile); what cannot compile runs eager, with a notice in `Session.notices`.
    """
    refuse_untaken("api.load", settings)  # an option of dmap plan's or generate()'s (steps=, ...): refused with its reason
    device_map = plan if isinstance(plan, (str, Path)) else strategy
    request = RunRequest.of(source, "", device_map=str(device_map), max_memory=max_memory, mode=mode,
                            dtype=dtype, overhead=overhead, height=height, width=width, guidance_scale=guidance_scale,
                            max_sequence_length=max_sequence_length, settings=settings, weights=weights,
                            num_frames=num_frames, fps=fps, negative_prompt=negative_prompt, images=image, simulate=simulate,
                            last_image=last_image, output=None, per_prompt_images=True, parallel=parallel, pipeline=pipeline,
                            component_files=component_files, loras=lora, cache=cache, compile=compile)
    settled = settling.settle(request, None if isinstance(plan, (str, Path)) else plan, entry=Entry.API,
                              on_plan=on_plan, on_status=on_status)
    return Session(settled, on_status=on_status)


# --- dispatch -----------------------------------------------------------------------------------


def dispatch(pipe, plan: Plan | str | Path):
    """Place an existing diffusers pipeline's components per `plan` (a Plan or a plan JSON path).

    A component on one device is moved there (with an accelerate hook that brings its inputs
    along); a split one is dispatched block by block with accelerate's `dispatch_model`. Its
    weights are already in host memory, so "disk" blocks stay there like "cpu" ones (streamed to
    their GPU when they run); nothing is written. A component the plan decodes in tiles gets its
    `enable_tiling()` called (UsageError for a class without it). Returns `pipe`.
    """
    from accelerate import dispatch_model  # lazy: accelerate (heavy, off start-up)
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module  # lazy: accelerate (heavy, off start-up)

    if isinstance(plan, (str, Path)):
        plan = plan_files.load_plan(plan)
    for name, placement in plan.components.items():
        model = getattr(pipe, name, None)
        if model is None or not hasattr(model, "named_parameters"):
            raise UsageError(f"The plan places '{name}' but this pipeline has no such model component.")
        if placement.cls not in ("?", "", None) and type(model).__name__ != placement.cls:
            raise UsageError(f"The plan places '{name}' as {placement.cls} but this pipeline's is "
                             f"{type(model).__name__}: it is a plan for another model.")
    settle_checks.check_devices_present(plan)
    for name in plan.tiled_decode:
        if not tracing.model_tiles(getattr(pipe, name)):
            raise UsageError(f"The plan decodes '{name}' in tiles, but {type(getattr(pipe, name)).__name__} cannot "
                             "(it has no enable_tiling).")
    for name, placement in plan.components.items():
        model = getattr(pipe, name)
        if name in plan.tiled_decode:
            model.enable_tiling()
        device_map = {k: ("cpu" if v == "disk" else v) for k, v in normalise_map(placement.device_map).items()}
        target = execution_device(device_map, False)
        if len(set(device_map.values())) == 1:
            model.to(target)
            if target.type != "cpu":
                add_hook_to_module(model, AlignDevicesHook(execution_device=target, io_same_device=True))
        else:
            main = target.index if target.type == "cuda" else target.type
            dispatch_model(model, device_map, main_device=main, force_hooks=True)
    return pipe

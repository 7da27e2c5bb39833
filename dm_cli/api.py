"""dmap's Python API: `dm_cli.plan`, `dm_cli.load`, `dm_cli.dispatch` (the names in `dm_cli.__all__`).

- `plan(source, max_memory=..., height=..., ...)` -> `Plan`: what `dmap plan` prints and writes.
- `load(source, plan)` -> `Pipeline`: keeps components placed per the plan (resident) or loads them
  per stage (staged); `Pipeline.generate(prompts, ...)` yields `Generated` (PIL images and their
  metadata), stage-major in staged mode (each stage's components loaded once per chunk of prompts),
  and can be called again without reloading resident components.
- `dispatch(pipe, plan)`: places an existing diffusers pipeline's components per the plan, for
  users who call `pipe(...)` themselves.

`dmap run` is a thin layer over the same `Pipeline`: `--prompts` goes through `load` and
`generate` (`dm_cli.queue_runner`), `--prompt` through `Pipeline.run_job` with every stage
measured (`dm_cli.runner`), so the CLI and a script get the same images for the same seeds.
Everything else in dm_cli may change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .errors import UsageError
from .queue import QueueItem, chunk_size_for, chunks, default_output_name
from .run_checks import check_seed

# What embeddings and latents waiting between stages may take by default: this share of the RAM
# available when the queue starts (the components themselves need the rest).
DEFAULT_CHUNK_MEMORY_SHARE = 0.10


@dataclass
class Generated:
    """One prompt's result: PIL images (one unless num_images > 1), the PNG metadata dmap writes."""

    index: int
    prompt: str
    seed: int
    images: list
    metadata: dict[str, str]
    seconds: float  # this item's encode + denoise + decode (component loading is shared, not counted)
    latents: object = field(default=None, repr=False)

    @property
    def image(self):
        return self.images[0]


# --- plan ---------------------------------------------------------------------------------------


def plan(source: str | None = None, *, max_memory: str | None = None, height: int | None = None,
         width: int | None = None, batch_size: int = 1, num_images: int = 1, guidance_scale: float | None = None,
         max_sequence_length: int | None = None, strategy: str = "auto", mode: str = "auto", dtype: str | None = None,
         overhead: str | None = None, component: str | None = None, check: bool = True, use_cache: bool = True,
         num_frames: int | None = None, fps: int | None = None, weights: str | None = None,
         on_progress: Callable[[str], None] | None = None):
    """Plan where every component and block of SOURCE goes (None: the bundled random-weight demo).

    `max_memory` is a device spec ("0=16GB,1=16GB,cpu=64GB"; None: this machine). `height`/`width`
    None: the pipeline's default size (the one `dmap run` uses); 0 plans weights only. Raises
    `DoesNotFitError` (with the nearest change that fits) when nothing fits. `on_progress(message)`
    hears each step as it starts (resolving, sizing and tracing each component, the split check).
    """
    from .demo import source_root
    from .inputs import InputSpec
    from .plans import PlanOptions, make_named_plan
    from .units import parse_dtype

    spec, root, defaults = source_root(source)
    pick = lambda given, key: defaults.get(key) if given is None else given  # noqa: E731 - the demo's defaults
    inputs = InputSpec(pick(height, "height"), pick(width, "width"), batch_size, num_images,
                       pick(guidance_scale, "guidance_scale"), pick(max_sequence_length, "max_sequence_length"),
                       num_frames=num_frames, fps=fps)
    options = PlanOptions(max_memory, strategy, mode, inputs, parse_dtype(dtype) if dtype is not None else None,
                          overhead, component, check, use_cache, weights, on_progress=on_progress)
    return make_named_plan(root, spec, options)


# --- load ---------------------------------------------------------------------------------------


def load(source: str | None = None, plan=None, *, simulate: bool = False, max_memory: str | None = None,
         mode: str = "auto", strategy: str = "auto", dtype: str | None = None, overhead: str | None = None,
         height: int | None = None, width: int | None = None, guidance_scale: float | None = None,
         max_sequence_length: int | None = None, true_cfg_scale: float | None = None, weights: str | None = None,
         num_frames: int | None = None, fps: int | None = None, on_plan: Callable | None = None, on_status: Callable[[str | None], None] | None = None) -> "Pipeline":
    """A pipeline placed per `plan` (a Plan, a plan JSON path, or None: plan here with the options).

    SOURCE None is the bundled random-weight demo. A plan made for another model, size or dtype is
    refused (UsageError); one naming GPUs this machine lacks too, unless `simulate` (every planned
    device on the CPU, with the split check active). `weights` ("fp8", "transformer=fp8", ...) plans
    low-precision storage, or must match the given plan's. Nothing is loaded yet: resident components
    load on the first `generate` and stay; staged ones load per stage and chunk.
    """
    from .runner import RunRequest

    device_map = plan if isinstance(plan, (str, Path)) else strategy
    request = RunRequest(source=source, prompt="", device_map=str(device_map), max_memory=max_memory, mode=mode,
                         dtype=dtype, overhead=overhead, height=height, width=width, guidance_scale=guidance_scale,
                         max_sequence_length=max_sequence_length, true_cfg_scale=true_cfg_scale, weights=weights,
                         num_frames=num_frames, fps=fps, simulate=simulate, output=None)
    return Pipeline(request, None if isinstance(plan, (str, Path)) else plan, on_plan, on_status)


class Pipeline:
    """A SOURCE with its plan, ready to generate; components load per the plan's mode.

    `defaults` is the settled generation (steps, guidance, size, sequence length) each prompt
    starts from. Use as a context manager, or call `close()`, to free resident components.
    """

    def __init__(self, request, plan=None, on_plan: Callable | None = None,
                 on_status: Callable[[str | None], None] | None = None, measure: bool = False):
        import os

        # before the libraries' first import: some of them warn while importing (torchvision fallbacks)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        from .inputs import InputSpec, check_counts
        from .plans import load_plan
        from .units import parse_dtype

        # the counts and dtype before SOURCE is resolved: the rule dmap plan and dmap run apply (inputs.LIMITS)
        check_counts(steps=request.steps, num_images=request.num_images, height=request.height,
                     width=request.width, max_sequence_length=request.max_sequence_length,
                     num_frames=request.num_frames, fps=request.fps)
        if request.dtype is not None:
            parse_dtype(request.dtype)
        from .planner import STRATEGIES
        from .run_checks import device_map_refusal
        from .runner import (
            TRACKED_STEPS,
            check_component_files,
            check_devices_present,
            check_plan_matches,
            check_tiled_decode,
            inputs_from_plan,
            make_run_plan,
            plan_digest,
            prepare,
            quiet_libraries,
            settle_job,
        )
        from .stages import StageLoop

        status = on_status or (lambda message: None)
        is_file = plan is None and (request.device_map.endswith(".json") or Path(request.device_map).is_file())
        if plan is None and not is_file and request.device_map not in STRATEGIES:
            raise UsageError(device_map_refusal(request.device_map))
        source, family, demo, defaults, notices = prepare(request, status)
        self.source, self.family, self.demo, self.notices = source, family, demo, notices
        if is_file:
            plan = load_plan(request.device_map)
        if plan is not None and not request.simulate:  # before anything is shown or torch is imported
            check_devices_present(plan)
        if plan is not None:  # a plan's inputs are the defaults: dmap plan X -o p.json && dmap run X -d p.json
            defaults = {**defaults, **inputs_from_plan(plan)}
        # Settle the inputs first: the plan is made for (and checked against) them.
        self.defaults = job = settle_job(request, source, family, defaults)
        inputs = InputSpec(height=job.height, width=job.width, batch_size=1, num_images=job.num_images,
                           guidance_scale=job.guidance_scale, max_sequence_length=job.max_sequence_length,
                           num_frames=job.num_frames)
        self.fps = (request.fps or family.default_fps) if job.num_frames else None  # video families
        if plan is not None:
            check_plan_matches(plan, source, inputs, request.dtype, request.device_map if is_file else "The plan",
                               request.weights)
        # missing or corrupt weights are bad input: say so before importing the libraries or planning
        largest = {c.name: check_component_files(c) for c in source.components}
        status("Importing torch, diffusers and transformers…")
        quiet_libraries()
        if plan is not None:
            check_tiled_decode(plan, source, request.device_map if is_file else "The plan")
        self.planned_here = plan is None
        if plan is None:
            status(f"Planning {source.spec} (meta-device traces are cached after the first run)…")
            plan = make_run_plan(source, request, inputs)
        status(None)
        self.plan = plan
        if not request.simulate:
            check_devices_present(plan)  # a plan made here: before it is shown
        if on_plan is not None:
            on_plan(plan)
        if not request.simulate:
            from .weight_formats import int8_offload_problem

            for name, fmt in plan.weights.items():  # before anything loads, not when that component's stage comes
                problem = int8_offload_problem(name, fmt, plan.components[name].device_map)
                if problem:
                    raise UsageError(problem)
        self.simulate = request.simulate
        self.plan_digest = plan_digest(plan)
        self.staged = plan.mode != "resident"
        # measure=False: no activation tracker (Python work on every op) nor RSS sampling; `dmap run --prompt`
        # measures each stage, a queue only wants its images
        self._loop = StageLoop(source, plan, family, simulate=request.simulate, tracked_steps=TRACKED_STEPS,
                               largest_shard=largest, track_activations=request.simulate or request.track_activations,
                               on_status=on_status, measure=measure)
        # per stage of the plan, over every generate(): how often its components were loaded, and the time
        # spent loading and running them (what a queue saves by loading once per chunk)
        self.stage_totals: dict[str, dict] = {s.name: {"loads": 0, "load_s": 0.0, "run_s": 0.0} for s in plan.stages}
        if not self.staged:
            self.stage_totals["load"] = {"loads": 0, "load_s": 0.0, "run_s": 0.0}

    # --- what a queue needs to know before it starts -------------------------------------------

    def job_for(self, item: QueueItem):
        """The settled generation of one queue item (its own seed, steps, guidance, negative prompt)."""
        from .inputs import check_count

        job = self.defaults
        if item.steps is not None:  # a queue line's steps get --steps' bound
            check_count("steps", item.steps, f"Item {item.index}: 'steps'")
        negative = item.negative_prompt or job.negative_prompt  # the item's, else the run's (--negative-prompt)
        refusal = self.family.refuse(negative, job.true_cfg_scale)
        if refusal:
            raise UsageError(f"Item {item.index}: {refusal}")
        return replace(job, prompt=item.prompt, negative_prompt=negative, seed=item.seed,
                        steps=item.steps or job.steps,
                        guidance_scale=job.guidance_scale if item.guidance_scale is None else item.guidance_scale)

    def metadata(self, job) -> dict[str, str]:
        from .runner import job_metadata

        return job_metadata(job, self.source.spec, self.source.pipeline_class, self.plan_digest, self.demo, self.fps,
                            self.plan.tiled_decode)

    def bytes_per_item(self) -> int:
        """Embeddings and latents one prompt holds between stages: what the pipeline feeds the denoiser per step."""
        from .inputs import InputSpec
        from .pipelines import TensorSpec, call_spec
        from .units import DTYPE_BYTES, numel

        job = self.defaults
        denoiser = next((c for c in self.source.components if c.name == self.family.denoiser), None)
        inputs = InputSpec(job.height, job.width, 1, job.num_images, job.guidance_scale, job.max_sequence_length)
        spec = call_spec(denoiser, self.source.pipeline_class, inputs) if denoiser is not None else None
        item_size = {"float": DTYPE_BYTES.get(self.plan.dtype or "float32", 4), "float32": 4}
        total = 0
        stack = list(spec.kwargs.values()) if spec is not None else []
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, TensorSpec) and value.kind in item_size:
                total += numel(value.shape) * item_size[value.kind]
        return total

    def chunk_size(self, items: int, chunk_memory: int | None = None) -> tuple[int, int, int]:
        """(chunk size, bytes per item, budget): as many items as the RAM budget holds between stages."""
        from .plans import available_ram

        budget = chunk_memory if chunk_memory is not None else int(available_ram() * DEFAULT_CHUNK_MEMORY_SHARE)
        per_item = self.bytes_per_item()
        if not self.staged:
            return max(1, items), per_item, budget  # resident: one item at a time, nothing waits between stages
        return chunk_size_for(budget, per_item, items), per_item, budget

    # --- generating ----------------------------------------------------------------------------

    def generate(self, prompts: str | Iterable, *, seed: int = 0, negative_prompt: str | None = None,
                 steps: int | None = None, guidance_scale: float | None = None, chunk_size: int | None = None,
                 chunk_memory: int | None = None, on_step: Callable[[int, int], None] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None) -> Iterator[Generated]:
        """Images for each prompt, in order: prompt i gets seed `seed + i` (QueueItems carry their own).

        Staged plans run stage-major: each chunk of prompts is encoded with the text encoders loaded
        once, denoised with the denoiser loaded once, decoded with the VAE loaded once; each image is
        yielded as soon as it is decoded. Same pixels as one prompt at a time with the same seeds.
        """
        items = _items(prompts, seed, negative_prompt, steps, guidance_scale)
        jobs = [(item, self.job_for(item)) for item in items]
        if not jobs:
            return
        if chunk_size is None:
            chunk_size = self.chunk_size(len(jobs), chunk_memory)[0]
        if chunk_size < 1:
            raise UsageError("The chunk size must be at least 1.")
        from .runner import frozen_gc

        with frozen_gc():  # as dmap run: collections walk only what the run makes (see runner.run)
            parts = chunks(jobs, chunk_size) if self.staged else [[pair] for pair in jobs]  # resident: loaded once
            for number, part in enumerate(parts):
                if on_chunk is not None and self.staged:
                    on_chunk(number, len(parts))
                results: list = []
                try:
                    for n, carry, seconds in self._loop.run_jobs([job for _, job in part], on_step, results):
                        item, job = part[n]
                        yield self._generated(item, job, carry, seconds)
                finally:
                    for result in results:  # per stage: how often it loaded, and the time loading and running
                        totals = self.stage_totals[result.name]
                        totals["loads"] += bool(result.load_s)
                        totals["load_s"] += result.load_s
                        totals["run_s"] += result.run_s

    def _generated(self, item: QueueItem, job, carry, seconds: float) -> Generated:
        if carry.latents is None or not carry.images:
            raise UsageError("The plan has no denoise or decode stage: nothing was generated.")
        return Generated(item.index, item.prompt, item.seed, list(carry.images), self.metadata(job), seconds,
                         carry.latents)

    def run_job(self, job, on_step=None):
        """One job through every stage, loading per the plan's mode: (Carry, StageResults) for `dmap run`."""
        return self._loop.run_job(job, on_step)

    @property
    def split_check(self) -> bool:
        return self._loop.split_check

    @property
    def split_problems(self) -> list[str]:
        return self._loop.split_problems

    def close(self) -> None:
        """Free whatever is loaded (resident components)."""
        self._loop.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _items(prompts, seed: int, negative_prompt, steps, guidance_scale) -> list[QueueItem]:
    from .inputs import check_count

    if steps is not None:  # generate(steps=...) gets --steps' bound before anything runs
        check_count("steps", steps, "steps")
    if isinstance(prompts, str):
        prompts = [prompts]
    items = []
    for index, entry in enumerate(prompts):
        if isinstance(entry, QueueItem):
            items.append(entry)
        elif isinstance(entry, str):
            items.append(QueueItem(index, entry, check_seed(seed + index, f"Prompt {index}: the seed"),
                                   default_output_name(index), negative_prompt, steps, guidance_scale))
        else:
            raise UsageError(f"Prompt {index} is a {type(entry).__name__}: give strings (or dm_cli.queue.QueueItem).")
    return items


# --- dispatch -----------------------------------------------------------------------------------


def dispatch(pipe, plan):
    """Place an existing diffusers pipeline's components per `plan` (a Plan or a plan JSON path).

    A component on one device is moved there (with an accelerate hook that brings its inputs
    along); a split one is dispatched block by block with accelerate's `dispatch_model`. Its
    weights are already in host memory, so "disk" blocks stay there like "cpu" ones (streamed to
    their GPU when they run); nothing is written. A component the plan decodes in tiles gets its
    `enable_tiling()` called (UsageError for a class without it). Returns `pipe`.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from .devices import normalise_map
    from .loading import execution_device
    from .plans import load_plan
    from .runner import check_devices_present
    from .trace import model_tiles

    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    for name, placement in plan.components.items():
        model = getattr(pipe, name, None)
        if model is None or not hasattr(model, "named_parameters"):
            raise UsageError(f"The plan places '{name}' but this pipeline has no such model component.")
        if placement.cls not in ("?", "", None) and type(model).__name__ != placement.cls:
            raise UsageError(f"The plan places '{name}' as {placement.cls} but this pipeline's is "
                             f"{type(model).__name__}: it is a plan for another model.")
    check_devices_present(plan)
    for name in plan.tiled_decode:
        if not model_tiles(getattr(pipe, name)):
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

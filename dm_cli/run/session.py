"""A SOURCE loaded per its plan, ready to generate: the session the one-prompt run, the queue, torchrun
ranks and `dm_cli.load` share.

`Session` settles the request (SOURCE, defaults, plan) once, keeps resident components loaded, and
runs the stage loop (`dm_cli.run.stages`) for each prompt or chunk of prompts.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from dm_cli.errors import UsageError
from dm_cli.run.checks import check_seed
from dm_cli.run.queue import QueueItem, chunk_size_for, chunks, default_output_name

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.request import RunRequest

# What embeddings and latents waiting between stages may take by default: this share of the RAM
# available when the queue starts (the components themselves need the rest).
DEFAULT_CHUNK_MEMORY_SHARE = 0.10



@contextlib.contextmanager
def frozen_gc():
    """Freeze what is alive out of the collector (see `run`), unfrozen at the end; yields whether this
    call froze (False when a caller had frozen first: it unfreezes)."""
    owner = gc.get_freeze_count() == 0
    if owner:
        gc.freeze()
    try:
        yield owner
    finally:
        if owner:
            gc.unfreeze()


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


class Session:
    """A SOURCE with its plan, ready to generate; components load per the plan's mode.

    `defaults` is the settled generation (steps, guidance, size, sequence length) each prompt
    starts from. Use as a context manager, or call `close()`, to free resident components.
    """

    def __init__(self, request: RunRequest, plan: Plan | None = None, on_plan: Callable | None = None,
                 on_status: Callable[[str | None], None] | None = None, measure: bool = False):
        import os

        # before the libraries' first import: some of them warn while importing (torchvision fallbacks)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        from dm_cli.model.models import quiet_libraries
        from dm_cli.run.request import TRACKED_STEPS, check_component_files, check_tiled_decode, plan_digest
        from dm_cli.run.stages import StageLoop

        status = on_status or (lambda message: None)
        plan, where = self._settle(request, plan, status)
        from dm_cli.run.parallel import step_sharing

        # torchrun ranks sharing each step (--parallel, or the plan file's `parallel`): None for one process per image;
        # refused (one sentence) before anything is imported or planned
        self.sharing = step_sharing(request.parallel, plan, self)
        self.is_main = self.sharing is None or self.sharing.is_main  # rank 0 decodes and gets the images
        # missing or corrupt weights are bad input: say so before importing the libraries or planning
        largest = {c.name: check_component_files(c) for c in self.source.components}
        if any(c.single_file is not None for c in self.source.components):  # their sha256 goes into the metadata
            from dm_cli.model.single_file_weights import component_files_metadata

            status("Hashing the single files (sha256, for the outputs' metadata)…")
            component_files_metadata(self.source)
        status("Importing torch, diffusers and transformers…")
        quiet_libraries()
        if plan is not None:
            check_tiled_decode(plan, self.source, where)
        self.planned_here = plan is None
        self.plan = plan = self._checked_plan(plan, request, status, on_plan)
        self.simulate = request.simulate
        self.plan_digest = plan_digest(plan)
        self.staged = plan.mode != "resident"
        # measure=False: no activation tracker (Python work on every op) nor RSS sampling; `dmap run --prompt`
        # measures each stage, a queue only wants its images
        from dm_cli.run.parallel import ParallelStageLoop, checked_pipeline
        from dm_cli.run.pipeline import PipelineStageLoop

        self.pipelined = self.sharing is not None and self.sharing.layout == "pipeline"
        if self.pipelined and self.planned_here:  # the plan made here must cut the denoiser into the ranks' slices
            checked_pipeline(plan, self, self.sharing.ranks)
        loop, shared = (StageLoop, {}) if self.sharing is None else (
            (PipelineStageLoop, {"sharing": self.sharing, "notices": self.notices}) if self.pipelined
            else (ParallelStageLoop, {"sharing": self.sharing}))
        self._loop = loop(self.source, plan, self.family, simulate=request.simulate, tracked_steps=TRACKED_STEPS,
                          largest_shard=largest, track_activations=request.simulate or request.track_activations,
                          on_status=on_status, measure=measure, loras=self.generation.loras, **shared)
        # per stage of the plan, over every generate(): how often its components were loaded, and the time
        # spent loading and running them (what a queue saves by loading once per chunk)
        self.stage_totals: dict[str, dict] = {s.name: {"loads": 0, "load_s": 0.0, "run_s": 0.0} for s in plan.stages}
        if not self.staged:
            self.stage_totals["load"] = {"loads": 0, "load_s": 0.0, "run_s": 0.0}

    def _settle(self, request: RunRequest, plan: Plan | None, status) -> tuple[Plan | None, str]:
        """Resolve SOURCE, read the plan file, settle and check the generation against both, before torch is
        imported: (the plan or None, what to call it in messages)."""
        from dm_cli.families import Job
        from dm_cli.planning.plan_file import load_plan
        from dm_cli.run.checks import device_map_refusal
        from dm_cli.run.parallel import cpu_ranks
        from dm_cli.run.request import (
            check_devices_present,
            check_plan_matches,
            inputs_from_plan,
            prepare,
            refuse_existing_outputs,
            settle_generation,
            source_of_plan,
        )
        from dm_cli.units import parse_dtype

        if request.placement.dtype is not None:
            parse_dtype(request.placement.dtype)
        plan_file = request.plan_file if plan is None else None
        if plan_file is not None and not (plan_file.endswith(".json") or Path(plan_file).is_file()):
            raise UsageError(device_map_refusal(plan_file))
        # `dmap run -d PLAN.json` without SOURCE: the plan's source (None still means the demo without a plan); the
        # plan file is read once, before SOURCE only when SOURCE comes from it (else SOURCE's problems come first)
        self.source_from_plan = request.source is None and (plan is not None or plan_file is not None)
        if self.source_from_plan:
            plan = plan if plan_file is None else load_plan(plan_file)
            request = replace(request, source=source_of_plan(plan, plan_file))
        source, family, demo, defaults, notices = prepare(request, status)
        self.source, self.family, self.demo, self.notices = source, family, demo, notices
        if plan_file is not None and plan is None:
            plan = load_plan(plan_file)
        if plan is not None and not request.simulate:  # before anything is shown or torch is imported
            check_devices_present(plan, cpu_ranks(request.parallel, plan))
        if plan is not None:  # a plan's inputs are the defaults: dmap plan X -o p.json && dmap run X -d p.json
            defaults = {**defaults, **inputs_from_plan(plan)}
        # Settle the generation first: the plan is made for (and checked against) it.
        self.generation = settle_generation(request.generation, source, family, defaults, request.per_prompt_images)
        if self.generation.loras:  # each LoRA with the component it patches, as the planner settles them
            from dm_cli.planning.lora_sizing import lora_targets

            self.generation = replace(self.generation, loras=lora_targets(source, self.generation.loras))
        refuse_existing_outputs(request, family, self.generation.num_images)
        self.defaults = Job.of(self.generation, request.prompt, request.seed)
        self.fps = self.generation.fps if self.generation.num_frames else None  # video families
        where = plan_file or "The plan"
        if plan is not None:
            check_plan_matches(plan, source, self._inputs(), request.placement, where, self.generation.loras,
                               plan_file=plan_file, source_from_plan=self.source_from_plan)
            from dm_cli.run.request import check_plan_cache

            plan = check_plan_cache(plan, request.generation.cache, where, off=request.cache_off)
            self.generation = replace(self.generation, cache=plan.cache)
        return plan, where

    def _inputs(self):
        """The settled generation as the planner sees it (dmap run makes batch 1)."""
        from dataclasses import replace as replaced

        return replaced(self.generation.inputs(), batch_size=1, fps=None)

    def _checked_plan(self, plan: Plan | None, request: RunRequest, status, on_plan) -> Plan:
        """The given plan, or one made here; its devices and int8 placements checked before anything loads."""
        from dm_cli.run.parallel import cpu_ranks
        from dm_cli.run.request import check_devices_present, make_run_plan

        if plan is None:
            status(f"Planning {self.source.spec} (meta-device traces are cached after the first run)…")
            plan = make_run_plan(self.source, request, self.generation, self.family)
        status(None)
        if not request.simulate:
            check_devices_present(plan, cpu_ranks(request.parallel, plan))  # a plan made here: before it is shown
        if on_plan is not None:
            on_plan(plan)
        if not request.simulate:
            from dm_cli.model.formats.weight_formats import int8_offload_problem

            for name, fmt in plan.weights.items():  # before anything loads, not when that component's stage comes
                problem = int8_offload_problem(name, fmt, plan.components[name].device_map)
                if problem:
                    raise UsageError(problem)
        return plan

    # --- what a queue needs to know before it starts -------------------------------------------

    def job_for(self, item: QueueItem, settings: dict | None = None):
        """The settled job of one queue item: the run's generation with the item's own seed, steps, guidance,
        negative prompt and settings (`settings`: a generate() call's, under the item's), checked as
        `dmap plan` and `dmap run` check theirs."""
        from dm_cli.families import Job
        from dm_cli.inputs import check_count

        job = self.defaults
        if item.steps is not None:  # a queue line's steps get --steps' bound
            check_count("steps", item.steps, f"Item {item.index}: 'steps'")
        loras = self.generation.loras if item.loras is None else self.chosen_loras(item.loras, f"Item {item.index}")
        if item.cache is not None and item.cache != self.generation.cache:
            run = self.generation.cache.label if self.generation.cache is not None else "none"
            raise UsageError(f"Item {item.index} asks for --cache {item.cache.label}, this run uses {run}: the plan counts "
                             "one step cache's state per run; give such items a queue of their own, with its --cache.")
        generation = replace(self.generation, negative_prompt=item.negative_prompt or job.negative_prompt,
                             steps=item.steps or job.steps, images=item.images or self.generation.images,
                             last_image=item.last_image or self.generation.last_image,
                             guidance_scale=job.guidance_scale if item.guidance_scale is None else item.guidance_scale,
                             loras=loras)
        generation = generation.with_settings({**(settings or {}), **dict(item.settings)})
        try:
            self._validate(generation)
        except UsageError as error:
            raise UsageError(f"Item {item.index}: {error}") from None
        return Job.of(generation, item.prompt, item.seed)

    def chosen_loras(self, choices: tuple, where: str) -> tuple:
        """The adapters a queue item or a served request chooses (dm_cli.inputs.LoraChoice) among those loaded at start
        (dm_cli.model.lora.chosen_loras), which the stage loop switches to before its denoise (peft's set_adapters).
        Refused, one sentence: another choice than the loaded set where the plan fused it into the weights."""
        from dm_cli.model.lora import chosen_loras
        from dm_cli.run.stages import fused_loras

        chosen = chosen_loras(self.generation.loras, choices, where)
        fused = sorted(fused_loras(self.plan))
        if fused and [lora.key() for lora in chosen] != [lora.key() for lora in self.generation.loras]:
            raise UsageError(f"{where} chooses the LoRA(s) {', '.join(c.label for c in choices) or 'none'}, but the "
                             f"plan fused this run's LoRAs into the weights of {', '.join(fused)} at load, and fused "
                             "adapters cannot be switched per image: give a plan made without them fused (dmap plans "
                             "a server's, and a queue's whose items choose, unfused), or leave 'lora' out.")
        return chosen

    def _validate(self, generation) -> None:
        """`Family.validate` with this SOURCE's configs, as `dmap plan` and the run's own generation get it."""
        comps = {c.name: c for c in self.source.components}
        vae = comps.get("vae")
        self.family.validate(generation, self.source.pipeline_class, (comps[self.family.denoiser].config or {}),
                             vae.config if vae is not None else None, tuple(comps))

    def step_cache_counts(self) -> dict:
        """--cache: {"label": NAME:K=V,..., "counts": {denoiser: {"calls", "computed", "skipped"}}} over every denoise so
        far (dm_cli.run.step_cache), what a run's and a queue's summaries say; {} without a cache."""
        if self.plan.cache is None:
            return {}
        return {"label": self.plan.cache.label,
                "counts": {name: counts.to_json() for name, counts in self._loop.step_counts.items()}}

    def metadata(self, job) -> dict[str, str]:
        from dm_cli.model.single_file_weights import component_files_metadata
        from dm_cli.run.outputs import job_metadata
        from dm_cli.run.stages import fused_loras

        meta = job_metadata(job, self.source.spec, self.source.pipeline_class, self.plan_digest, self.demo, self.fps,
                            self.plan.tiled_decode, job.loras, fused_loras(self.plan), self.plan.cache)
        files = component_files_metadata(self.source)  # single files (SOURCE's, --component-file's) by their sha256
        if files:
            meta["component_files"] = files
        return meta

    def bytes_per_item(self) -> int:
        """Embeddings and latents one prompt holds between stages: what the pipeline feeds the denoiser per step."""
        from dm_cli.families import call_spec
        from dm_cli.families.calls import TensorSpec
        from dm_cli.inputs import InputSpec
        from dm_cli.units import DTYPE_BYTES, numel

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
        from dm_cli.planning.budgets import available_ram

        budget = chunk_memory if chunk_memory is not None else int(available_ram() * DEFAULT_CHUNK_MEMORY_SHARE)
        per_item = self.bytes_per_item()
        if not self.staged:
            return max(1, items), per_item, budget  # resident: one item at a time, nothing waits between stages
        return chunk_size_for(budget, per_item, items), per_item, budget

    # --- generating ----------------------------------------------------------------------------

    def generate(self, prompts: str | Iterable, *, seed: int = 0, negative_prompt: str | None = None,
                 steps: int | None = None, guidance_scale: float | None = None, image=None, last_image=None,
                 chunk_size: int | None = None,
                 chunk_memory: int | None = None, on_step: Callable[[int, int], None] | None = None,
                 on_chunk: Callable[[int, int], None] | None = None, **settings) -> Iterator[Generated]:
        """Images for each prompt, in order: prompt i gets seed `seed + i` (QueueItems carry their own).

        `settings`: the family's own (`dm_cli.families.Setting`: true_cfg_scale=..., guidance_scale_2=...),
        over the ones `load` was given; a QueueItem's own settings win over them. `image`: input images for every
        prompt (a path, a PIL image, or a list of them, in order; None: the ones `load` was given); `last_image`: the
        last frame of every video (Wan 2.2 image-to-video; None: the one `load` was given).

        Staged plans run stage-major: each chunk of prompts is encoded with the text encoders loaded
        once, denoised with the denoiser loaded once, decoded with the VAE loaded once; each image is
        yielded as soon as it is decoded. Same pixels as one prompt at a time with the same seeds.
        """
        items = _items(prompts, seed, negative_prompt, steps, guidance_scale, image, last_image)
        jobs = [(item, self.job_for(item, settings)) for item in items]
        if not jobs:
            return
        if chunk_size is None:
            chunk_size = self.chunk_size(len(jobs), chunk_memory)[0]
        if chunk_size < 1:
            raise UsageError("The chunk size must be at least 1.")
        with frozen_gc():  # as dmap run: collections walk only what the run makes (see dm_cli.run.single.run)
            # resident: loaded once, one prompt at a time, unless a pipeline keeps several in flight
            parts = chunks(jobs, chunk_size) if self.staged or self.pipelined else [[pair] for pair in jobs]
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
        if carry.latents is None or (not carry.images and self.is_main):  # other ranks of a shared step decode nothing
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

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _items(prompts, seed: int, negative_prompt, steps, guidance_scale, image=None, last_image=None) -> list[QueueItem]:
    from dm_cli.inputs import check_count, check_text
    from dm_cli.run.request import input_images, last_input_image

    images = input_images(image, "image")  # read once, before anything runs
    last = last_input_image(last_image, "last_image")

    if steps is not None:  # generate(steps=...) gets --steps' bound before anything runs
        check_count("steps", steps, "steps")
    if isinstance(prompts, str):
        prompts = [prompts]
    items = []
    for index, entry in enumerate(prompts):
        if isinstance(entry, QueueItem):
            items.append(entry)
        elif isinstance(entry, str):
            check_text(entry, f"Prompt {index}")
            items.append(QueueItem(index, entry, check_seed(seed + index, f"Prompt {index}: the seed"),
                                   default_output_name(index), negative_prompt, steps, guidance_scale,
                                   images=images, last_image=last))
        else:
            raise UsageError(f"Prompt {index} is a {type(entry).__name__}: give strings (or dm_cli.run.queue.QueueItem).")
    return items

"""A SOURCE loaded per its plan, ready to generate: the session the one-prompt run, the queue, torchrun
ranks and `dm_cli.load` share.

`Session` takes a run settled once (`dm_cli.run.settle.settle.settle`: SOURCE, defaults, plan, every check), keeps
resident components loaded, and runs the stage loop (`dm_cli.run.loops.stages`) for each prompt or chunk of prompts.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from dm_cli.errors import UsageError
from dm_cli.families import Job, call_spec
from dm_cli.families.calls import TensorSpec
from dm_cli.inputs import Generation, check_count, check_text, read_through
from dm_cli.model.lora import chosen_loras
from dm_cli.model.single_file_weights import component_files_metadata
from dm_cli.planning.modes import CompileMode
from dm_cli.planning.placement import budgets  # the module: tests patch its available_ram
from dm_cli.run import request as run_request  # the module: tests patch its TRACKED_STEPS
from dm_cli.run.entry_checks import check_seed
from dm_cli.run.hooks.compile import CompileHook
from dm_cli.run.loops.stages import StageLoop, fused_loras
from dm_cli.run.ranks.parallel import ParallelStageLoop
from dm_cli.run.ranks.pipeline import PipelineStageLoop
from dm_cli.run.request import input_images, last_input_image, run_inputs
from dm_cli.run.sessions.outputs import job_metadata
from dm_cli.run.sessions.queue import QueueItem, chunk_size_for, chunks, default_output_name
from dm_cli.run.settle.settle import Loop
from dm_cli.units import DTYPE_BYTES, numel

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
    from dm_cli.run.settle.settle import SettledRun

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


# the class of each stage loop settle chooses (SettledRun.loop): one process, ranks sharing each step, or the
# denoiser cut among the ranks
STAGE_LOOPS = {Loop.RESIDENT: StageLoop, Loop.STAGED: StageLoop, Loop.CFG: ParallelStageLoop,
               Loop.CONTEXT: ParallelStageLoop, Loop.CFG_CONTEXT: ParallelStageLoop, Loop.PIPELINE: PipelineStageLoop}


class Session:
    """A settled run (`dm_cli.run.settle.settle.SettledRun`) ready to generate; components load per the plan's mode.

    `defaults` is the settled generation (steps, guidance, size, sequence length) each prompt
    starts from. Use as a context manager, or call `close()`, to free resident components.
    """

    def __init__(self, settled: SettledRun, on_status: Callable[[str | None], None] | None = None,
                 measure: bool = False):
        """The stage loop `settled` chose (dm_cli.run.settle.settle decided and checked everything); nothing is loaded
        yet. measure=False: no activation tracker (Python work on every op) nor RSS sampling; `dmap run --prompt`
        measures each stage, a queue only wants its images."""
        request = settled.request
        self.settled = settled  # kept whole: what it decided is read from it (the properties below), never copied
        self.notices = list(settled.notices)  # the loop adds what it learns as it runs (a pipeline's notices)
        loop = STAGE_LOOPS[settled.loop]
        shared = {} if loop is StageLoop else {"sharing": self.sharing}
        if loop is PipelineStageLoop:
            shared["notices"] = self.notices
        self._loop = loop(self.source, self.plan, self.family, simulate=request.simulate,
                          tracked_steps=run_request.TRACKED_STEPS, largest_shard=settled.largest_shard,
                          track_activations=request.simulate or request.track_activations, on_status=on_status,
                          measure=measure, loras=self.generation.loras, **shared)
        if settled.compile is not CompileMode.NONE:  # --compile: the denoiser compiled as it loads, after every hook
            self._loop.hooks.register_hook(CompileHook(settled.compile, self.family), "compile")
        # per stage of the plan, over every generate(): how often its components were loaded, and the time
        # spent loading and running them (what a queue saves by loading once per chunk)
        self.stage_totals: dict[str, dict] = {s.name: {"loads": 0, "load_s": 0.0, "run_s": 0.0}
                                              for s in self.plan.stages}
        if not self.staged:
            self.stage_totals["load"] = {"loads": 0, "load_s": 0.0, "run_s": 0.0}

    # --- what the settled run decided (dm_cli.run.settle.settle.SettledRun), read from it ---------------------

    source = read_through("settled", "source")
    family = read_through("settled", "family")
    demo = read_through("settled", "demo")
    generation = read_through("settled", "generation")  # the settled generation: every default filled in
    defaults = read_through("settled", "defaults")  # the job each prompt starts from
    fps = read_through("settled", "fps")
    plan = read_through("settled", "plan")
    plan_digest = read_through("settled", "plan_digest")
    planned_here = read_through("settled", "planned_here")
    source_from_plan = read_through("settled", "source_from_plan")
    sharing = read_through("settled", "sharing")
    is_main = read_through("settled", "is_main")
    staged = read_through("settled", "staged")
    pipelined = read_through("settled", "pipelined")

    @property
    def simulate(self) -> bool:
        return self.settled.request.simulate

    # --- what a queue needs to know before it starts -------------------------------------------

    def job_for(self, item: QueueItem, settings: dict | None = None):
        """The settled job of one queue item: the settings its line gives over the run's generation
        (`Generation.given_over`; `settings`: a generate() call's, under the item's), checked as `dmap plan` and
        `dmap run` check theirs."""
        if item.cache is not None and item.cache != self.generation.cache:
            run = self.generation.cache.label if self.generation.cache is not None else "none"
            raise UsageError(f"Item {item.index} asks for --cache {item.cache.label}, this run uses {run}: the plan counts "
                             "one step cache's state per run; give such items a queue of their own, with its --cache.")
        generation = self.generation.with_settings(settings or {})
        generation = item.given.given_over(generation)
        if item.loras is not None:
            generation = replace(generation, loras=self.chosen_loras(item.loras, f"Item {item.index}"))
        try:
            self._validate(generation)
        except UsageError as error:
            raise UsageError(f"Item {item.index}: {error}") from None
        return Job.of(generation, item.prompt, item.seed)

    def chosen_loras(self, choices: tuple, where: str) -> tuple:
        """The adapters a queue item or a served request chooses (dm_cli.inputs.LoraChoice) among those loaded at start
        (dm_cli.model.lora.chosen_loras), which the stage loop switches to before its denoise (peft's set_adapters).
        Refused, one sentence: another choice than the loaded set where the plan fused it into the weights."""
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
        far (dm_cli.run.hooks.step_cache), what a run's and a queue's summaries say; {} without a cache."""
        if self.plan.cache is None:
            return {}
        return {"label": self.plan.cache.label,
                "counts": {name: counts.to_json() for name, counts in self._loop.step_counts.items()}}

    def metadata(self, job) -> dict[str, str]:
        meta = job_metadata(job, self.source.spec, self.source.pipeline_class, self.plan_digest, self.demo, self.fps,
                            self.plan.tiled_decode, job.loras, fused_loras(self.plan), self.plan.cache)
        files = component_files_metadata(self.source)  # single files (SOURCE's, --component-file's) by their sha256
        if files:
            meta["component_files"] = files
        return meta

    def bytes_per_item(self) -> int:
        """Embeddings and latents one prompt holds between stages: what the pipeline feeds the denoiser per step."""
        job = self.defaults
        denoiser = next((c for c in self.source.components if c.name == self.family.denoiser), None)
        spec = call_spec(denoiser, self.source.pipeline_class, run_inputs(job.generation)) if denoiser is not None else None
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
        budget = chunk_memory if chunk_memory is not None else int(budgets.available_ram() * DEFAULT_CHUNK_MEMORY_SHARE)
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
        with frozen_gc():  # as dmap run: collections walk only what the run makes (see dm_cli.run.sessions.single.run)
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
    images = input_images(image, "image")  # read once, before anything runs
    last = last_input_image(last_image, "last_image")

    if steps is not None:  # generate(steps=...) gets --steps' bound before anything runs
        check_count("steps", steps, "steps")
    given = Generation(negative_prompt=negative_prompt or None, steps=steps, guidance_scale=guidance_scale, images=images,
                       last_image=last)
    if isinstance(prompts, str):
        prompts = [prompts]
    items = []
    for index, entry in enumerate(prompts):
        if isinstance(entry, QueueItem):
            items.append(entry)
        elif isinstance(entry, str):
            check_text(entry, f"Prompt {index}")
            items.append(QueueItem(index, entry, check_seed(seed + index, f"Prompt {index}: the seed"),
                                   default_output_name(index), given))
        else:
            raise UsageError(f"Prompt {index} is a {type(entry).__name__}: give strings (or dm_cli.run.sessions.queue.QueueItem).")
    return items

"""The stage loop: load a stage's components to their planned devices, run it, free them.

One family-agnostic piece for every run mode, by composition: the loop holds the state (the pipeline, the plan, the
components loaded, the meter, the hooks) and the loading, and owns three collaborators, each given the loop and the
one below it, calling only downward: `batches` (dm_cli.run.loops.batch_loop: a chunk of jobs stage-major, `run_jobs`;
`dmap run`'s `run_job` is the chunk of one) -> `jobs` (dm_cli.run.loops.job_loop: one stage of one job measured,
`run_stage`; experts taking turns, `run_experts`) -> `runners` (dm_cli.run.loops.stage_kinds: what each stage kind runs).
The ranks sharing a job give the loop their runners (rank 0 encodes and decodes: dm_cli.run.loops.main_rank). Which runner runs a stage is its kind,
what it produces (`dm_cli.families.stages`: the plan records what each stage consumes and produces), never its
name; what a runner does is the family's (dm_cli.run.loops.stage_kinds); which components it loads and where is the
plan's. What the loop puts on each component it loads (tiled decode, LoRAs, step cache, meter, split check) is a
hook registered by name (dm_cli.run.hooks.hooks, dm_cli.run.hooks.component_hooks).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from dm_cli.families import Family
from dm_cli.families.stages import DENOISE
from dm_cli.planning.modes import Mode
from dm_cli.run.hooks.component_hooks import fused_loras, standard_hooks
from dm_cli.run.load.loading import build_pipeline, execution_device, free_components, load_component, placeholder
from dm_cli.run.load.meter import MemoryMeter, RssSampler
from dm_cli.run.loops.batch_loop import BatchRunner
from dm_cli.run.loops.carry import Carry, StageResult
from dm_cli.run.loops.job_loop import JobRunner
from dm_cli.run.loops.stage_kinds import RUNNERS, StageRunners, nonfinite_refusal

# what other modules import from here, wherever it now lives
__all__ = ["RUNNERS", "Carry", "StageLoop", "StageResult", "StageRunners", "fused_loras",
           "nonfinite_refusal"]


class StageLoop:
    """A pipeline (tokenizers, scheduler, meta placeholders) plus the components loaded right now.

    `simulate`: every planned device is the CPU, with the tracer's split check active during each
    forward of a split component (`split_problems`). `tracked_steps`: the activation tracker
    (MemoryMeter, Python work on every op) stops after this many denoising steps; None: all.
    """

    def __init__(self, source, plan, family: Family, *, simulate: bool, tracked_steps: int | None,
                 largest_shard: dict[str, int] | None = None, track_activations: bool = False,
                 on_status: Callable[[str | None], None] | None = None, measure: bool = True, loras: tuple = ()):
        import torch  # lazy: torch (heavy, off start-up)

        self.source = source
        self.plan = plan
        self.family = family
        self.simulate = simulate
        self.tracked_steps = tracked_steps
        self.largest_shard = largest_shard or {}
        self.components = {c.name: c for c in source.components}
        self.torch_dtype = getattr(torch, plan.dtype) if plan.dtype else None
        self.placeholders: dict[str, object] = {}  # built when first needed (`placeholder`)
        self._pipe = None  # built when first needed (`pipe`): a resident plan's with its real components
        self.meter = MemoryMeter()
        self.loaded: dict[str, object] = {}
        self.cuda = not simulate and torch.cuda.is_available()
        # Per-op tracking (MemoryMeter) is what splits a CPU's memory between virtual devices, so
        # --simulate needs it; a plain CPU run measures the process's peak RSS instead, which costs
        # nothing per op (the tracker makes a tracked step ~3x slower).
        self.track_activations = track_activations
        self.status = on_status or (lambda message: None)
        # False: no tracker, no RSS sampling at all (a queue wants its images, not per-stage peaks)
        self.measure = measure
        self.loras = tuple(loras)  # LoRA adapters (settled): loaded into their component each time it loads
        # what is put on each component as it loads, by name (dm_cli.run.hooks.component_hooks); a run mode's loop
        # registers its own versions after this
        self.hooks = standard_hooks(self)
        # what runs the jobs, each collaborator calling only the one below it: batches -> jobs -> runners
        self.runners = self.stage_runners()
        self.jobs = JobRunner(self, self.runners)
        self.batches = BatchRunner(self, self.jobs)

    def stage_runners(self) -> StageRunners:
        """What each stage kind runs for this loop (the loops of ranks sharing a job give their own)."""
        return StageRunners(self)

    # --- running: the collaborators' entry points, as the session and the tests call them ----------------

    def run_job(self, job, on_step=None) -> tuple[Carry, list[StageResult]]:
        """All the plan's stages for one job (`dmap run`), the chunk of one (`run_jobs`): (its Carry, what each load
        and stage measured)."""
        results: list[StageResult] = []
        carry = Carry()
        for _, carry, _ in self.run_jobs([job], on_step, results):
            pass
        return carry, results

    def run_jobs(self, jobs: list, on_step=None, results: list[StageResult] | None = None):
        """Every stage of the plan over a chunk of jobs, stage-major: BatchRunner.run_jobs."""
        return self.batches.run_jobs(jobs, on_step, results)

    def run_stage(self, stage_plan, job, carry: Carry, on_step=None, result: StageResult | None = None) -> StageResult:
        """One planned stage of one job, its components loaded: dm_cli.run.loops.job_loop.JobRunner.run_stage."""
        return self.jobs.run_stage(stage_plan, job, carry, on_step, result)

    # --- the run mode's choices the batch runner asks for -------------------------------------------------

    def stage_groups(self) -> list[list]:
        """The plan's stages as they run: consecutive denoise sub-stages (the same name) of a staged plan
        (experts loaded one at a time, `run_experts`) form one group, every other stage a group of its own."""
        staged = self.plan.mode != Mode.RESIDENT
        groups: list[list] = []
        for stage in self.plan.stages:
            if staged and groups and stage.kind == DENOISE and groups[-1][0].kind == DENOISE \
                    and stage.name == groups[-1][0].name:
                groups[-1].append(stage)
            else:
                groups.append([stage])
        return groups

    def runs_together(self, stage_plan) -> bool:
        """Whether the jobs of a chunk run this stage together (`run_stage_together`) rather than one by one."""
        return False

    def run_stage_together(self, stage_plan, jobs: list, carries: list[Carry], on_step, stage: StageResult) -> None:
        raise NotImplementedError  # a loop whose runs_together says yes (dm_cli.run.ranks.pipeline) has its own

    @property
    def step_counts(self) -> dict:
        """--cache: component -> StepCounts over every denoise of this loop (dm_cli.run.hooks.step_cache)."""
        return self.hooks["step_cache"].counts

    @property
    def split_check(self) -> bool:
        """Whether the tracer's split check ran during the run (--simulate, in a build that has the tracer)."""
        check = self.hooks.get_hook("split_check")
        return check is not None and check.ran

    @property
    def split_problems(self) -> list[str]:
        check = self.hooks.get_hook("split_check")
        return check.problems if check is not None else []

    # --- loading ---------------------------------------------------------------------------------

    @property
    def pipe(self):
        """The pipeline object (tokenizers, scheduler, every model): the loaded components, a meta placeholder
        for each of the others. Built on first use, so that a resident plan, which loads everything first,
        never builds placeholders it would replace at once (a UNet's meta build is ~0.1 s)."""
        if self._pipe is None:
            models = {name: self.loaded[name] if name in self.loaded else self.placeholder(name)
                      for name in self.plan.components}
            self._pipe = build_pipeline(self.source, self.torch_dtype, models)
        return self._pipe

    def placeholder(self, name: str):
        """Component `name` on the meta device, for the pipeline object while it is not loaded."""
        if name not in self.placeholders:
            self.placeholders[name] = placeholder(self.components[name], self.torch_dtype,
                                                  self.family.placeholder_tensors.get(name, ()))
        return self.placeholders[name]

    def device_map(self, name: str) -> dict:
        return self.plan.components[name].device_map

    def _device(self, names: list[str]):
        """Where the first of `names` computes (the CPU under --simulate)."""
        return execution_device(self.device_map(names[0]) if names else {"": "cpu"}, self.simulate)

    def overlaps(self, name: str) -> bool:
        """Whether the plan overlaps component `name`'s offload (planning/time/overlap.py; run/load/prefetch.py runs it)."""
        return self.plan.components[name].offload.get("mode") == "overlapped"

    def load_stage(self, names: list[str], stage: StageResult | None = None) -> None:
        """Load `names` straight to their planned devices, put the registered hooks on each (`self.hooks`), and
        put them into the pipeline."""
        with RssSampler() if self.measure else contextlib.nullcontext() as rss:
            for name in names:
                if name in self.loaded:
                    continue
                cmap = self.device_map(name)
                where = ", ".join(sorted({str(d) for d in cmap.values()}))
                self.status(f"Loading {name} ({where})…")
                model = load_component(self.components[name], cmap, self.plan.dtype, self.simulate,
                                       self.plan.weights.get(name), self.overlaps(name))
                self.hooks.apply(name, model)
                self.loaded[name] = model
                if self._pipe is not None:
                    setattr(self._pipe, name, model)
        self.status(None)
        if stage is not None and rss is not None:
            stage.load_rss_delta = rss.peak - rss.start
            stage.largest_shard = max([self.largest_shard.get(n, 0) for n in names] + [stage.largest_shard])

    def unload_stage(self, names: list[str], last: bool = False) -> None:
        """Hooks off, placeholders back (`last`: the pipeline object goes instead), memory returned to the
        devices."""
        models = []
        for name in names:
            if name not in self.loaded:
                continue
            self.hooks.remove(name)
            if not last:
                setattr(self.pipe, name, self.placeholder(name))
            models.append(self.loaded.pop(name))
        if last:
            self._pipe = None  # rebuilt, with placeholders, if the loop runs again
        free_components(models)
        del models

    def close(self) -> None:
        self.meter.stop()  # an interrupted stage may have left the tracker on
        if self.loaded:
            self.unload_stage(list(self.loaded), last=True)

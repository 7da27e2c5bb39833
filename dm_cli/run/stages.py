"""The stage loop: load a stage's components to their planned devices, run it, free them.

One family-agnostic piece for every run mode, made of one file per loop: `dmap run` runs one Job through all the
plan's stages (`StageLoop.run_job`, dm_cli.run.job_loop); a queue runner can hold a stage loaded and run a chunk of
jobs through it (`run_jobs`, dm_cli.run.batch_loop; or `load_stage`, `run_stage` per job, `unload_stage`); the
ranks sharing a job run rank 0's encode and decode (dm_cli.run.main_rank). Which runner runs a stage is its kind,
what it produces (`dm_cli.families.stages`: the plan records what each stage consumes and produces), never its
name; what a runner does is the family's (dm_cli.run.stage_kinds); which components it loads and where is the
plan's. What the loop puts on each component it loads (tiled decode, LoRAs, step cache, meter, split check) is a
hook registered by name (dm_cli.run.hooks, dm_cli.run.component_hooks).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from dm_cli.families import Family
from dm_cli.run.batch_loop import BatchLoop
from dm_cli.run.carry import Carry, StageResult
from dm_cli.run.component_hooks import fused_loras, standard_hooks
from dm_cli.run.job_loop import JobLoop
from dm_cli.run.loading import build_pipeline, free_components, load_component, placeholder
from dm_cli.run.main_rank import MainRankStages
from dm_cli.run.meter import MemoryMeter, RssSampler
from dm_cli.run.stage_kinds import RUNNERS, StageRunners, nonfinite_refusal

# what other modules import from here, wherever it now lives
__all__ = ["RUNNERS", "Carry", "MainRankStages", "StageLoop", "StageResult", "fused_loras", "nonfinite_refusal"]


class StageLoop(JobLoop, BatchLoop, StageRunners):
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
        self._tracking_from = 0  # denoising step at which the activation tracker last started
        # Per-op tracking (MemoryMeter) is what splits a CPU's memory between virtual devices, so
        # --simulate needs it; a plain CPU run measures the process's peak RSS instead, which costs
        # nothing per op (the tracker makes a tracked step ~3x slower).
        self.track_activations = track_activations
        self.status = on_status or (lambda message: None)
        # False: no tracker, no RSS sampling at all (a queue wants its images, not per-stage peaks)
        self.measure = measure
        self.loras = tuple(loras)  # LoRA adapters (settled): loaded into their component each time it loads
        # what is put on each component as it loads, by name (dm_cli.run.component_hooks); a run mode's loop
        # registers its own versions after this
        self.hooks = standard_hooks(self)

    @property
    def step_counts(self) -> dict:
        """--cache: component -> StepCounts over every denoise of this loop (dm_cli.run.step_cache)."""
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

    def overlaps(self, name: str) -> bool:
        """Whether the plan overlaps component `name`'s offload (planning/overlap.py; run/prefetch.py runs it)."""
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

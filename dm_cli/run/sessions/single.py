"""One prompt through every stage, each stage measured: `dmap run --prompt` (and `dm_cli.run.sessions.single.run`)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from dm_cli.errors import UsageError
from dm_cli.families import Job, all_settings
from dm_cli.inputs import read_through
from dm_cli.io.outputs import save_images, save_latents, save_videos, written_together
from dm_cli.run.loops.carry import RESULT_JSON_VERSION, stages_json
from dm_cli.run.loops.stages import StageResult
from dm_cli.run.request import RunRequest, output_path
from dm_cli.run.sessions.outputs import claim_run_outputs
from dm_cli.run.sessions.session import Session, frozen_gc
from dm_cli.run.settle import settle as settling  # the module: tests patch its settle
from dm_cli.run.settle.settle import Entry

if TYPE_CHECKING:  # annotations only: the plan module costs start-up time
    from dm_cli.planning.plan_file import Plan


@dataclass
class RunResult:
    """What one prompt's run made and measured. What it generated is the job it ran (its prompt, seed and settled
    `Generation`), held whole and read through the properties below; `to_json` writes `dmap run --json`'s document
    (docs/CONTRACTS.md) from them, key for key."""

    source: str
    pipeline_class: str
    demo: bool
    plan: Plan
    plan_digest: str
    planned_here: bool
    simulate: bool
    job: Job  # the prompt, seed and settled generation this run made
    images: list[str]  # written files (a video and its JSON sidecar for video families)
    latents_path: str | None
    stages: list[StageResult]
    split_problems: list[str] = field(default_factory=list)
    split_check: bool = False  # True when the tracer's VirtualDevices check ran during the run
    notices: list[str] = field(default_factory=list)
    images_data: list = field(default_factory=list, repr=False)  # PIL images, or uint8 frame arrays (not in JSON)
    latents: object = field(default=None, repr=False)
    # --cache: {"label": NAME:K=V,..., "counts": {denoiser: {"calls", "computed", "skipped"}}} (dm_cli.run.hooks.step_cache)
    step_cache: dict = field(default_factory=dict)

    seed = read_through("job", "seed")
    steps = read_through("job", "steps")
    guidance_scale = read_through("job", "guidance_scale")
    height = read_through("job", "height")
    width = read_through("job", "width")
    num_images = read_through("job", "num_images")
    num_frames = read_through("job", "num_frames")  # video families

    @property
    def fps(self) -> int | None:
        return self.job.generation.video_fps

    @property
    def settings(self) -> dict:
        """The family's own settings (Family.settings), settled."""
        return dict(self.job.settings)

    def device_peaks(self) -> dict[str, tuple[int, int]]:
        """device -> (measured peak over all stages, planned peak over all stages)."""
        out: dict[str, list[int]] = {}
        for stage in self.stages:
            for dev in set(stage.measured_peak) | set(stage.planned_peak):
                entry = out.setdefault(dev, [0, 0])
                entry[0] = max(entry[0], stage.measured_peak.get(dev, 0))
                entry[1] = max(entry[1], stage.planned_peak.get(dev, 0))
        return {dev: (m, p) for dev, (m, p) in out.items()}

    def to_json(self) -> dict:
        return {
            "version": RESULT_JSON_VERSION, "source": self.source, "pipeline": self.pipeline_class, "demo_random_weights": self.demo,
            "plan_digest": self.plan_digest, "planned_here": self.planned_here, "mode": self.plan.mode,
            "simulate": self.simulate, "seed": self.seed, "steps": self.steps, "guidance_scale": self.guidance_scale,
            **{name: self.settings.get(name) for name in all_settings()}, "height": self.height, "width": self.width,
            "num_images": self.num_images, "images": self.images, "num_frames": self.num_frames, "fps": self.fps,
            "latents": self.latents_path,
            "stages": stages_json(self.stages),
            "devices": {d: {"measured_peak_bytes": m, "planned_peak_bytes": p} for d, (m, p) in self.device_peaks().items()},
            "split_check": self.split_check, "split_problems": self.split_problems, "notices": self.notices,
            **({"step_cache": self.step_cache} if self.step_cache else {}),
        }


# --- the run -------------------------------------------------------------------------------


def run(request: RunRequest, on_plan: Callable[[object], None] | None = None,
        on_step: Callable[[int, int, str | None], None] | None = None,
        on_status: Callable[[str | None], None] | None = None, plan: Plan | None = None) -> RunResult:
    """Plan (or read and check a plan), then encode -> denoise -> decode following it. `plan`: the plan to follow
    (with `request.plan_file`, that file as already read: `dm_cli.run.settle.settle.settle`).

    `on_step(done, total, component)`: after each denoising step; `component` names the denoiser that
    ran it for families with experts (Wan 2.2), else None.

    With torch, diffusers and transformers imported, a full garbage collection walks ~400k objects
    (~0.2 s on a laptop core), and allocations trigger them anywhere: an import, a load, a step.
    Everything alive before the stages (libraries, placeholders, tokenizers, the plan) is frozen out
    of the collector for the run, so collections only look at what the run makes, and what the
    stages free is still collected. Unfrozen at the end (unless the caller had frozen first).
    """
    with claim_run_outputs(request), frozen_gc() as owner:  # a second run writing the same output stops
        return _run(request, plan, on_plan, on_step, on_status, owner)


def _run(request: RunRequest, plan: Plan | None, on_plan, on_step, on_status, freeze: bool) -> RunResult:
    """One prompt through the session (`dm_cli.run.sessions.session.Session`), every stage measured."""
    pipeline = Session(settling.settle(request, plan, entry=Entry.SINGLE, on_plan=on_plan, on_status=on_status),
                       on_status=on_status, measure=True)
    job = pipeline.defaults
    result = RunResult(
        source=pipeline.source.spec, pipeline_class=pipeline.source.pipeline_class, demo=pipeline.demo,
        plan=pipeline.plan, plan_digest=pipeline.plan_digest, planned_here=pipeline.planned_here,
        simulate=request.simulate, job=job, images=[], latents_path=None, stages=[], notices=pipeline.notices,
    )
    if freeze:  # what the stages free is collected without walking the libraries (see run())
        gc.freeze()
    try:
        carry, result.stages = pipeline.run_job(job, on_step)
    finally:
        pipeline.close()
    result.split_check, result.split_problems = pipeline.split_check, pipeline.split_problems
    result.step_cache = pipeline.step_cache_counts()
    if carry.latents is None or (not carry.images and pipeline.is_main):  # a shared step's other ranks decode nothing
        raise UsageError("The plan has no denoise or decode stage: nothing was generated.")
    if not pipeline.is_main:  # rank 0 writes the outputs (dm_cli.run.ranks.parallel)
        return result
    result.images_data = carry.images
    result.latents = carry.latents.detach().to("cpu")
    metadata = pipeline.metadata(job)
    with written_together():  # the latents and the images, or none of them: the same command runs again
        if request.save_latents:
            result.latents_path = save_latents(result.latents, request.save_latents, metadata)
        if request.output and job.num_frames:
            result.images = save_videos(carry.images, output_path(request, pipeline.family), result.fps, metadata,
                                        request.overwrite)
        elif request.output:
            result.images = save_images(carry.images, request.output, metadata)
    return result

"""The loop of a chunk of jobs (a queue's chunk: dm_cli.run.sessions.queue_runner; a server's batch), stage-major: a staged
plan loads each stage's components once and runs the stage for every job of the chunk before it frees them, a
resident one loads what is missing first and keeps it. `dmap run --prompt` is the chunk of one job
(dm_cli.run.loops.job_loop). A collaborator the stage loop owns (`StageLoop.batches`, dm_cli.run.loops.stages), given the loop
(its state, its loading and its mode's choices: `stage_groups`, `runs_together`; a pipeline's ranks run a chunk's
denoise together, dm_cli.run.ranks.pipeline) and the job runner it calls."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from dm_cli.families import Job
from dm_cli.families.stages import DENOISE, ENCODE_IMAGE
from dm_cli.planning.modes import Mode
from dm_cli.run.loops.carry import Carry, StageResult, stage_result
from dm_cli.run.loops.job_loop import JobRunner


class BatchRunner:
    """Every stage of the plan over a chunk of jobs."""

    def __init__(self, loop, jobs: JobRunner):
        self.loop = loop
        self.jobs = jobs

    def run_jobs(self, jobs: list[Job], on_step: Callable[..., None] | None = None,
                 results: list[StageResult] | None = None) -> Iterator[tuple[int, Carry, float]]:
        """Every stage of the plan over `jobs`, stage-major: a staged plan loads each stage's components once,
        runs the stage for every job, then frees them; a resident one loads what is missing first and keeps it.
        Experts taking turns (`run_experts`) load within each job's denoise. Yields (index, carry, seconds of
        its stages) as each job finishes its last stage; `results` collects a StageResult per load and stage
        (a stage's run_s sums its jobs, its measured peak is the largest)."""
        results = [] if results is None else results
        staged = self.loop.plan.mode != Mode.RESIDENT
        carries = [Carry() for _ in jobs]
        seconds = [0.0] * len(jobs)
        missing = [name for name in self.loop.plan.components if name not in self.loop.loaded]
        if not staged and missing:
            first = StageResult("load", sorted(missing))
            start = time.perf_counter()
            first.resident_before = self.loop.meter.resident()
            self.loop.load_stage(missing, first)
            first.load_s = first.wall_s = time.perf_counter() - start
            first.resident_after_load = self.loop.meter.resident()
            results.append(first)
        groups = self.loop.stage_groups()
        for position, group in enumerate(groups):
            last = position == len(groups) - 1
            if len(group) > 1:
                for n, job in enumerate(jobs):
                    start = time.perf_counter()
                    results += self.jobs.run_experts(group, job, carries[n], on_step)
                    seconds[n] += time.perf_counter() - start
                    if last:
                        yield n, carries[n], seconds[n]
                continue
            yield from self._run_group(group[0], jobs, carries, seconds, on_step, results, last)

    def _run_group(self, stage_plan, jobs: list[Job], carries: list, seconds: list[float], on_step,
                   results: list[StageResult], last: bool) -> Iterator[tuple[int, Carry, float]]:
        """One stage over every job of the chunk (loaded once, freed after when staged); yields as `run_jobs`."""
        staged = self.loop.plan.mode != Mode.RESIDENT
        stage = stage_result(stage_plan)
        start = time.perf_counter()
        stage.resident_before = self.loop.meter.resident()
        # the image-encode stage of a family that takes input images has nothing to encode when no job brings
        # one (LTX-2 text-to-video, Kontext from text): it runs (Family.encode_image says so) without its components
        needed = stage_plan.kind != ENCODE_IMAGE or not self.loop.family.max_input_images or any(j.images for j in jobs)
        if staged and needed:
            self.loop.load_stage(stage.components, stage)
            stage.load_s = time.perf_counter() - start
        stage.resident_after_load = self.loop.meter.resident()
        run_s, peak = 0.0, {}
        together = not last and self.loop.runs_together(stage_plan)  # a pipeline's ranks: every job in flight at once
        try:
            if together:
                self.loop.run_stage_together(stage_plan, jobs, carries, on_step, stage)
                for n in range(len(jobs)):
                    seconds[n] += stage.run_s / len(jobs)
                run_s, peak = stage.run_s, dict(stage.measured_peak)
            for n, job in enumerate(() if together else jobs):
                self.jobs.run_stage(stage_plan, job, carries[n], on_step if stage_plan.kind == DENOISE else None, stage)
                seconds[n] += stage.run_s
                run_s += stage.run_s
                peak = {d: max(peak.get(d, 0), stage.measured_peak.get(d, 0)) for d in {*peak, *stage.measured_peak}}
                if last:
                    carry, carries[n] = carries[n], None  # nothing of a yielded job stays here
                    yield n, carry, seconds[n]
        finally:
            if staged and needed:
                self.loop.unload_stage(stage.components)
        stage.run_s, stage.measured_peak = run_s, peak
        stage.wall_s = time.perf_counter() - start
        results.append(stage)

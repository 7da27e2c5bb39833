"""The loop of one job (`dmap run --prompt`: dm_cli.run.sessions.single), staged or resident: `run_job` runs every stage of
the plan for it, `run_stage` one stage with its peaks measured, `run_experts` one denoise whose experts take turns
(Wan 2.2: only the expert of the running step loaded). A collaborator the stage loop owns (`StageLoop.jobs`,
dm_cli.run.loops.stages): it is given the loop (its state and loading) and the stage runners it calls; the batch runner
(dm_cli.run.loops.batch_loop) calls it, never the other way round."""

from __future__ import annotations

import contextlib
import time

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import Job
from dm_cli.families.stages import DENOISE
from dm_cli.run.load.meter import RssSampler
from dm_cli.run.loops.carry import Carry, StageResult, consumed_image, stage_result
from dm_cli.run.loops.stage_kinds import StageRunners, out_of_memory
from dm_cli.units import format_size


class JobRunner:
    """One job through a stage, each stage measured (its load, its run, its peak per device)."""

    def __init__(self, loop, runners: StageRunners):
        self.loop = loop  # its state (plan, meter, hooks) and its loading (load_stage, unload_stage)
        self.runners = runners

    def run_stage(self, stage_plan, job: Job, carry: Carry, on_step=None, result: StageResult | None = None) -> StageResult:
        """Run one planned stage of `job` (its components must be loaded) with the runner of its kind,
        measuring its peaks."""
        import torch  # lazy: torch (heavy, off start-up)

        name = stage_plan.name
        names = list(stage_plan.components)
        runner = self.runners.runner(stage_plan)
        missing = [value for value in stage_plan.consumes if not carry.has(value)]
        if missing:
            makers = [s.name for s in self.loop.plan.stages if missing[0] in s.produces]
            before = makers[0] if makers else f"any stage that makes its {missing[0]}"
            raise UsageError(f"The plan runs {name} before {before}: the stages are out of order.")
        stage = result or StageResult(name, names, planned_peak={str(k): int(v) for k, v in stage_plan.peak_bytes.items()})
        meter, metering = self.loop.meter, self.loop.hooks["meter"]
        metering.reset_peaks()
        start = time.perf_counter()
        meter.current[:] = [str(next(iter(self.loop.device_map(names[0]).values())))] if names else ["cpu"]
        track, sampled = metering.mode(names)
        stage.tracked = "all" if track else ("process peak RSS" if sampled else "none (CUDA: max_memory_allocated)"
                                             if self.loop.measure else "not measured")
        rss = RssSampler() if sampled else None
        compiling = self.loop.hooks.get_hook("compile")  # --compile: its seconds counted apart from the steps'
        compiled_before = compiling.seconds() if compiling is not None else 0.0
        try:
            with torch.inference_mode(False), torch.no_grad(), (rss or contextlib.nullcontext()):
                if track:
                    meter.start()
                runner(stage_plan, job, carry, on_step)
                if track and stage_plan.kind == DENOISE and self.loop.tracked_steps is not None \
                        and job.steps > self.loop.tracked_steps:
                    stage.tracked = f"first {self.loop.tracked_steps} of {job.steps} steps"
                meter.stop()
            self.loop.status(None)
        except torch.OutOfMemoryError as error:
            raise out_of_memory(error, name, stage.planned_peak) from None
        except MemoryError:
            raise DoesNotFitError(
                f"Out of host memory during {name} (planned cpu peak {format_size(stage.planned_peak.get('cpu', 0))}): "
                "lower cpu= in --max-memory to what is really free and plan again."
            ) from None
        stage.run_s = time.perf_counter() - start
        if compiling is not None:
            stage.compile_s = compiling.seconds() - compiled_before
        metering.measured(stage, rss)
        return stage

    def run_experts(self, parts: list, job: Job, carry: Carry, on_step) -> list[StageResult]:
        """One denoise call over consecutive sub-stages (Wan 2.2's experts): only the sub-stage whose
        expert runs the first step is loaded; at the step where the next expert takes over, the current
        one is freed and only then the next one loaded (an expert that never runs is never loaded)."""
        import torch  # lazy: torch (heavy, off start-up)

        owner = {name: i for i, part in enumerate(parts) for name in part.components}
        running = self.runners.step_components(job) or [self.loop.family.denoiser] * job.steps
        order = [owner[name] for name in running]
        results = [stage_result(part) for part in parts]
        state = {"part": order[0], "start": time.perf_counter()}
        metering = self.loop.hooks["meter"]

        def load(part: int) -> None:
            stage = results[part]
            start = time.perf_counter()
            stage.resident_before = self.loop.meter.resident()
            self.loop.load_stage(stage.components, stage)
            stage.load_s = time.perf_counter() - start
            stage.resident_after_load = self.loop.meter.resident()
            self.loop.meter.current[:] = [str(next(iter(self.loop.device_map(stage.components[0]).values())))]
            metering.reset_peaks()
            rss = RssSampler().__enter__() if sampled else None  # after the load: it resets the high-water mark
            state.update(part=part, start=start, run=time.perf_counter(), rss=rss)

        def finish(part: int) -> None:
            stage = results[part]
            stage.run_s = time.perf_counter() - state["run"]
            if state["rss"] is not None:
                state["rss"].__exit__(None, None, None)
            metering.measured(stage, state["rss"])
            self.loop.unload_stage(stage.components)
            stage.wall_s = time.perf_counter() - state["start"]

        track, sampled = metering.mode([c for part in parts for c in part.components])

        def switch(step: int) -> None:
            if step + 1 < len(order) and order[step + 1] != state["part"]:
                self.loop.meter.stop()  # loading is not an activation
                finish(state["part"])
                load(order[step + 1])
                self.runners.tracking_from = step + 1  # the new expert's first steps are tracked again
                if track:
                    self.loop.meter.start()

        load(order[0])
        try:
            with torch.inference_mode(False), torch.no_grad():
                if track:
                    self.loop.meter.start()
                carry.latents = self.runners.denoise(results[order[0]].components, job, carry.embeds, on_step, switch,
                                             consumed_image(parts[0], carry))
                carry.embeds = carry.image_latents = None
                self.loop.meter.stop()
        except torch.OutOfMemoryError as error:
            raise out_of_memory(error, parts[0].name, results[state["part"]].planned_peak) from None
        finish(state["part"])
        how = "tracked" if track else ("process peak RSS" if sampled else "CUDA: max_memory_allocated"
                                                                     if self.loop.measure else "not measured")
        for part, stage in enumerate(results):
            used = order.count(part)
            stage.tracked = f"{how}, {used} of {job.steps} steps" if used else "not run (its expert has no step)"
        return results

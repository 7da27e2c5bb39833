"""The stage loop: load a stage's components to their planned devices, run it, free them.

One family-agnostic piece for every run mode. `dmap run` runs one Job through all the plan's
stages (`StageLoop.run_job`); a queue runner can hold a stage loaded and run many jobs through it
(`load_stage`, `run_stage` per job, `unload_stage`). Which runner runs a stage is its kind, what it
produces (`dm_cli.families.stages`: the plan records what each stage consumes and produces), never its
name; what a runner does is the family's (`Family.encode`, `Family.encode_image`, the pipeline's own
`__call__` from embeddings with `output_type="latent"`, `Family.decode`); which components it loads and
where is the plan's.
"""

from __future__ import annotations

import contextlib
import inspect as pyinspect
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import Embeds, Family, Job
from dm_cli.families.stages import (
    AUDIO_LATENTS,
    DECODE,
    DECODE_AUDIO,
    DENOISE,
    ENCODE,
    ENCODE_IMAGE,
    IMAGE_LATENTS,
    INPUTS,
    KIND_OF,
)
from dm_cli.run.loading import build_pipeline, execution_device, free_components, load_component, placeholder
from dm_cli.run.meter import MemoryMeter, RssSampler
from dm_cli.units import format_size


@dataclass
class StageResult:
    name: str
    components: list[str]
    load_s: float = 0.0
    run_s: float = 0.0
    wall_s: float = 0.0
    resident_before: dict[str, int] = field(default_factory=dict)  # tracked weight bytes per device before loading
    resident_after_load: dict[str, int] = field(default_factory=dict)
    measured_peak: dict[str, int] = field(default_factory=dict)
    planned_peak: dict[str, int] = field(default_factory=dict)
    load_rss_delta: int = 0  # peak host RSS during this stage's load minus RSS before it
    tracked: str = "all"  # which part of the run the activation tracker saw ("first of N steps" in denoise)
    largest_shard: int = 0  # largest safetensors file this stage read


@dataclass
class Carry:
    """What one job hands from stage to stage: one field per value a stage produces (dm_cli.families.stages)."""

    embeds: Embeds | None = None
    image_latents: object = None
    latents: object = None
    images: list = field(default_factory=list)
    audio_latents: object = None  # LTX-2: the denoised audio latents
    audio: object = None  # (one waveform per video, sample rate): joined to `images` once both are there

    def has(self, value: str) -> bool:
        """Whether `value` is there for a stage that consumes it (the job's inputs always are)."""
        if value in INPUTS:
            return True
        got = getattr(self, value, None)
        return got is not None and not (isinstance(got, list) and not got)


def fused_loras(plan) -> frozenset:
    """The components whose LoRAs the plan merges into their weights at load (a plan file without `fused`: none)."""
    return frozenset(entry["component"] for entry in getattr(plan, "loras", None) or [] if entry.get("fused"))


class StageLoop:
    """A pipeline (tokenizers, scheduler, meta placeholders) plus the components loaded right now.

    `simulate`: every planned device is the CPU, with the tracer's split check active during each
    forward of a split component (`split_problems`). `tracked_steps`: the activation tracker
    (MemoryMeter, Python work on every op) stops after this many denoising steps; None: all.
    """

    def __init__(self, source, plan, family: Family, *, simulate: bool, tracked_steps: int | None,
                 largest_shard: dict[str, int] | None = None, track_activations: bool = False,
                 on_status: Callable[[str | None], None] | None = None, measure: bool = True, loras: tuple = ()):
        import torch

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
        self._hooks: dict[str, list] = {}
        self.split_check = False
        self.split_problems: list[str] = []
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
        self.fused_loras = fused_loras(plan)  # components whose LoRAs the plan fuses into the weights at load
        # unfused components with adapters -> the LoRAs active in them now (set_adapters), and those the running job
        # chose (None: the run's own), applied to each such component as it loads and before each denoise
        self._active_loras: dict[str, tuple] = {}
        self._job_loras: tuple | None = None
        # --cache: diffusers' hooks on each cached denoiser while it is loaded (dm_cli.run.step_cache), their counts
        self.step_counters: dict[str, object] = {}
        self.step_counts: dict[str, object] = {}  # component -> StepCounts over every denoise of this loop

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

    def load_stage(self, names: list[str], stage: StageResult | None = None) -> None:
        """Load `names` straight to their planned devices and put them into the pipeline."""
        with RssSampler() if self.measure else contextlib.nullcontext() as rss:
            for name in names:
                if name in self.loaded:
                    continue
                cmap = self.device_map(name)
                where = ", ".join(sorted({str(d) for d in cmap.values()}))
                self.status(f"Loading {name} ({where})…")
                model = load_component(self.components[name], cmap, self.plan.dtype, self.simulate,
                                       self.plan.weights.get(name))
                if name in self.plan.tiled_decode:  # the plan needs it (checked: the class tiles, check_tiled_decode)
                    model.enable_tiling()
                patching = [lora for lora in self.loras if lora.component == name]
                if patching:  # before the meter counts the weights: the adapters sit beside the layers they patch
                    from dm_cli.run.adapters import load_loras

                    self.status(f"Loading {len(patching)} LoRA(s) into {name}…")
                    load_loras(self.pipe, name, model, patching, self.torch_dtype, fuse=name in self.fused_loras)
                    if name not in self.fused_loras:
                        self._active_loras[name] = tuple(patching)
                        self._switch_loras(name, model)
                self._apply_step_cache(name, model)
                default_dev = str(next(iter(cmap.values())))
                self.meter.register_weights(model, cmap, default_dev)
                self._hooks[name] = self.meter.attach(model, cmap, default_dev)
                if self.simulate:
                    self._hooks[name] += self._split_check(model, cmap, name)
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
            for handle in self._hooks.pop(name, []):
                handle.remove()
            counter = self.step_counters.pop(name, None)
            if counter is not None:
                counter.remove()
            if not last:
                setattr(self.pipe, name, self.placeholder(name))
            self._active_loras.pop(name, None)
            models.append(self.loaded.pop(name))
        if last:
            self._pipe = None  # rebuilt, with placeholders, if the loop runs again
        free_components(models)
        del models

    def _apply_step_cache(self, name: str, model, steps: int | None = None) -> None:
        """The plan's step cache on a cached denoiser as it loads (diffusers' enable_cache; magcache for `steps`)."""
        cache = self.plan.cache
        if cache is None or name not in self.plan.step_cache.get("components", {}):
            return
        from dm_cli.run.step_cache import StepCounts, apply

        counter = apply(model, cache, self.family, steps, self.plan.dtype)
        counter.counts = self.step_counts.setdefault(name, StepCounts())
        counter.steps = steps
        self.step_counters[name] = counter

    def _reset_step_caches(self, steps: int | None = None) -> None:
        """Each cached denoiser's hook state emptied (the next image starts from nothing; the memory goes back);
        with `steps`, magcache's config remade for that many steps where it was made for others."""
        for name, counter in list(self.step_counters.items()):
            if steps is not None and self.plan.cache.name == "magcache" and counter.steps != steps:
                counter.remove()
                counter.model.disable_cache()
                self._apply_step_cache(name, counter.model, steps)
            else:
                counter.reset()

    def use_loras(self, loras: tuple) -> None:
        """The adapters a job runs with (settled, in order: `Job.loras`), made the active ones of every loaded
        component that holds them unfused, and of each such component loaded later (Wan 2.2's second expert)."""
        self._job_loras = tuple(loras)
        for name in list(self._active_loras):
            self._switch_loras(name, self.loaded[name])

    def _switch_loras(self, name: str, model) -> None:
        """peft's `set_adapters` on component `name` for the running job's adapters, only where they differ from the
        active ones: the adapters dmap loaded from the same files, at the job's scales, in the job's order (each
        adapter's term is added in that order, as `dmap run --lora` with that set adds them); none: the base layers
        alone. An unchosen adapter is inactive, never computed."""
        if self._job_loras is None:
            return
        wanted = tuple(lora for lora in self._job_loras if lora.component == name)
        if wanted == self._active_loras[name]:
            return
        from dm_cli.run.adapters import ADAPTER_PREFIX

        patching = [lora for lora in self.loras if lora.component == name]
        index = {(lora.path, lora.digest): n for n, lora in enumerate(patching)}
        model.set_adapters([f"{ADAPTER_PREFIX}{index[lora.path, lora.digest]}" for lora in wanted],
                           [lora.scale for lora in wanted])
        self._active_loras[name] = wanted

    def close(self) -> None:
        self.meter.stop()  # an interrupted stage may have left the tracker on
        if self.loaded:
            self.unload_stage(list(self.loaded), last=True)

    def _split_check(self, model, device_map: dict, name: str) -> list:
        """The split check is active during each forward of the component (not the pipeline's glue around it)."""
        try:
            from dm_cli.planning.trace import VirtualDevices
        except ImportError:
            return []
        checker = VirtualDevices(model, device_map)
        self.split_check = True
        problems = self.split_problems

        def pre(_module, _args):
            checker.__enter__()

        def post(_module, _args, _out):
            checker.__exit__(None, None, None)
            for problem in checker.problems:
                entry = f"{name}: {problem}"
                if entry not in problems:
                    problems.append(entry)

        return [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    # --- running ---------------------------------------------------------------------------------

    def _measure_mode(self, names: list[str]) -> tuple[bool, bool]:
        """(track activations op by op, sample the process's peak RSS) for a stage running `names`:
        only where something runs on the CPU (CUDA counts its own peaks), and never when not measuring."""
        on_cpu = self.measure and (not self.cuda or any(self._device([c]).type == "cpu" for c in names))
        track = on_cpu and self.track_activations
        return track, on_cpu and not track

    def _device(self, names: list[str]):
        return execution_device(self.device_map(names[0]) if names else {"": "cpu"}, self.simulate)

    def encode(self, names: list[str], job: Job) -> Embeds:
        device = self._device(names)
        self.pipe._dmap_device = device
        return self.family.encode(self.pipe, job, device)

    def denoise(self, names: list[str], job: Job, embeds: Embeds, on_step: Callable[..., None] | None,
                switch: Callable[[int], None] | None = None, image_latents=None, whole: bool = False):
        """The pipeline's own __call__ from embeddings, to latents (diffusers' math stays diffusers').

        `switch(step)` runs at the end of every step (the expert switch of `run_experts`); the
        activation tracker stops `tracked_steps` steps after it last started (`_tracking_from`).
        `image_latents`: an encoded input image the denoising starts from (`Family.image_kwargs`).
        `whole`: every output of the call (LTX-2: video and audio latents), not just the first.
        """
        import torch

        if embeds is None:
            raise UsageError("The plan runs denoise before encode: the stages are out of order.")
        device = self._device(names)
        self.pipe._dmap_device = device
        kwargs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in embeds.tensors.items()}
        kwargs.update(self.family.call_kwargs(self.pipe, job))
        if image_latents is not None:  # the stage consumes an encoded input image: denoising starts from it
            kwargs.update(self.family.image_kwargs(self.pipe, job, image_latents.to(device)))
        # a family may denoise with another pipeline class over the same components (LTX-2's image-to-video)
        pipe = getattr(self.family, "denoising_pipeline", lambda pipe, job, image_latents: pipe)(
            self.pipe, job, image_latents)
        params = pyinspect.signature(type(pipe).__call__).parameters
        if "max_sequence_length" in params and job.max_sequence_length:
            kwargs["max_sequence_length"] = job.max_sequence_length
        # embeddings are already repeated per image (or video): one per prompt embedding
        kwargs["num_images_per_prompt" if "num_images_per_prompt" in params else "num_videos_per_prompt"] = 1
        meter, tracked = self.meter, self.tracked_steps
        self._tracking_from = 0
        running = self._step_components(job)

        def step_end(_pipe, step, _t, callback_kwargs):
            latents = callback_kwargs.get("latents")
            if latents is not None and not bool(torch.isfinite(latents).all()):
                raise UsageError(nonfinite_refusal(step + 1, job.steps, job.loras, self.torch_dtype))
            if tracked is not None and step + 1 - self._tracking_from == tracked:
                meter.stop()  # later steps repeat this one's graph on the same shapes: its peak is the stage's
            if on_step is not None:
                on_step(step + 1, job.steps, running[step] if running else None)
            if switch is not None:
                switch(step)
            return callback_kwargs

        self.use_loras(job.loras)
        self._reset_step_caches(job.steps)
        try:
            out = pipe(
                prompt=None, height=job.height, width=job.width, num_inference_steps=job.steps,
                generator=torch.Generator().manual_seed(job.seed), output_type="latent", callback_on_step_end=step_end,
                return_dict=False, **kwargs,
            )
        finally:
            self._reset_step_caches()
        return out if whole else out[0]

    def _step_components(self, job: Job) -> list[str] | None:
        """The denoiser of each step for families with experts (Wan 2.2), else None."""
        return self.family.step_components(self.pipe, job) if self.family.experts else None

    def encode_image(self, names: list[str], job: Job):
        """The job's input image in latent space (`Family.encode_image`), on the stage's device."""
        device = self._device(names)
        self.pipe._dmap_device = device
        return self.family.encode_image(self.pipe, job, device)

    def decode(self, names: list[str], job: Job, latents) -> list:
        if latents is None:
            raise UsageError("The plan runs decode before denoise: the stages are out of order.")
        device = self._device(names)
        self.meter.current.append(str(next(iter(self.device_map(names[0]).values()))))
        try:
            return self.family.decode(self.pipe, latents, job, device)
        finally:
            self.meter.current.pop()

    def run_stage(self, stage_plan, job: Job, carry: Carry, on_step=None, result: StageResult | None = None) -> StageResult:
        """Run one planned stage of `job` (its components must be loaded) with the runner of its kind,
        measuring its peaks."""
        import torch

        name = stage_plan.name
        names = list(stage_plan.components)
        runner = self._runner(stage_plan)
        missing = [value for value in stage_plan.consumes if not carry.has(value)]
        if missing:
            makers = [s.name for s in self.plan.stages if missing[0] in s.produces]
            before = makers[0] if makers else f"any stage that makes its {missing[0]}"
            raise UsageError(f"The plan runs {name} before {before}: the stages are out of order.")
        stage = result or StageResult(name, names, planned_peak={str(k): int(v) for k, v in stage_plan.peak_bytes.items()})
        meter = self.meter
        self._reset_peaks()
        start = time.perf_counter()
        meter.current[:] = [str(next(iter(self.device_map(names[0]).values())))] if names else ["cpu"]
        track, sampled = self._measure_mode(names)
        stage.tracked = "all" if track else ("process peak RSS" if sampled else "none (CUDA: max_memory_allocated)"
                                             if self.measure else "not measured")
        rss = RssSampler() if sampled else None
        try:
            with torch.inference_mode(False), torch.no_grad(), (rss or contextlib.nullcontext()):
                if track:
                    meter.start()
                runner(self, stage_plan, job, carry, on_step)
                if track and runner is StageLoop._run_denoise and self.tracked_steps is not None \
                        and job.steps > self.tracked_steps:
                    stage.tracked = f"first {self.tracked_steps} of {job.steps} steps"
                meter.stop()
            self.status(None)
        except torch.OutOfMemoryError as error:
            raise _oom(error, name, stage.planned_peak) from None
        except MemoryError:
            raise DoesNotFitError(
                f"Out of host memory during {name} (planned cpu peak {format_size(stage.planned_peak.get('cpu', 0))}): "
                "lower cpu= in --max-memory to what is really free and plan again."
            ) from None
        stage.run_s = time.perf_counter() - start
        self._measured(stage, rss)
        return stage

    # --- the runner of each stage kind (what the stage produces) ------------------------------------

    def _runner(self, stage_plan) -> Callable:
        runner = RUNNERS.get(stage_plan.kind)
        if runner is None:
            made = ", ".join(stage_plan.produces) or "nothing"
            raise UsageError(f"The plan has a stage '{stage_plan.name}' that makes {made}, which dmap run cannot run "
                             f"(its stages make {', '.join(KIND_OF)}).")
        return runner

    def _run_encode(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Encoding the prompt…")
        carry.embeds = self.encode(list(stage_plan.components), job)

    def _run_encode_image(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Encoding the input image…")
        carry.image_latents = self.encode_image(list(stage_plan.components), job)

    def _run_denoise(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status(None)  # the denoise progress bar takes over
        whole = AUDIO_LATENTS in stage_plan.produces
        out = self.denoise(list(stage_plan.components), job, carry.embeds, on_step,
                           image_latents=_consumed_image(stage_plan, carry), whole=whole)
        carry.latents, carry.audio_latents = (out[0], out[1]) if whole else (out, None)
        carry.embeds = carry.image_latents = None  # consumed: nothing later reads them

    def _run_decode(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Decoding the latents…")
        carry.images = self.decode(list(stage_plan.components), job, carry.latents)
        _join_audio(carry)

    def _run_decode_audio(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Decoding the audio…")
        names = list(stage_plan.components)
        self.meter.current.append(str(next(iter(self.device_map(names[0]).values()))))
        try:
            carry.audio = self.family.decode_audio(self.pipe, carry.audio_latents, job, self._device(names))
        finally:
            self.meter.current.pop()
        carry.audio_latents = None
        _join_audio(carry)

    def _measured(self, stage: StageResult, rss=None) -> None:
        """Peak per device since the last reset: weights resident after the load + tracked activations
        (without the tracker, `rss`: what the process's resident set grew by, charged to the cpu)."""
        import torch

        resident = stage.resident_after_load
        grown = dict(self.meter.peak)
        if rss is not None:  # what the run added on top of the loaded weights, charged to the cpu
            grown["cpu"] = max(0, rss.peak - rss.start)
        stage.measured_peak = {d: resident.get(d, 0) + grown.get(d, 0)
                               for d in set(resident) | set(grown) if d != "disk" and resident.get(d, 0) + grown.get(d, 0)}
        if self.cuda:
            for i in range(torch.cuda.device_count()):
                stage.measured_peak[str(i)] = torch.cuda.max_memory_allocated(i)

    def _reset_peaks(self) -> None:
        import torch

        self.meter.reset_peaks()
        if self.cuda:
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)

    def run_job(self, job: Job, on_step: Callable[..., None] | None = None) -> tuple[Carry, list[StageResult]]:
        """All the plan's stages for one job (`dmap run`): (its Carry, what each load and stage measured)."""
        results: list[StageResult] = []
        carry = Carry()
        for _, carry, _ in self.run_jobs([job], on_step, results):
            pass
        return carry, results

    def run_jobs(self, jobs: list[Job], on_step: Callable[..., None] | None = None,
                 results: list[StageResult] | None = None) -> Iterator[tuple[int, Carry, float]]:
        """Every stage of the plan over `jobs`, stage-major: a staged plan loads each stage's components once,
        runs the stage for every job, then frees them; a resident one loads what is missing first and keeps it.
        Experts taking turns (`run_experts`) load within each job's denoise. Yields (index, carry, seconds of
        its stages) as each job finishes its last stage; `results` collects a StageResult per load and stage
        (a stage's run_s sums its jobs, its measured peak is the largest)."""
        results = [] if results is None else results
        staged = self.plan.mode != "resident"
        carries = [Carry() for _ in jobs]
        seconds = [0.0] * len(jobs)
        missing = [name for name in self.plan.components if name not in self.loaded]
        if not staged and missing:
            first = StageResult("load", sorted(missing))
            start = time.perf_counter()
            first.resident_before = self.meter.resident()
            self.load_stage(missing, first)
            first.load_s = first.wall_s = time.perf_counter() - start
            first.resident_after_load = self.meter.resident()
            results.append(first)
        groups = self.stage_groups()
        for position, group in enumerate(groups):
            last = position == len(groups) - 1
            if len(group) > 1:
                for n, job in enumerate(jobs):
                    start = time.perf_counter()
                    results += self.run_experts(group, job, carries[n], on_step)
                    seconds[n] += time.perf_counter() - start
                    if last:
                        yield n, carries[n], seconds[n]
                continue
            stage_plan = group[0]
            stage = _stage_result(stage_plan)
            start = time.perf_counter()
            stage.resident_before = self.meter.resident()
            # the image-encode stage of a family that takes input images has nothing to encode when no job brings
            # one (LTX-2 text-to-video, Kontext from text): it runs (Family.encode_image says so) without its components
            needed = stage_plan.kind != ENCODE_IMAGE or not self.family.max_input_images or any(j.images for j in jobs)
            if staged and needed:
                self.load_stage(stage.components, stage)
                stage.load_s = time.perf_counter() - start
            stage.resident_after_load = self.meter.resident()
            run_s, peak = 0.0, {}
            together = not last and self.runs_together(stage_plan)  # a pipeline's ranks: every job in flight at once
            try:
                if together:
                    self.run_stage_together(stage_plan, jobs, carries, on_step, stage)
                    for n in range(len(jobs)):
                        seconds[n] += stage.run_s / len(jobs)
                    run_s, peak = stage.run_s, dict(stage.measured_peak)
                for n, job in enumerate(() if together else jobs):
                    self.run_stage(stage_plan, job, carries[n], on_step if stage_plan.kind == DENOISE else None, stage)
                    seconds[n] += stage.run_s
                    run_s += stage.run_s
                    peak = {d: max(peak.get(d, 0), stage.measured_peak.get(d, 0)) for d in {*peak, *stage.measured_peak}}
                    if last:
                        carry, carries[n] = carries[n], None  # nothing of a yielded job stays here
                        yield n, carry, seconds[n]
            finally:
                if staged and needed:
                    self.unload_stage(stage.components)
            stage.run_s, stage.measured_peak = run_s, peak
            stage.wall_s = time.perf_counter() - start
            results.append(stage)

    def runs_together(self, stage_plan) -> bool:
        """Whether the jobs of a chunk run this stage together (`run_stage_together`) rather than one by one."""
        return False

    def run_stage_together(self, stage_plan, jobs: list[Job], carries: list[Carry], on_step, stage: StageResult) -> None:
        raise NotImplementedError  # a loop whose runs_together says yes (dm_cli.run.pipeline) has its own

    def stage_groups(self) -> list[list]:
        """The plan's stages as they run: consecutive denoise sub-stages (the same name) of a staged plan
        (experts loaded one at a time, `run_experts`) form one group, every other stage a group of its own."""
        staged = self.plan.mode != "resident"
        groups: list[list] = []
        for stage in self.plan.stages:
            if staged and groups and stage.kind == DENOISE and groups[-1][0].kind == DENOISE \
                    and stage.name == groups[-1][0].name:
                groups[-1].append(stage)
            else:
                groups.append([stage])
        return groups

    def run_experts(self, parts: list, job: Job, carry: Carry, on_step) -> list[StageResult]:
        """One denoise call over consecutive sub-stages (Wan 2.2's experts): only the sub-stage whose
        expert runs the first step is loaded; at the step where the next expert takes over, the current
        one is freed and only then the next one loaded (an expert that never runs is never loaded)."""
        import torch

        owner = {name: i for i, part in enumerate(parts) for name in part.components}
        running = self._step_components(job) or [self.family.denoiser] * job.steps
        order = [owner[name] for name in running]
        results = [_stage_result(part) for part in parts]
        state = {"part": order[0], "start": time.perf_counter()}

        def load(part: int) -> None:
            stage = results[part]
            start = time.perf_counter()
            stage.resident_before = self.meter.resident()
            self.load_stage(stage.components, stage)
            stage.load_s = time.perf_counter() - start
            stage.resident_after_load = self.meter.resident()
            self.meter.current[:] = [str(next(iter(self.device_map(stage.components[0]).values())))]
            self._reset_peaks()
            rss = RssSampler().__enter__() if sampled else None  # after the load: it resets the high-water mark
            state.update(part=part, start=start, run=time.perf_counter(), rss=rss)

        def finish(part: int) -> None:
            stage = results[part]
            stage.run_s = time.perf_counter() - state["run"]
            if state["rss"] is not None:
                state["rss"].__exit__(None, None, None)
            self._measured(stage, state["rss"])
            self.unload_stage(stage.components)
            stage.wall_s = time.perf_counter() - state["start"]

        track, sampled = self._measure_mode([c for part in parts for c in part.components])

        def switch(step: int) -> None:
            if step + 1 < len(order) and order[step + 1] != state["part"]:
                self.meter.stop()  # loading is not an activation
                finish(state["part"])
                load(order[step + 1])
                self._tracking_from = step + 1  # the new expert's first steps are tracked again
                if track:
                    self.meter.start()

        load(order[0])
        try:
            with torch.inference_mode(False), torch.no_grad():
                if track:
                    self.meter.start()
                carry.latents = self.denoise(results[order[0]].components, job, carry.embeds, on_step, switch,
                                             _consumed_image(parts[0], carry))
                carry.embeds = carry.image_latents = None
                self.meter.stop()
        except torch.OutOfMemoryError as error:
            raise _oom(error, parts[0].name, results[state["part"]].planned_peak) from None
        finish(state["part"])
        how = "tracked" if track else ("process peak RSS" if sampled else "CUDA: max_memory_allocated"
                                                                     if self.measure else "not measured")
        for part, stage in enumerate(results):
            used = order.count(part)
            stage.tracked = f"{how}, {used} of {job.steps} steps" if used else "not run (its expert has no step)"
        return results


class MainRankStages:
    """For the loops of ranks that share each job (dm_cli.run.parallel, dm_cli.run.pipeline; before StageLoop in
    the bases, with a `sharing` that says whether this is rank 0): rank 0 encodes and every rank gets what the
    encoding stages make; rank 0 alone decodes (it writes the outputs)."""

    def _runner(self, stage_plan):
        if stage_plan.kind in (ENCODE, ENCODE_IMAGE):
            return MainRankStages._run_once_and_share
        if stage_plan.kind in (DECODE, DECODE_AUDIO):
            return MainRankStages._run_on_main
        return super()._runner(stage_plan)

    def _run_once_and_share(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Encode on rank 0; every rank gets what the stage produces (embeddings, image latents)."""
        from dm_cli.run.distributed import broadcast

        if self.sharing.is_main:
            super()._runner(stage_plan)(self, stage_plan, job, carry, on_step)
        made = broadcast({value: getattr(carry, value) for value in stage_plan.produces}, self.sharing)
        for value, data in made.items():
            setattr(carry, value, data)

    def _run_on_main(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Decode on rank 0 only; the other ranks keep the latents and make no images."""
        if self.sharing.is_main:
            super()._runner(stage_plan)(self, stage_plan, job, carry, on_step)


RUNNERS: dict[str, Callable] = {ENCODE: StageLoop._run_encode, ENCODE_IMAGE: StageLoop._run_encode_image,
                                 DENOISE: StageLoop._run_denoise, DECODE: StageLoop._run_decode,
                                 DECODE_AUDIO: StageLoop._run_decode_audio}


def _join_audio(carry: Carry) -> None:
    """Each video's frames carry its waveform once both are decoded (dm_cli.io.video.with_audio): the writers put
    it in the MP4, or as a WAV beside a frames folder."""
    if carry.audio is not None and carry.images:
        from dm_cli.io.video import with_audio

        waves, rate = carry.audio
        carry.images = [with_audio(frames, wave, rate) for frames, wave in zip(carry.images, waves)]
        carry.audio = None


def _consumed_image(stage_plan, carry: Carry):
    """The encoded input image when the stage consumes it, else None."""
    return carry.image_latents if IMAGE_LATENTS in stage_plan.consumes else None


def _stage_result(stage_plan) -> StageResult:
    return StageResult(stage_plan.name, list(stage_plan.components),
                       planned_peak={str(k): int(v) for k, v in stage_plan.peak_bytes.items()})


def nonfinite_refusal(step: int, steps: int, loras: tuple = (), dtype=None) -> str:
    """Why a run stopped at the step whose latents turned NaN or infinite (checked after every denoising step, one
    reduction: what would otherwise be decoded into an all-black image), naming the likely cause."""
    if loras:
        names = ", ".join(f"{lora.name}:{lora.scale:g}" for lora in loras)
        cause = (f"likely the LoRA ({names}): a scale too large for it, or NaN weights in it or in the denoiser; "
                 "try a smaller --lora scale")
    else:
        cause = ("likely NaN or infinite weights in the denoiser (a corrupt or all-NaN checkpoint or GGUF file), or "
                 "numbers too large for its dtype" + (f" ({str(dtype).removeprefix('torch.')})" if dtype else ""))
    return (f"Denoising step {step} of {steps} turned the latents NaN or infinite, which decodes to an all-black "
            f"image, so the run stopped and nothing was written: {cause}.")


def _oom(error, stage: str, planned: dict) -> DoesNotFitError:
    import re

    import torch

    match = re.search(r"GPU (\d+)", str(error))
    gpu = match.group(1) if match else "0"
    actual = torch.cuda.max_memory_allocated(int(gpu)) if torch.cuda.is_available() else 0
    plan_peak = planned.get(gpu, 0)
    smaller = int(plan_peak * 0.9) if plan_peak else 0
    hint = f"plan again with {gpu}={format_size(smaller)} in --max-memory" if smaller else "plan again with a smaller --max-memory for it"
    return DoesNotFitError(
        f"Out of memory on GPU {gpu} during {stage}: planned {format_size(plan_peak)}, reached {format_size(actual)} before "
        f"failing; {hint} so the plan keeps more room free.",
        {"stage": stage, "device": gpu, "planned_bytes": plan_peak, "actual_bytes": actual},
    )

"""What each kind of stage runs, in every run mode (the stage's kind is what it produces: dm_cli.families.stages):
the family's encoders (`Family.encode`, `Family.encode_image`), the pipeline's own `__call__` from embeddings with
`output_type="latent"`, the family's decoders (`Family.decode`, `Family.decode_audio`). A collaborator the stage loop
owns (`StageLoop.runners`, dm_cli.run.loops.stages): it reads the loop's state (its pipeline, plan, meter, hooks) and calls
nothing above it; the run modes whose ranks share a job give the loop their own (dm_cli.run.loops.main_rank)."""

from __future__ import annotations

import inspect as pyinspect
import re
from typing import Callable

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import Embeds, Job
from dm_cli.families.stages import AUDIO_LATENTS, DECODE, DECODE_AUDIO, DENOISE, ENCODE, ENCODE_IMAGE, KIND_OF
from dm_cli.run.loops.carry import Carry, consumed_image, join_audio
from dm_cli.units import format_size


class StageRunners:
    """The runner of each stage kind, and the encode / denoise / decode calls they make on the loop's pipeline."""

    def __init__(self, loop):
        self.loop = loop  # the stage loop whose pipeline, plan, meter and hooks these run on
        self.tracking_from = 0  # denoising step at which the activation tracker last started (run_experts moves it)

    def _device(self, names: list[str]):
        return self.loop._device(names)

    def encode(self, names: list[str], job: Job) -> Embeds:
        device = self._device(names)
        self.loop.pipe._dmap_device = device
        return self.loop.family.encode(self.loop.pipe, job, device)

    def denoise(self, names: list[str], job: Job, embeds: Embeds, on_step: Callable[..., None] | None,
                switch: Callable[[int], None] | None = None, image_latents=None, whole: bool = False):
        """The pipeline's own __call__ from embeddings, to latents (diffusers' math stays diffusers').

        `switch(step)` runs at the end of every step (the expert switch of `run_experts`); the
        activation tracker stops `tracked_steps` steps after it last started (`tracking_from`).
        `image_latents`: an encoded input image the denoising starts from (`Family.image_kwargs`).
        `whole`: every output of the call (LTX-2: video and audio latents), not just the first.
        """
        import torch  # lazy: torch (heavy, off start-up)

        if embeds is None:
            raise UsageError("The plan runs denoise before encode: the stages are out of order.")
        device = self._device(names)
        self.loop.pipe._dmap_device = device
        kwargs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in embeds.tensors.items()}
        kwargs.update(self.loop.family.call_kwargs(self.loop.pipe, job))
        if image_latents is not None:  # the stage consumes an encoded input image: denoising starts from it
            kwargs.update(self.loop.family.image_kwargs(self.loop.pipe, job, image_latents.to(device)))
        # a family may denoise with another pipeline class over the same components (LTX-2's image-to-video)
        pipe = getattr(self.loop.family, "denoising_pipeline", lambda pipe, job, image_latents: pipe)(
            self.loop.pipe, job, image_latents)
        params = pyinspect.signature(type(pipe).__call__).parameters
        if "max_sequence_length" in params and job.max_sequence_length:
            kwargs["max_sequence_length"] = job.max_sequence_length
        # embeddings are already repeated per image (or video): one per prompt embedding
        kwargs["num_images_per_prompt" if "num_images_per_prompt" in params else "num_videos_per_prompt"] = 1
        step_end = self._step_end(job, on_step, switch)
        self.loop.hooks.reset(job)  # the job's LoRAs active, the step caches empty (magcache made for its steps)
        try:
            out = pipe(
                prompt=None, height=job.height, width=job.width, num_inference_steps=job.steps,
                generator=torch.Generator().manual_seed(job.seed), output_type="latent", callback_on_step_end=step_end,
                return_dict=False, **kwargs,
            )
        finally:
            self.loop.hooks.reset()
        return out if whole else out[0]

    def _step_end(self, job: Job, on_step, switch):
        """The pipeline's callback at the end of each step: the NaN check, the tracker's stop, progress, the switch."""
        import torch  # lazy: torch (heavy, off start-up)

        meter, tracked = self.loop.meter, self.loop.tracked_steps
        self.tracking_from = 0
        running = self.step_components(job)

        def step_end(_pipe, step, _t, callback_kwargs):
            latents = callback_kwargs.get("latents")
            if latents is not None and not bool(torch.isfinite(latents).all()):
                raise UsageError(nonfinite_refusal(step + 1, job.steps, job.loras, self.loop.torch_dtype))
            if tracked is not None and step + 1 - self.tracking_from == tracked:
                meter.stop()  # later steps repeat this one's graph on the same shapes: its peak is the stage's
            if on_step is not None:
                on_step(step + 1, job.steps, running[step] if running else None)
            if switch is not None:
                switch(step)
            return callback_kwargs

        return step_end

    def step_components(self, job: Job) -> list[str] | None:
        """The denoiser of each step for families with experts (Wan 2.2), else None."""
        return self.loop.family.step_components(self.loop.pipe, job) if self.loop.family.experts else None

    def encode_image(self, names: list[str], job: Job):
        """The job's input image in latent space (`Family.encode_image`), on the stage's device."""
        device = self._device(names)
        self.loop.pipe._dmap_device = device
        return self.loop.family.encode_image(self.loop.pipe, job, device)

    def decode(self, names: list[str], job: Job, latents) -> list:
        if latents is None:
            raise UsageError("The plan runs decode before denoise: the stages are out of order.")
        device = self._device(names)
        self.loop.meter.current.append(str(next(iter(self.loop.device_map(names[0]).values()))))
        try:
            return self.loop.family.decode(self.loop.pipe, latents, job, device)
        finally:
            self.loop.meter.current.pop()

    # --- the runner of each stage kind (what the stage produces) ------------------------------------

    def runner(self, stage_plan) -> Callable:
        """The runner of `stage_plan`'s kind, bound: `runner(stage_plan, job, carry, on_step)`."""
        runner = RUNNERS.get(stage_plan.kind)
        if runner is None:
            made = ", ".join(stage_plan.produces) or "nothing"
            raise UsageError(f"The plan has a stage '{stage_plan.name}' that makes {made}, which dmap run cannot run "
                             f"(its stages make {', '.join(KIND_OF)}).")
        return getattr(self, runner.__name__)

    def run_encode(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.loop.status("Encoding the prompt…")
        carry.embeds = self.encode(list(stage_plan.components), job)

    def run_encode_image(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.loop.status("Encoding the input image…")
        carry.image_latents = self.encode_image(list(stage_plan.components), job)

    def run_denoise(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.loop.status(None)  # the denoise progress bar takes over
        whole = AUDIO_LATENTS in stage_plan.produces
        out = self.denoise(list(stage_plan.components), job, carry.embeds, on_step,
                           image_latents=consumed_image(stage_plan, carry), whole=whole)
        carry.latents, carry.audio_latents = (out[0], out[1]) if whole else (out, None)
        carry.embeds = carry.image_latents = None  # consumed: nothing later reads them

    def run_decode(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.loop.status("Decoding the latents…")
        carry.images = self.decode(list(stage_plan.components), job, carry.latents)
        join_audio(carry)

    def run_decode_audio(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.loop.status("Decoding the audio…")
        names = list(stage_plan.components)
        self.loop.meter.current.append(str(next(iter(self.loop.device_map(names[0]).values()))))
        try:
            carry.audio = self.loop.family.decode_audio(self.loop.pipe, carry.audio_latents, job, self._device(names))
        finally:
            self.loop.meter.current.pop()
        carry.audio_latents = None
        join_audio(carry)


RUNNERS: dict[str, Callable] = {ENCODE: StageRunners.run_encode, ENCODE_IMAGE: StageRunners.run_encode_image,
                                 DENOISE: StageRunners.run_denoise, DECODE: StageRunners.run_decode,
                                 DECODE_AUDIO: StageRunners.run_decode_audio}


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


def out_of_memory(error, stage: str, planned: dict) -> DoesNotFitError:
    """The refusal for a GPU's OutOfMemoryError during `stage`: planned and reached bytes, and a smaller budget."""
    import torch  # lazy: torch (heavy, off start-up)

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

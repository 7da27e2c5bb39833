"""What each kind of stage runs, in every run mode (the stage's kind is what it produces: dm_cli.families.stages):
the family's encoders (`Family.encode`, `Family.encode_image`), the pipeline's own `__call__` from embeddings with
`output_type="latent"`, the family's decoders (`Family.decode`, `Family.decode_audio`). A mixin of the stage loop
(dm_cli.run.stages); the loops of the run modes choose which of these run where (dm_cli.run.main_rank)."""

from __future__ import annotations

import inspect as pyinspect
import re
from typing import Callable

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.families import Embeds, Job
from dm_cli.families.stages import AUDIO_LATENTS, DECODE, DECODE_AUDIO, DENOISE, ENCODE, ENCODE_IMAGE, KIND_OF
from dm_cli.run.carry import Carry, consumed_image, join_audio
from dm_cli.run.loading import execution_device
from dm_cli.units import format_size


class StageRunners:
    """The runner of each stage kind, and the encode / denoise / decode calls they make on the loop's pipeline."""

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
        import torch  # lazy: torch (heavy, off start-up)

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
        step_end = self._step_end(job, on_step, switch)
        self.hooks.reset(job)  # the job's LoRAs active, the step caches empty (magcache made for its steps)
        try:
            out = pipe(
                prompt=None, height=job.height, width=job.width, num_inference_steps=job.steps,
                generator=torch.Generator().manual_seed(job.seed), output_type="latent", callback_on_step_end=step_end,
                return_dict=False, **kwargs,
            )
        finally:
            self.hooks.reset()
        return out if whole else out[0]

    def _step_end(self, job: Job, on_step, switch):
        """The pipeline's callback at the end of each step: the NaN check, the tracker's stop, progress, the switch."""
        import torch  # lazy: torch (heavy, off start-up)

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

        return step_end

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
                           image_latents=consumed_image(stage_plan, carry), whole=whole)
        carry.latents, carry.audio_latents = (out[0], out[1]) if whole else (out, None)
        carry.embeds = carry.image_latents = None  # consumed: nothing later reads them

    def _run_decode(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Decoding the latents…")
        carry.images = self.decode(list(stage_plan.components), job, carry.latents)
        join_audio(carry)

    def _run_decode_audio(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        self.status("Decoding the audio…")
        names = list(stage_plan.components)
        self.meter.current.append(str(next(iter(self.device_map(names[0]).values()))))
        try:
            carry.audio = self.family.decode_audio(self.pipe, carry.audio_latents, job, self._device(names))
        finally:
            self.meter.current.pop()
        carry.audio_latents = None
        join_audio(carry)


RUNNERS: dict[str, Callable] = {ENCODE: StageRunners._run_encode, ENCODE_IMAGE: StageRunners._run_encode_image,
                                 DENOISE: StageRunners._run_denoise, DECODE: StageRunners._run_decode,
                                 DECODE_AUDIO: StageRunners._run_decode_audio}


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

"""FLUX.1 image-to-image (FluxImg2ImgPipeline): FLUX.1 [dev] or [schnell] weights, denoising from an input image.

The pipeline resizes the image to the output size, VAE-encodes it (a sample of the distribution: the first
draw of the generator), noises it to the step `strength` leaves (the second draw) and runs only the steps
after it. dmap runs all of that before the denoiser as its own stage (`encode_image`: IMAGE -> IMAGE_LATENTS,
the VAE serving it and the decode), calling the pipeline's own `prepare_latents` with a generator seeded as the
run's, and hands the noised, packed latents to the pipeline's __call__ as `latents` (which it takes as they are,
drawing nothing more): pixel-identical to `FluxImg2ImgPipeline(...)(prompt, image=..., strength=...,
generator=...)`. The tracer's calls are FLUX.1's: the denoiser sees the output's tokens only, and the VAE's
decode at the output size needs more than its encode at that size (the image is resized to it).

The same weights as FLUX.1: a pipeline folder whose model_index.json names FluxImg2ImgPipeline (the
`flux-dev-img2img` preset, `tiny-flux-img2img`). No torch at import.
"""

from __future__ import annotations

from dm_cli.families import Job, Setting
from dm_cli.families.flux import FluxFamily
from dm_cli.families.stages import image_to_image_stages
from dm_cli.inputs import Generation
from dm_cli.io.input_images import open_input

DEFAULT_STRENGTH = 0.6  # FluxImg2ImgPipeline.__call__'s strength


def strength_refusal(generation: Generation) -> str | None:
    """An image-to-image pipeline's rules on --strength (FLUX.1 and Qwen-Image alike), one sentence."""
    strength = generation.setting("strength", DEFAULT_STRENGTH)
    if not 0.0 <= strength <= 1.0:
        return f"--strength must be from 0 to 1, not {strength}."
    steps = generation.steps
    if steps is not None and denoising_steps(steps, strength) < 1:
        return (f"--strength {strength} leaves none of the {steps} steps to run (the pipeline runs about "
                f"steps x strength of them): raise --strength.")
    return None


def noised_image_latents(pipe, job: Job, device, calculate_shift, retrieve_timesteps):
    """The input image resized, VAE-sampled and noised to the first step `strength` leaves, as the flow-matching
    image-to-image pipelines (FluxImg2ImgPipeline, QwenImageImg2ImgPipeline) do before their loop: their timesteps
    (`calculate_shift`, `retrieve_timesteps` from the pipeline's module), their prepare_latents, the run's seed.
    Returns what that prepare_latents returns."""
    import numpy as np  # lazy: numpy (heavy, off start-up)
    import torch  # lazy: torch (heavy, off start-up)

    image = pipe.image_processor.preprocess(open_input(job.images[0]), height=job.height, width=job.width)
    image = image.to(dtype=torch.float32)
    steps, config, factor = job.steps, pipe.scheduler.config, pipe.vae_scale_factor
    mu = calculate_shift((job.height // factor // 2) * (job.width // factor // 2),
                         config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    # the scheduler's state is the pipeline's own: its __call__ sets the same timesteps again before its loop
    _, count = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    timesteps, _ = pipe.get_timesteps(count, job.setting("strength", DEFAULT_STRENGTH), device)
    batch = job.num_images or 1
    return pipe.prepare_latents(image, timesteps[:1].repeat(batch), batch, pipe.transformer.config.in_channels // 4,
                                job.height, job.width, pipe.vae.dtype, device, torch.Generator().manual_seed(job.seed))


def denoising_steps(steps: int, strength: float) -> int:
    """The steps FluxImg2ImgPipeline runs of `steps` at `strength` (its get_timesteps)."""
    start = int(max(steps - min(steps * strength, steps), 0))
    return steps - start


class FluxImg2ImgFamily(FluxFamily):
    name = "flux-img2img"
    pipelines = ("FluxImg2ImgPipeline",)
    related = ()
    max_input_images = 1
    min_input_images = 1
    settings = (
        Setting("strength", float, DEFAULT_STRENGTH, "How far image-to-image departs from the input image: 0 keeps it, "
                "1 ignores it (the pipeline runs about steps x strength steps).",
                for_whom="FLUX.1 image-to-image (FluxImg2ImgPipeline)",
                instead="drop --strength, or run a FluxImg2ImgPipeline folder (the flux-dev-img2img preset)"),
    )
    declared_stages = image_to_image_stages(("text_encoder", "text_encoder_2"))

    step_caches = {}  # its pipeline sets no cache_context, which diffusers' cache hooks need

    def title(self) -> str:
        return "FLUX.1 image-to-image"

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        return super().refusal(generation, components) or strength_refusal(generation)

    def encode_image(self, pipe, job: Job, device):
        """The input image noised to the first step `strength` leaves, as FluxImg2ImgPipeline.__call__ does."""
        # lazy: diffusers (heavy, off start-up)
        from diffusers.pipelines.flux.pipeline_flux_img2img import calculate_shift, retrieve_timesteps

        return noised_image_latents(pipe, job, device, calculate_shift, retrieve_timesteps)[0]

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The prepared latents as `latents` (taken as they are); `image` only for the pipeline's preprocess, which
        passes a tensor with the VAE's latent channels through (the same latents, unpacked: never encoded)."""
        image = pipe._unpack_latents(image_latents, job.height, job.width, pipe.vae_scale_factor)
        return {"latents": image_latents, "image": image}


FAMILY = FluxImg2ImgFamily()

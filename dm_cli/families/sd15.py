"""Stable Diffusion 1.x/2.x: one CLIP encoder, a UNet, CFG by batch doubling."""

from __future__ import annotations

from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job
from dm_cli.families.calls import CallSpec, Component, component_call
from dm_cli.families.unet import unet_call, uses_cfg
from dm_cli.inputs import InputSpec


class SD15Family(Family):
    name = "sd15"
    denoiser = "unet"
    pipelines = ("StableDiffusionPipeline",)
    related = ("StableDiffusion",)
    denoiser_classes = ("UNet2DConditionModel",)
    offload_seq = "text_encoder->image_encoder->unet->vae"
    guidance = GUIDANCE_BATCH
    default_steps = 50
    default_guidance = 7.5

    def title(self) -> str:
        return "Stable Diffusion"

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        if comp.cls in self.denoiser_classes:
            return unet_call(self, comp, inputs)
        return component_call(comp, inputs)

    def encode(self, pipe, job: Job, device) -> Embeds:
        do_cfg = uses_cfg(pipe, job)
        pe, npe = pipe.encode_prompt(job.prompt, device, job.num_images, do_cfg, job.negative_prompt)
        out = {"prompt_embeds": pe}
        if do_cfg:
            out["negative_prompt_embeds"] = npe
        return Embeds(out)

    def decode(self, pipe, latents, job: Job, device) -> list:
        image = pipe.vae.decode((latents / pipe.vae.config.scaling_factor).to(device), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil", do_denormalize=[True] * image.shape[0])


FAMILY = SD15Family()

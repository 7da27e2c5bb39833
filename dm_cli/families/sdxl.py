"""Stable Diffusion XL: two CLIP encoders (penultimate states, pooled), a UNet with text_time
conditioning, CFG by batch doubling, a VAE that decodes in float32 when loaded in float16."""

from __future__ import annotations

from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job, pooled_embeds
from dm_cli.families.calls import CallSpec, Component, component_call
from dm_cli.families.unet import unet_call, uses_cfg
from dm_cli.inputs import InputSpec


class SDXLFamily(Family):
    name = "sdxl"
    denoiser = "unet"
    pipelines = ("StableDiffusionXLPipeline",)
    related = ("StableDiffusionXL",)
    denoiser_classes = ("UNet2DConditionModel",)
    offload_seq = "text_encoder->text_encoder_2->image_encoder->unet->vae"
    guidance = GUIDANCE_BATCH
    default_steps = 50
    default_guidance = 5.0

    def matches(self, pipeline_class, component_cls, config) -> bool:
        if pipeline_class:
            return super().matches(pipeline_class, component_cls, config)
        return component_cls in self.denoiser_classes and (config or {}).get("addition_embed_type") == "text_time"

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        if comp.cls in self.denoiser_classes:
            return unet_call(self, comp, inputs)
        upcast = bool((comp.config or {}).get("force_upcast", True))
        return component_call(comp, inputs, clip_hidden_states=True, upcast_fp16=upcast)

    def encode(self, pipe, job: Job, device) -> Embeds:
        do_cfg = uses_cfg(pipe, job)
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=job.prompt, device=device, num_images_per_prompt=job.num_images,
                                                do_classifier_free_guidance=do_cfg, negative_prompt=job.negative_prompt)
        return pooled_embeds(do_cfg, pe, npe, ppe, nppe)

    def decode(self, pipe, latents, job: Job, device) -> list:
        import torch  # lazy: torch (heavy, off start-up)

        vae = pipe.vae
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            pipe.upcast_vae()
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents.to(device), return_dict=False)[0]
        if getattr(pipe, "watermark", None) is not None:
            image = pipe.watermark.apply_watermark(image)
        return pipe.image_processor.postprocess(image, output_type="pil")


FAMILY = SDXLFamily()

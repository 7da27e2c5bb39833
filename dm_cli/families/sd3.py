"""Stable Diffusion 3: two CLIP encoders and T5, an MMDiT transformer, CFG by batch doubling."""

from __future__ import annotations

from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job, pooled_embeds
from dm_cli.families.calls import CLIP_TOKENS, CallSpec, Component, TensorSpec, component_call, vae_config
from dm_cli.inputs import InputSpec


class SD3Family(Family):
    name = "sd3"
    pipelines = ("StableDiffusion3Pipeline",)
    related = ("StableDiffusion3",)
    denoiser_classes = ("SD3Transformer2DModel",)
    offload_seq = "text_encoder->text_encoder_2->text_encoder_3->image_encoder->transformer->vae"
    guidance = GUIDANCE_BATCH
    default_steps = 28
    default_guidance = 7.0
    default_max_sequence_length = 256

    def size_multiple(self, denoiser_config: dict, vae_config_: dict | None) -> int:
        return self.vae_scale(vae_config_) * int((denoiser_config or {}).get("patch_size", 2))

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        seq = self.max_sequence_length(comp, inputs)
        if comp.cls in self.denoiser_classes:
            factor = self.vae_scale(vae_config(comp))
            latent_h, latent_w = inputs.height // factor, inputs.width // factor
            batch = inputs.effective_batch * self.cfg_batch(inputs)
            kwargs = {
                "hidden_states": TensorSpec((batch, config.get("in_channels", 16), latent_h, latent_w)),
                "encoder_hidden_states": TensorSpec((batch, CLIP_TOKENS + seq, config.get("joint_attention_dim", 4096))),
                "pooled_projections": TensorSpec((batch, config.get("pooled_projection_dim", 2048))),
                "timestep": TensorSpec((batch,)),
                "return_dict": False,
            }
            return CallSpec("forward", kwargs, description=f"latents {latent_h}x{latent_w}, batch {batch}")
        return component_call(comp, inputs, clip_hidden_states=True, seq=seq)

    def encode(self, pipe, job: Job, device) -> Embeds:
        do_cfg = job.guidance_scale > 1
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=job.prompt, prompt_2=None, prompt_3=None, device=device,
                                                num_images_per_prompt=job.num_images, do_classifier_free_guidance=do_cfg,
                                                negative_prompt=job.negative_prompt,
                                                max_sequence_length=job.max_sequence_length or 256)
        return pooled_embeds(do_cfg, pe, npe, ppe, nppe)

    def decode(self, pipe, latents, job: Job, device) -> list:
        vae = pipe.vae
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(device), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")


FAMILY = SD3Family()

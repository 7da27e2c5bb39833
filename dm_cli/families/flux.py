"""FLUX.1 [dev] and [schnell]: CLIP + T5 encoders, a guidance-distilled transformer on packed 2x2 latents."""

from __future__ import annotations

from dm_cli.families import GUIDANCE_DISTILLED, Embeds, Family, Job, packed_latents
from dm_cli.families.calls import CallSpec, Component, TensorSpec, component_call, vae_config
from dm_cli.inputs import InputSpec


class FluxFamily(Family):
    name = "flux"
    pipelines = ("FluxPipeline",)
    related = ("Flux",)
    denoiser_classes = ("FluxTransformer2DModel",)
    packs_latents = True
    offload_seq = "text_encoder->text_encoder_2->image_encoder->transformer->vae"
    guidance = GUIDANCE_DISTILLED
    default_steps = 28
    default_guidance = 3.5
    default_max_sequence_length = 512  # FluxPipeline.__call__'s default, schnell included
    default_sample_size = 128
    negative_prompt = False

    # diffusers ships MagCache's magnitude ratios for FLUX.1 (FLUX_MAG_RATIOS); fbc and taylorseer hook its blocks;
    # taylorseer's lite=auto is lite here (its MLPs are most of a block's work: dm_cli.planning.step_cache.resolved_lite)
    step_caches = {"fbc": {}, "taylorseer": {"lite": True}, "magcache": {"mag_ratios": "flux"}}

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        factor = self.vae_scale(vae_config(comp))
        latent_h, latent_w, tokens = packed_latents(inputs, factor)
        seq = self.max_sequence_length(comp, inputs)
        images = inputs.effective_batch
        if comp.cls in self.denoiser_classes:
            kwargs = {
                "hidden_states": TensorSpec((images, tokens, config.get("in_channels", 64))),
                "encoder_hidden_states": TensorSpec((images, seq, config.get("joint_attention_dim", 4096))),
                "pooled_projections": TensorSpec((images, config.get("pooled_projection_dim", 768))),
                "timestep": TensorSpec((images,)),
                "img_ids": TensorSpec((tokens, 3)),
                "txt_ids": TensorSpec((seq, 3)),
                "return_dict": False,
            }
            if config.get("guidance_embeds", False):
                kwargs["guidance"] = TensorSpec((images,))
            return CallSpec("forward", kwargs, description=f"{tokens} image tokens, {seq} text tokens, batch {images}")
        return component_call(comp, inputs, latent_hw=(latent_h, latent_w), seq=seq)

    def encode(self, pipe, job: Job, device) -> Embeds:
        pe, ppe, _ = pipe.encode_prompt(prompt=job.prompt, prompt_2=None, device=device,
                                        num_images_per_prompt=job.num_images,
                                        max_sequence_length=job.max_sequence_length or 512)
        return Embeds({"prompt_embeds": pe, "pooled_prompt_embeds": ppe})

    def decode(self, pipe, latents, job: Job, device) -> list:
        vae = pipe.vae
        latents = pipe._unpack_latents(latents, job.height, job.width, pipe.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(device), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")


FAMILY = FluxFamily()

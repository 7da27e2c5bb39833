"""The UNet call shared by the Stable Diffusion 1.x/2.x and SDXL families (batch-doubling CFG)."""

from __future__ import annotations

from dm_cli.families.calls import CLIP_TOKENS, CallSpec, Component, TensorSpec, vae_config
from dm_cli.inputs import InputSpec


def unet_call(family, comp: Component, inputs: InputSpec) -> CallSpec:
    """UNet2DConditionModel as StableDiffusion(XL)Pipeline calls it: latents, timestep, CLIP states."""
    config = comp.config or {}
    factor = family.vae_scale(vae_config(comp))
    latent_h, latent_w = inputs.height // factor, inputs.width // factor
    batch = inputs.effective_batch * family.cfg_batch(inputs)
    cross = config.get("cross_attention_dim", 768)
    if isinstance(cross, (list, tuple)):
        cross = cross[0]
    kwargs = {
        "sample": TensorSpec((batch, config.get("in_channels", 4), latent_h, latent_w)),
        "timestep": TensorSpec(()),
        "encoder_hidden_states": TensorSpec((batch, CLIP_TOKENS, cross)),
        "return_dict": False,
    }
    if config.get("addition_embed_type") == "text_time":
        time_dim = config.get("addition_time_embed_dim", 256)
        text_dim = config.get("projection_class_embeddings_input_dim", 2816) - 6 * time_dim
        kwargs["added_cond_kwargs"] = {
            "text_embeds": TensorSpec((batch, text_dim)),
            "time_ids": TensorSpec((batch, 6)),
        }
    return CallSpec("forward", kwargs, description=f"latents {latent_h}x{latent_w}, batch {batch}")


def uses_cfg(pipe, job) -> bool:
    """do_classifier_free_guidance of StableDiffusion(XL)Pipeline: guidance > 1 and no guidance-embedding UNet."""
    return job.guidance_scale > 1 and pipe.unet.config.time_cond_proj_dim is None

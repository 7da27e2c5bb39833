"""Qwen-Image: a Qwen2.5-VL text encoder (last hidden state, template tokens dropped), an MMDiT
transformer on packed 2x2 latents, a video-style VAE (5-D latents, one frame), and true CFG: with a
negative prompt and `true_cfg_scale` > 1 the transformer is called twice per step (conditional,
then unconditional), never on a doubled batch."""

from __future__ import annotations

from dm_cli.families import (
    GUIDANCE_SEPARATE,
    Embeds,
    Family,
    Job,
    Setting,
    denormalized,
    local_tokenizer,
    packed_latents,
)
from dm_cli.families.calls import CallSpec, Component, TensorSpec, sibling_config, vae_config
from dm_cli.inputs import InputSpec

# QwenImagePipeline: the prompt template's system part is this many tokens, dropped after encoding;
# the encoder sees at most tokenizer_max_length (1024) prompt tokens plus these.
TEMPLATE_TOKENS = 34
ENCODER_MAX_TOKENS = 1024
# QwenImagePipeline.prompt_template_encode: the prompt goes in its user turn
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                   "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                   "<|im_start|>assistant\n")


class QwenImageFamily(Family):
    name = "qwen-image"
    pipelines = ("QwenImagePipeline",)
    related = ("QwenImage",)
    denoiser_classes = ("QwenImageTransformer2DModel",)
    packs_latents = True
    offload_seq = "text_encoder->transformer->vae"
    guidance = GUIDANCE_SEPARATE
    default_steps = 50
    default_guidance = 1.0  # guidance_scale only matters for guidance-distilled checkpoints (guidance_embeds)
    settings = (Setting("true_cfg_scale", float, 4.0,
                        "True CFG with --negative-prompt: a second denoiser call per step (Qwen-Image; default 4.0).",
                        for_whom="true-CFG pipelines such as Qwen-Image", instead="use --guidance-scale"),)
    default_max_sequence_length = 512
    default_sample_size = 128

    # fbc and taylorseer hook its transformer_blocks (MagCache has no magnitude ratios for it in diffusers);
    # taylorseer's lite=auto is lite here (its MLPs are most of a block's work: dm_cli.planning.step_cache.resolved_lite)
    step_caches = {"fbc": {}, "taylorseer": {"lite": True}}

    def title(self) -> str:
        return "Qwen-Image"

    def vae_scale(self, vae_config_: dict | None) -> int:
        """2 ** len(vae.temperal_downsample), as QwenImagePipeline computes it; 8 without a VAE config."""
        steps = (vae_config_ or {}).get("temperal_downsample")
        return 2 ** len(steps) if isinstance(steps, list) else 8

    def denoiser_calls(self, inputs: InputSpec) -> int:
        """Planned for true CFG (the pipeline's default true_cfg_scale is 4.0): two calls per step.
        They run one after the other on the same shapes, so the activation peak is one call's."""
        return 2

    def calls_at_run(self, inputs: InputSpec, negative_prompt: str | None, settings: dict) -> int:
        """The second (unconditional) call runs only under true CFG: with a negative prompt (`true_cfg`)."""
        return 2 if uses_true_cfg(settings.get("true_cfg_scale", 4.0), negative_prompt) else 1

    def run_text_tokens(self, tokenizer_folder, prompt: str | None, negative_prompt: str | None,
                        max_length: int) -> int | None:
        """QwenImagePipeline drops the template's system part and the padding: the denoiser sees the tokens of the
        prompt and the template's tail (`_get_qwen_prompt_embeds`), at most `max_length`."""
        tokenizer = local_tokenizer(tokenizer_folder) if prompt is not None else None
        if tokenizer is None:
            return None
        ids = tokenizer(PROMPT_TEMPLATE.format(prompt), max_length=ENCODER_MAX_TOKENS + TEMPLATE_TOKENS,
                        truncation=True).input_ids
        return max(1, min(len(ids) - TEMPLATE_TOKENS, max_length))

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        images, prompts = inputs.effective_batch, inputs.batch_size
        seq = self.max_sequence_length(comp, inputs)
        factor = self.vae_scale(vae_config(comp))
        latent_h, latent_w, tokens = packed_latents(inputs, factor)
        if comp.cls in self.denoiser_classes:
            encoder = sibling_config(comp, "text_encoder") or {}
            width = config.get("joint_attention_dim") or (encoder.get("text_config") or encoder).get("hidden_size", 3584)
            kwargs = {
                "hidden_states": TensorSpec((images, tokens, config.get("in_channels", 64))),
                "encoder_hidden_states": TensorSpec((images, seq, width)),
                "timestep": TensorSpec((images,)),
                "img_shapes": [[(1, latent_h // 2, latent_w // 2)]] * images,
                "return_dict": False,
            }
            if config.get("guidance_embeds", False):
                kwargs["guidance"] = TensorSpec((images,))
            calls = self.denoiser_calls(inputs)
            return CallSpec("forward", kwargs,
                            description=f"{tokens} image tokens, {seq} text tokens, batch {images}, "
                                        f"{calls} calls per step (true CFG)")
        if comp.cls.startswith("Qwen2_5_VL"):
            length = min(seq, ENCODER_MAX_TOKENS) + TEMPLATE_TOKENS
            # no attention_mask: one prompt has no padding, and transformers then skips the mask anyway
            # (its all-ones check cannot run on meta tensors)
            kwargs = {"input_ids": TensorSpec((prompts, length), "long"), "output_hidden_states": True}
            return CallSpec("forward", kwargs, description=f"{length} tokens, batch {prompts}")
        if comp.cls.startswith("AutoencoderKLQwenImage"):
            z = TensorSpec((images, config.get("z_dim", 16), 1, latent_h, latent_w))
            return CallSpec("decode", {"z": z, "return_dict": False},
                            description=f"decode latents {latent_h}x{latent_w}, batch {images}")
        return None

    # --- run ------------------------------------------------------------------------------------

    def true_cfg(self, job: Job) -> bool:
        """QwenImagePipeline's do_true_cfg: true_cfg_scale > 1 and a negative prompt (even an empty one)."""
        return uses_true_cfg(job.setting("true_cfg_scale"), job.negative_prompt)

    def encode(self, pipe, job: Job, device) -> Embeds:
        max_seq = job.max_sequence_length or self.default_max_sequence_length
        pe, mask = pipe.encode_prompt(prompt=job.prompt, device=device, num_images_per_prompt=job.num_images,
                                      max_sequence_length=max_seq)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if self.true_cfg(job):
            npe, nmask = pipe.encode_prompt(prompt=job.negative_prompt, device=device,
                                            num_images_per_prompt=job.num_images, max_sequence_length=max_seq)
            out.update(negative_prompt_embeds=npe, negative_prompt_embeds_mask=nmask)
        return Embeds(out)

    def call_kwargs(self, pipe, job: Job) -> dict:
        distilled = bool(pipe.transformer.config.guidance_embeds)
        return {"true_cfg_scale": job.setting("true_cfg_scale"), "guidance_scale": job.guidance_scale if distilled else None}

    def decode(self, pipe, latents, job: Job, device) -> list:
        vae = pipe.vae
        latents = pipe._unpack_latents(latents, job.height, job.width, pipe.vae_scale_factor).to(vae.dtype)
        image = vae.decode(denormalized(vae, latents).to(device), return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pil")


def uses_true_cfg(true_cfg_scale, negative_prompt: str | None) -> bool:
    """QwenImagePipeline's do_true_cfg: true_cfg_scale > 1 and a negative prompt (even an empty one)."""
    return (true_cfg_scale or 0) > 1 and negative_prompt is not None


FAMILY = QwenImageFamily()

"""Z-Image (Z-Image-Turbo): a Qwen3 text encoder (second-to-last hidden state, padding dropped), a
single-stream transformer that patchifies 2x2 latents itself, a FLUX-style VAE, and classifier-free
guidance on a doubled batch whenever guidance_scale > 0.

What ZImagePipeline feeds its models (diffusers 0.42, `pipeline_z_image.py`):
- text encoder: the prompt in Qwen's chat template, `input_ids (B, L)` padded to `max_sequence_length`
  (512) with a padding mask, `output_hidden_states=True`; the pipeline keeps `hidden_states[-2]` of the
  real tokens only, one `(tokens, hidden)` tensor per prompt. Under CFG the negative prompt ("" when
  none is given) is encoded in a second call. The trace passes the mask in the 4-D form transformers
  builds from it (the 2-D form makes transformers read tensor values, which meta tensors do not have).
- transformer: lists, one item per image: latents `(16, 1, H/8, W/8)` (the model patchifies 2x2 into
  (H/16)*(W/16) tokens), `t (B,)` in float32, caption features `(tokens, cap_feat_dim)`. With
  guidance_scale > 0 (the pipeline's default is 5.0) the lists hold the conditional and the
  unconditional items: one call per step on twice the batch. Z-Image-Turbo is run with
  guidance_scale 0 and 8 steps: one call on the plain batch. The trace gives the lists as batched
  tensors (the model iterates over their first dimension), every caption `max_sequence_length` long:
  the most the pipeline can pass (at most what the RoPE table holds: `caption_limit`).
- VAE: `decode(z (B, 16, H/8, W/8))` after `latents / scaling_factor + shift_factor`, in the VAE's
  dtype (no fp32 upcast).
"""

from __future__ import annotations

from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job, local_tokenizer
from dm_cli.families.calls import CallSpec, Component, TensorSpec, component_call, vae_config
from dm_cli.inputs import InputSpec

DEFAULT_SIZE = 1024  # ZImagePipeline.__call__: height = height or 1024, whatever the configs say
TEXT_ENCODERS = ("Qwen3Model", "Qwen3ForCausalLM")


SEQ_MULTI_OF = 32  # the transformer pads captions and image tokens to multiples of this


def caption_limit(config: dict) -> int:
    """The most caption tokens the transformer's RoPE table holds: captions take positions 1..L (padded to
    SEQ_MULTI_OF) on the first axis and the image sits at L + 1, which must be below `axes_lens[0]` (1536
    for Z-Image-Turbo, 256 for the tiny twin)."""
    first_axis = int((config.get("axes_lens") or [1536])[0])
    return max(SEQ_MULTI_OF, (first_axis - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF)


class TensorList(list):
    """Per-prompt embeddings (ZImagePipeline takes lists of tensors) that the stage loop can move: `.to`."""

    def to(self, *args, **kwargs) -> "TensorList":
        return TensorList(t.to(*args, **kwargs) for t in self)


class ZImageFamily(Family):
    name = "z-image"
    pipelines = ("ZImagePipeline",)
    related = ("ZImage",)
    denoiser_classes = ("ZImageTransformer2DModel",)
    offload_seq = "text_encoder->transformer->vae"
    guidance = GUIDANCE_BATCH
    default_steps = 50  # ZImagePipeline.__call__'s defaults; Z-Image-Turbo is meant for 8 steps at guidance 0
    default_guidance = 5.0
    default_max_sequence_length = 512

    def title(self) -> str:
        return "Z-Image"

    def default_size(self, denoiser_config: dict, vae_config_: dict | None) -> tuple[int, int]:
        return DEFAULT_SIZE, DEFAULT_SIZE

    def size_multiple(self, denoiser_config: dict, vae_config_: dict | None) -> int:
        """`vae_scale_factor * 2`, as ZImagePipeline.__call__ checks height and width."""
        return self.vae_scale(vae_config_) * 2

    def cfg_batch(self, inputs: InputSpec) -> int:
        """ZImagePipeline's do_classifier_free_guidance is guidance_scale > 0 (not > 1): then the batch doubles."""
        return 2 if self.guidance_scale(inputs) > 0 else 1

    def run_text_tokens(self, tokenizer_folder, prompt: str | None, negative_prompt: str | None,
                        max_length: int) -> int | None:
        """ZImagePipeline keeps the real tokens of the prompt in Qwen's chat template (`_encode_prompt`); under CFG the
        transformer pads the batch's captions to the longest, the negative prompt's ("" by default) included, and
        rounds up to SEQ_MULTI_OF itself (the trace does too)."""
        tokenizer = local_tokenizer(tokenizer_folder) if prompt is not None else None
        if tokenizer is None:
            return None

        def length(text: str) -> int:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True)
            return len(tokenizer(chat, max_length=max_length, truncation=True).input_ids)

        return max(length(prompt), length(negative_prompt or ""))

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        factor = self.vae_scale(vae_config(comp))
        latent_h, latent_w = 2 * (inputs.height // (factor * 2)), 2 * (inputs.width // (factor * 2))
        seq = self.max_sequence_length(comp, inputs)
        images, prompts = inputs.effective_batch, inputs.batch_size
        if comp.cls in self.denoiser_classes:
            batch = images * self.cfg_batch(inputs)
            patch = int((config.get("all_patch_size") or [2])[0])
            seq = min(seq, caption_limit(config))
            tokens = (latent_h // patch) * (latent_w // patch)
            kwargs = {
                "x": TensorSpec((batch, config.get("in_channels", 16), 1, latent_h, latent_w)),
                "t": TensorSpec((batch,), "float32"),
                "cap_feats": TensorSpec((batch, seq, config.get("cap_feat_dim", 2560))),
                "return_dict": False,
            }
            cfg = " (CFG: conditional and unconditional)" if batch > images else ""
            return CallSpec("forward", kwargs,
                            description=f"{tokens} image tokens, {seq} text tokens, batch {batch}{cfg}")
        if comp.cls in TEXT_ENCODERS:
            kwargs = {
                "input_ids": TensorSpec((prompts, seq), "long"),
                "attention_mask": TensorSpec((prompts, 1, seq, seq), "bool"),
                "output_hidden_states": True,
                "use_cache": False,
            }
            return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {prompts}, all hidden states")
        return component_call(comp, inputs, latent_hw=(latent_h, latent_w), seq=seq)

    # --- run ------------------------------------------------------------------------------------

    def encode(self, pipe, job: Job, device) -> Embeds:
        """The pipeline's encode_prompt as __call__ calls it: the negative prompt ("" by default) under CFG."""
        do_cfg = job.guidance_scale > 0
        pe, npe = pipe.encode_prompt(prompt=job.prompt, device=device, do_classifier_free_guidance=do_cfg,
                                     negative_prompt=job.negative_prompt,
                                     max_sequence_length=job.max_sequence_length or self.default_max_sequence_length)
        repeat = job.num_images  # __call__ repeats the embeddings per image itself when given num_images_per_prompt
        out = {"prompt_embeds": TensorList(e for e in pe for _ in range(repeat))}
        if do_cfg:
            out["negative_prompt_embeds"] = TensorList(e for e in npe for _ in range(repeat))
        return Embeds(out)

    def decode(self, pipe, latents, job: Job, device) -> list:
        vae = pipe.vae
        latents = (latents.to(vae.dtype) / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(device), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")


FAMILY = ZImageFamily()

"""FLUX.2 [dev] (Mistral-3 encoder) and [klein] (Qwen3 encoder): intermediate hidden states as text
embeddings, a transformer on packed 2x2 latents with 4-axis position ids, a VAE with batch-norm
latent statistics.

What the pipelines feed their models (diffusers 0.42, `pipeline_flux2.py`, `pipeline_flux2_klein.py`):
- text encoder: `input_ids (B, L)` padded to `max_sequence_length` (512) with a padding mask,
  `output_hidden_states=True`; the pipeline stacks the hidden states of a few intermediate layers
  (10, 20, 30 for Mistral-3; 9, 18, 27 for Qwen3) into `(B, L, 3 * hidden)`. The trace passes the
  mask in the 4-D form transformers builds from it (the 2-D form makes transformers read tensor
  values, which meta tensors do not have).
- transformer: `hidden_states (B, H/16 * W/16, in_channels)`, `encoder_hidden_states (B, L, joint)`,
  `timestep (B,)`, `img_ids (B, N, 4)`, `txt_ids (B, L, 4)`, and `guidance (B,)` when the model
  embeds it ([dev] is guidance-distilled: one call per step, batch unchanged). [klein] with
  `is_distilled: false` and guidance > 1 runs true CFG: a second, separate call per step with the
  embeddings of an empty prompt (never a doubled batch); distilled [klein] runs one call.
- VAE: `decode(z (B, latent_channels, H/8, W/8))` after the batch-norm statistics are undone.
Reference images (`image=`) lengthen the transformer's sequence; dmap does not pass images.
"""

from __future__ import annotations

from pathlib import Path

from dm_cli.families import GUIDANCE_DISTILLED, Embeds, Family, Job, packed_latents
from dm_cli.families.calls import CallSpec, Component, TensorSpec, component_call, vae_config
from dm_cli.inputs import InputSpec

# text_encoder_out_layers defaults of the pipelines' __call__
DEFAULT_OUT_LAYERS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}
TEXT_ENCODERS = ("Mistral3ForConditionalGeneration", "Qwen3ForCausalLM")


def _model_index(comp: Component) -> dict:
    folder = getattr(comp, "folder", None)
    if folder is None:
        return {}
    from dm_cli.errors import CheckpointError
    from dm_cli.io.checkpoint import read_json_object

    try:
        return read_json_object(Path(folder).parent / "model_index.json", "model_index.json")
    except CheckpointError:
        return {}


def out_layers(pipeline_class: str, encoder_config: dict, joint_attention_dim: int | None) -> tuple[int, ...]:
    """Which hidden states the pipeline stacks: its default when the encoder has those layers, else
    as many as the transformer's `joint_attention_dim` takes, evenly spaced as the defaults are
    (40 layers -> 10, 20, 30; 36 -> 9, 18, 27; the tiny twins' 1 or 2 layers -> 1, as diffusers' tests pass)."""
    text = encoder_config.get("text_config") or encoder_config
    layers = int(text.get("num_hidden_layers", 0))
    default = DEFAULT_OUT_LAYERS.get(pipeline_class, (10, 20, 30))
    hidden = int(text.get("hidden_size", 0))
    count = joint_attention_dim // hidden if hidden and joint_attention_dim else len(default)
    if count == len(default) and max(default) <= layers:
        return default
    return tuple(max(1, layers * (i + 1) // (count + 1)) for i in range(count))


class Flux2Family(Family):
    name = "flux2"
    pipelines = ("Flux2Pipeline", "Flux2KleinPipeline")
    related = ("Flux2",)
    denoiser_classes = ("Flux2Transformer2DModel",)
    packs_latents = True
    offload_seq = "text_encoder->transformer->vae"
    guidance = GUIDANCE_DISTILLED
    default_steps = 50
    default_guidance = 4.0
    default_max_sequence_length = 512
    default_sample_size = 128
    negative_prompt = False  # [dev] takes none; [klein]'s CFG uses an empty prompt of its own
    placeholder_tensors = {"vae": ("bn.running_mean", "bn.running_var")}  # [klein]'s latent output un-normalises

    def title(self) -> str:
        return "FLUX.2"

    @staticmethod
    def true_cfg(model_index: dict, guidance_scale: float) -> bool:
        """[klein] base (not step-distilled) runs a separate unconditional call when guidance > 1."""
        return model_index.get("_class_name") == "Flux2KleinPipeline" and not model_index.get("is_distilled", False) \
            and guidance_scale > 1.0

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        factor = self.vae_scale(vae_config(comp))
        latent_h, latent_w, tokens = packed_latents(inputs, factor)
        seq = self.max_sequence_length(comp, inputs)
        images, prompts = inputs.effective_batch, inputs.batch_size
        if comp.cls in self.denoiser_classes:
            kwargs = {
                "hidden_states": TensorSpec((images, tokens, config.get("in_channels", 128))),
                "encoder_hidden_states": TensorSpec((images, seq, config.get("joint_attention_dim", 15360))),
                "timestep": TensorSpec((images,)),
                "img_ids": TensorSpec((images, tokens, 4), "long"),
                "txt_ids": TensorSpec((images, seq, 4), "long"),
                "return_dict": False,
            }
            if config.get("guidance_embeds", True):
                kwargs["guidance"] = TensorSpec((images,), "float32")
            calls = 2 if self.true_cfg(_model_index(comp), self.guidance_scale(inputs)) else 1
            return CallSpec("forward", kwargs, description=f"{tokens} image tokens, {seq} text tokens, batch {images}"
                            + (", 2 calls per step (true CFG)" if calls == 2 else ""))
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

    def _pipeline_class(self, pipe) -> str:
        return next(c.__name__ for c in type(pipe).__mro__ if c.__name__ in self.pipelines)

    def encode(self, pipe, job: Job, device) -> Embeds:
        """The pipeline's encode_prompt; for [klein]'s true CFG also the empty prompt, as __call__ does."""
        pipeline_class = self._pipeline_class(pipe)
        layers = out_layers(pipeline_class, pipe.text_encoder.config.to_dict(), pipe.transformer.config.joint_attention_dim)
        common = {"device": device, "num_images_per_prompt": job.num_images,
                  "max_sequence_length": job.max_sequence_length or self.default_max_sequence_length,
                  "text_encoder_out_layers": layers}
        prompt_embeds, _ = pipe.encode_prompt(prompt=job.prompt, **common)
        tensors = {"prompt_embeds": prompt_embeds}
        index = {"_class_name": pipeline_class, "is_distilled": dict(pipe.config).get("is_distilled", False)}
        if self.true_cfg(index, job.guidance_scale):
            tensors["negative_prompt_embeds"], _ = pipe.encode_prompt(prompt="", **common)
        return Embeds(tensors)

    def decode(self, pipe, latents, job: Job, device) -> list:
        import torch

        vae = pipe.vae
        if latents.ndim == 3:  # Flux2Pipeline's latent output is still packed: (B, tokens, channels)
            factor = pipe.vae_scale_factor
            shape = (latents.shape[0], 1, job.height // (factor * 2), job.width // (factor * 2))
            latent_ids = pipe._prepare_latent_ids(torch.zeros(shape)).to(latents.device)
            latents = pipe._unpack_latents_with_ids(latents, latent_ids)
            mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
                latents.device, latents.dtype)
            latents = pipe._unpatchify_latents(latents * std + mean)
        image = vae.decode(latents.to(device), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")


FAMILY = Flux2Family()

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

Reference images (`image=`, one or more, in order): the pipeline resizes each one larger than 1024^2 pixels down to
about that area (LANCZOS), crops it to multiples of twice the VAE scale (`reference_size`), VAE-encodes it alone
(the distribution's mode: no randomness), patchifies and packs it, and appends the tokens of all references to the
transformer's image tokens at every call (`(H/16) * (W/16)` tokens each; ids with a time coordinate 10, 20, ...);
only the generated tokens are denoised and decoded. dmap runs those VAE encodes as their own stage (`encode_image`:
IMAGE -> IMAGE_LATENTS, the VAE serving it and the decode) with the pipeline's own helpers, and the pipeline's own
__call__ denoises with them: Flux2Pipeline takes no encoded references, so the run hands it the images and, for that
call, a `prepare_image_latents` that returns the latents already encoded (`image_kwargs`). No image processor of
the text encoder is involved: Pixtral's processor (and its torchvision) serves only caption upsampling, which dmap
does not run; references go through diffusers' PIL-based `Flux2ImageProcessor`.
"""

from __future__ import annotations

import math
from pathlib import Path

from dm_cli.errors import CheckpointError, UsageError
from dm_cli.families import GUIDANCE_DISTILLED, Embeds, Family, Job, packed_latents
from dm_cli.families.calls import CallSpec, Component, TensorSpec, component_call, vae_config
from dm_cli.families.stages import image_to_image_stages
from dm_cli.inputs import Generation, InputSpec
from dm_cli.io.checkpoint import read_json_object
from dm_cli.io.input_images import open_input

# text_encoder_out_layers defaults of the pipelines' __call__
DEFAULT_OUT_LAYERS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}
TEXT_ENCODERS = ("Mistral3ForConditionalGeneration", "Qwen3ForCausalLM")
# References: the pipelines' __call__ scales a reference of more pixels down to about this area; Flux2ImageProcessor's
# check_image_input refuses a side under 64 pixels or an aspect ratio beyond 8:1. The pipelines set no limit on how
# many; BFL documents FLUX.2 multi-reference editing with up to 10 images, dmap's bound.
REFERENCE_AREA = 1024 * 1024
MIN_REFERENCE_SIDE, MAX_REFERENCE_ASPECT = 64, 8
MAX_REFERENCES = 10
# The FLUX.2 VAE's decode needs 1.2x the activations of its encode at the same pixels (bf16, traced at 512: 1.196,
# as FLUX.1's VAE): the plan traces the VAE once, for whichever of its two stages needs more (see `call_spec`).
DECODE_OVER_ENCODE = 1.2


def reference_size(width: int, height: int, vae_scale: int) -> tuple[int, int]:
    """(width, height) the pipelines encode a `width` x `height` reference at: scaled to about REFERENCE_AREA
    when larger (`Flux2ImageProcessor._resize_to_target_area`), then cropped to multiples of twice the VAE scale."""
    if width * height > REFERENCE_AREA:
        scale = math.sqrt(REFERENCE_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    multiple = vae_scale * 2
    return width // multiple * multiple, height // multiple * multiple


def tokens_per_reference(width: int, height: int, vae_scale: int) -> int:
    """Tokens one reference adds to the transformer's sequence: its latents patchified 2x2 and packed."""
    ref_w, ref_h = reference_size(width, height, vae_scale)
    return (ref_w // (2 * vae_scale)) * (ref_h // (2 * vae_scale))


def _model_index(comp: Component) -> dict:
    folder = getattr(comp, "folder", None)
    if folder is None:
        return {}
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
    max_input_images = MAX_REFERENCES  # references (`image=`), none needed
    declared_stages = image_to_image_stages(("text_encoder",))

    def title(self) -> str:
        return "FLUX.2"

    @staticmethod
    def true_cfg(model_index: dict, guidance_scale: float) -> bool:
        """[klein] base (not step-distilled) runs a separate unconditional call when guidance > 1."""
        return model_index.get("_class_name") == "Flux2KleinPipeline" and not model_index.get("is_distilled", False) \
            and guidance_scale > 1.0

    def reference_tokens(self, inputs: InputSpec, vae_config: dict | None) -> tuple[int, ...]:
        """Tokens each reference of `inputs` adds to the transformer's sequence, in order (none: ())."""
        scale = self.vae_scale(vae_config)
        return tuple(tokens_per_reference(width, height, scale) for width, height in inputs.image_sizes)

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        factor = self.vae_scale(vae_config(comp))
        latent_h, latent_w, tokens = packed_latents(inputs, factor)
        seq = self.max_sequence_length(comp, inputs)
        images, prompts = inputs.effective_batch, inputs.batch_size
        per_reference = () if inputs.weights_only else self.reference_tokens(inputs, vae_config(comp))
        if comp.cls in self.denoiser_classes:
            sequence = tokens + sum(per_reference)  # the references' tokens follow the generated ones, every call
            kwargs = {
                "hidden_states": TensorSpec((images, sequence, config.get("in_channels", 128))),
                "encoder_hidden_states": TensorSpec((images, seq, config.get("joint_attention_dim", 15360))),
                "timestep": TensorSpec((images,)),
                "img_ids": TensorSpec((images, sequence, 4), "long"),
                "txt_ids": TensorSpec((images, seq, 4), "long"),
                "return_dict": False,
            }
            if config.get("guidance_embeds", True):
                kwargs["guidance"] = TensorSpec((images,), "float32")
            calls = 2 if self.true_cfg(_model_index(comp), self.guidance_scale(inputs)) else 1
            added = (f" + {sum(per_reference)} reference tokens ({' + '.join(map(str, per_reference))})"
                     if per_reference else "")
            return CallSpec("forward", kwargs, description=f"{tokens} image tokens{added}, {seq} text tokens, "
                            f"batch {images}" + (", 2 calls per step (true CFG)" if calls == 2 else ""))
        if comp.cls in TEXT_ENCODERS:
            kwargs = {
                "input_ids": TensorSpec((prompts, seq), "long"),
                "attention_mask": TensorSpec((prompts, 1, seq, seq), "bool"),
                "output_hidden_states": True,
                "use_cache": False,
            }
            return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {prompts}, all hidden states")
        spec = component_call(comp, inputs, latent_hw=(latent_h, latent_w), seq=seq)
        if spec is not None and spec.method == "decode" and per_reference:
            # each reference is encoded alone: the largest one's encode, when it needs more than the decode
            ref_w, ref_h = max((reference_size(w, h, factor) for w, h in inputs.image_sizes), key=lambda s: s[0] * s[1])
            if ref_w * ref_h > DECODE_OVER_ENCODE * images * inputs.height * inputs.width:
                return CallSpec("encode", {"x": TensorSpec((1, 3, ref_h, ref_w)), "return_dict": False},
                                description=f"encode a {ref_w}x{ref_h} reference image")
        return spec

    # --- one generation ---------------------------------------------------------------------------

    def validate(self, generation: Generation, pipeline_class: str, denoiser_config: dict, vae_config: dict | None,
                 components: tuple[str, ...] = (), per_prompt_images: bool = False) -> None:
        """The base rules, and the pipelines' check of each reference (Flux2ImageProcessor.check_image_input)."""
        super().validate(generation, pipeline_class, denoiser_config, vae_config, components, per_prompt_images)
        for n, image in enumerate(generation.images, 1):
            width, height = image.size
            if min(width, height) < MIN_REFERENCE_SIDE:
                raise UsageError(f"FLUX.2 needs reference images of at least {MIN_REFERENCE_SIDE}x{MIN_REFERENCE_SIDE} "
                                 f"pixels, and reference {n} is {width}x{height}: give a larger image.")
            if max(width, height) > MAX_REFERENCE_ASPECT * min(width, height):
                raise UsageError(f"FLUX.2 takes reference images up to a {MAX_REFERENCE_ASPECT}:1 aspect ratio, and "
                                 f"reference {n} is {width}x{height}: crop it.")

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
        import torch  # lazy: torch (heavy, off start-up)

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

    # --- references -------------------------------------------------------------------------------

    @staticmethod
    def _condition_image(pipe, image):
        """One reference as the pipelines' __call__ prepares it (step 4): checked, scaled down to about
        REFERENCE_AREA when larger, cropped to multiples of twice the VAE scale, as a (1, 3, h, w) tensor."""
        processor = pipe.image_processor
        processor.check_image_input(image)
        if image.width * image.height > REFERENCE_AREA:
            image = processor._resize_to_target_area(image, REFERENCE_AREA)
        multiple = pipe.vae_scale_factor * 2
        width, height = image.width // multiple * multiple, image.height // multiple * multiple
        return processor.preprocess(image, height=height, width=width, resize_mode="crop")

    def encode_image(self, pipe, job: Job, device):
        """The references VAE-encoded, patchified and packed by the pipeline's own `prepare_image_latents`:
        (1, tokens of all references, channels); no reference: an empty tensor."""
        import torch  # lazy: torch (heavy, off start-up)

        if not job.images:
            return torch.zeros(0)
        condition = [self._condition_image(pipe, open_input(image)) for image in job.images]
        latents, _ = pipe.prepare_image_latents(images=condition, batch_size=1, generator=None, device=device,
                                                dtype=pipe.vae.dtype)  # the distribution's mode: no generator draw
        return latents

    def call_kwargs(self, pipe, job: Job) -> dict:
        """Guidance and settings; with references, the images themselves (the pipeline sizes its call by them),
        and until `image_kwargs` hands over their latents, a `prepare_image_latents` that refuses: a plan without
        an encode_image stage (made before FLUX.2 took references) has nowhere to encode them."""
        kwargs = super().call_kwargs(pipe, job)
        pipe.__dict__.pop("prepare_image_latents", None)  # a previous job's latents never reach this one
        if job.images:
            def unplanned(**_):
                raise UsageError("This plan has no encode_image stage for FLUX.2's reference images: plan again "
                                 "with dmap plan (it adds one), or run without --device-map.")

            pipe.prepare_image_latents = unplanned
            kwargs["image"] = [open_input(image) for image in job.images]
        return kwargs

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The encoded references for this call: the pipeline's __call__ asks `prepare_image_latents` for them
        (and their ids) after drawing its noise, and gets what the encode_image stage made, repeated per image."""
        import torch  # lazy: torch (heavy, off start-up)

        if not image_latents.numel():
            return {}
        factor = pipe.vae_scale_factor
        shapes = [reference_size(image.width, image.height, factor) for image in job.images]
        ids = pipe._prepare_image_ids([torch.empty(1, 1, h // (2 * factor), w // (2 * factor)) for w, h in shapes])

        def encoded(images, batch_size, generator, device, dtype):
            return image_latents.repeat(batch_size, 1, 1).to(device), ids.repeat(batch_size, 1, 1).to(device)

        pipe.prepare_image_latents = encoded
        return {}


FAMILY = Flux2Family()

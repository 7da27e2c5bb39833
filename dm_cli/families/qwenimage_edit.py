"""Qwen-Image around input images: Qwen-Image-Edit (QwenImageEditPipeline, one image), Qwen-Image-Edit-2509/2511
(QwenImageEditPlusPipeline, 1 to 3 images) and Qwen-Image image-to-image (QwenImageImg2ImgPipeline, --strength), on
Qwen-Image's models and run (qwenimage.py).

Editing resizes each image twice. For Qwen2.5-VL to about CONDITION_IMAGE_SIZE pixels (384² in Plus; Edit uses the
VAE's size), turned into vision tokens by the processor, written into the prompt ("Picture 1: <|vision_start|>...")
and run through the text encoder; and for the VAE to about VAE_IMAGE_SIZE pixels (1024²), encoded (the distribution's
mode: no randomness), packed 2x2 and appended to the transformer's image tokens at every call (`img_shapes` lists
them after the output's). dmap encodes the prompt with its images in `encode`, runs the VAE encodes as their own stage
(`encode_image`: IMAGE -> IMAGE_LATENTS), and denoises with the pipeline's own __call__ on a view of the pipeline whose
`_encode_vae_image` hands those latents back (`denoising_pipeline`): sizes, packing and ids stay the pipeline's, and
the pixels are `QwenImageEditPlusPipeline(...)(image=[...], prompt=..., generator=...)`'s.

Image to image resizes the image to the output size, VAE-samples it (the generator's first draw) and noises it to the
step `strength` leaves (the second), in the encode_image stage as FLUX.1 image-to-image does (flux_img2img.py), and
hands the noised latents to __call__ as `latents`.

The run reads the sizes from the pipeline's module, its constants and calculate_dimensions (a test may shrink them for
dmap and diffusers alike);
plans use the copies here, which tests/families/test_qwen_edit.py checks against diffusers'. No torch at import.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import replace

from dm_cli.families import Embeds, Job, Setting
from dm_cli.families.calls import CallSpec, Component, TensorSpec, sibling_config, vae_config
from dm_cli.families.flux_img2img import DEFAULT_STRENGTH, noised_image_latents, strength_refusal
from dm_cli.families.qwenimage import QwenImageFamily
from dm_cli.families.stages import image_to_image_stages
from dm_cli.inputs import Generation, InputSpec
from dm_cli.io.input_images import open_input

# diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus's CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE, and the 1024²
# area both edit pipelines make their default output size of
CONDITION_IMAGE_SIZE = 384 * 384
VAE_IMAGE_SIZE = 1024 * 1024
# The edit pipelines' prompt template: the system part and "<|im_start|>user\n" (prompt_template_encode_start_idx,
# dropped after encoding), and the "<|im_end|>\n<|im_start|>assistant\n" after the prompt
EDIT_TEMPLATE_TOKENS = 64
EDIT_SUFFIX_TOKENS = 5
# Per image, Plus writes "Picture N: " (4 tokens) and the vision tokens between <|vision_start|> and <|vision_end|>
PICTURE_TOKENS = 6
# Qwen2.5-VL-7B's image processor (processor/preprocessor_config.json): the bounds of its smart resize
VISION_MIN_PIXELS, VISION_MAX_PIXELS = 3136, 12845056


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) the edit pipelines resize an image of aspect `ratio` to: about `target_area` pixels, each side a
    multiple of 32 (their calculate_dimensions)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def smart_resize(height: int, width: int, factor: int, min_pixels: int = VISION_MIN_PIXELS,
                 max_pixels: int = VISION_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) Qwen2-VL's image processor resizes to: multiples of `factor` (patch x merge) within the pixel
    bounds, the aspect ratio kept (transformers' smart_resize)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vision_tokens(width: int, height: int, vision: dict) -> int:
    """Tokens Qwen2.5-VL's vision tower gives the text encoder for a width x height image (after the merge)."""
    patch, merge = int(vision.get("patch_size", 14)), int(vision.get("spatial_merge_size", 2))
    h_bar, w_bar = smart_resize(height, width, patch * merge)
    return (h_bar // patch) * (w_bar // patch) // (merge * merge)


def reference_tokens(width: int, height: int, vae_scale: int) -> int:
    """Tokens one image adds to the transformer's sequence: its VAE-size latents packed 2x2."""
    vae_w, vae_h = calculate_dimensions(VAE_IMAGE_SIZE, width / height)
    return (vae_h // vae_scale // 2) * (vae_w // vae_scale // 2)


def pipeline_module(pipe):
    """The diffusers module of the pipeline's class (dmap's pipeline is a subclass of it: dm_cli.run.load.loading)."""
    for cls in type(pipe).__mro__:
        if cls.__module__.startswith("diffusers."):
            return sys.modules[cls.__module__]
    return None


def pipeline_dimensions(pipe, area_name: str, ratio: float) -> tuple[int, int]:
    """(width, height) for an image of aspect `ratio` as the pipeline's module computes them now: its own
    calculate_dimensions and its constant `area_name` (Edit's module has no constants: it asks for 1024²)."""
    module = pipeline_module(pipe)
    area = getattr(module, area_name, VAE_IMAGE_SIZE)  # Edit's module: 1024² for both (its condition is the VAE's)
    calculate = getattr(module, "calculate_dimensions", calculate_dimensions)
    return tuple(calculate(area, ratio)[:2])


class QwenImageEditPlusFamily(QwenImageFamily):
    name = "qwen-image-edit-plus"
    pipelines = ("QwenImageEditPlusPipeline",)
    related = ()
    max_input_images = 3
    min_input_images = 1
    declared_stages = image_to_image_stages(("text_encoder",))
    plus = True  # several images, "Picture N:" prompts, vision tokens at CONDITION_IMAGE_SIZE, one image per prompt

    def title(self) -> str:
        return "Qwen-Image-Edit-Plus" if self.plus else "Qwen-Image-Edit"

    def matches(self, pipeline_class, component_cls, config) -> bool:
        """By pipeline class only: a lone Qwen-Image transformer stays Qwen-Image's (text to image)."""
        return bool(pipeline_class) and super().matches(pipeline_class, component_cls, config)

    # --- sizes ----------------------------------------------------------------------------------

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image goes to Qwen2.5-VL at: Plus about 384² pixels; Edit the VAE's size."""
        return calculate_dimensions(CONDITION_IMAGE_SIZE if self.plus else VAE_IMAGE_SIZE, width / height)

    def tokens_per_reference(self, inputs: InputSpec, vae_scale: int) -> tuple[int, ...]:
        """Tokens each image of `inputs` adds to the transformer's sequence, in order (none: ())."""
        return tuple(reference_tokens(width, height, vae_scale) for width, height in inputs.image_sizes)

    def reference_tokens(self, inputs: InputSpec, vae_config: dict | None) -> tuple[int, ...]:
        """Tokens each image adds to the transformer's sequence (what `dmap plan` reports and trims to fit)."""
        return self.tokens_per_reference(inputs, self.vae_scale(vae_config))

    def prompt_image_tokens(self, inputs: InputSpec, encoder: dict) -> tuple[int, ...]:
        """Tokens each image adds to the prompt: its vision tokens and the words and markers around them."""
        vision = encoder.get("vision_config") or {}
        around = PICTURE_TOKENS if self.plus else 2
        return tuple(vision_tokens(*self.condition_size(w, h), vision) + around for w, h in inputs.image_sizes)

    # --- the tracer's view ------------------------------------------------------------------------

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        spec = super().call_spec(comp, inputs)
        if spec is None or inputs.weights_only or not inputs.image_sizes:
            return spec
        factor = self.vae_scale(vae_config(comp))
        per_reference = self.tokens_per_reference(inputs, factor)
        if comp.cls in self.denoiser_classes:
            encoder = sibling_config(comp, "text_encoder") or {}
            prompt_images = self.prompt_image_tokens(inputs, encoder)
            kwargs = dict(spec.kwargs)
            images, tokens, channels = kwargs["hidden_states"].shape
            batch, seq, width = kwargs["encoder_hidden_states"].shape
            kwargs["hidden_states"] = TensorSpec((images, tokens + sum(per_reference), channels))
            kwargs["encoder_hidden_states"] = TensorSpec((batch, seq + sum(prompt_images), width))
            refs = [(1, h // factor // 2, w // factor // 2)
                    for w, h in (calculate_dimensions(VAE_IMAGE_SIZE, w / h) for w, h in inputs.image_sizes)]
            kwargs["img_shapes"] = [[*kwargs["img_shapes"][0], *refs]] * images
            added = f" + {sum(per_reference)} reference tokens ({' + '.join(map(str, per_reference))})"
            return CallSpec("forward", kwargs, description=f"{tokens} image tokens{added}, {seq + sum(prompt_images)} "
                                                           f"text tokens, batch {images}, 2 calls per step (true CFG)")
        if comp.cls.startswith("Qwen2_5_VL"):
            prompt_images = self.prompt_image_tokens(inputs, comp.config or {})
            seq = self.max_sequence_length(comp, inputs)
            length = EDIT_TEMPLATE_TOKENS + seq + sum(prompt_images) + EDIT_SUFFIX_TOKENS
            kwargs = dict(spec.kwargs, input_ids=TensorSpec((inputs.batch_size, length), "long"))
            return CallSpec("forward", kwargs, description=f"{length} tokens ({' + '.join(map(str, prompt_images))} for "
                                                           f"the images), batch {inputs.batch_size}")
        if spec.method == "decode":
            vae_w, vae_h = max((calculate_dimensions(VAE_IMAGE_SIZE, w / h) for w, h in inputs.image_sizes),
                               key=lambda size: size[0] * size[1])
            if vae_w * vae_h > inputs.effective_batch * inputs.height * inputs.width:
                # the encode of a reference larger than the output needs more than the decode: trace that
                return CallSpec("encode", {"x": TensorSpec((1, 3, 1, vae_h, vae_w)), "return_dict": False},
                                description=f"encode a {vae_w}x{vae_h} image")
        return spec

    # --- one generation ---------------------------------------------------------------------------

    def settle(self, generation: Generation, denoiser_config: dict, vae_config: dict | None,
               defaults: dict | None = None) -> Generation:
        """Qwen-Image's defaults; without a size given (or a plan's), the pipeline's: the aspect ratio of the last
        image (Plus; Edit: its one image) at about 1024² pixels."""
        settled = super().settle(generation, denoiser_config, vae_config, defaults)
        given = generation.height is not None or generation.width is not None or (defaults or {}).get("height")
        if given or not generation.images:
            return settled
        image = generation.images[-1] if self.plus else generation.images[0]
        width, height = calculate_dimensions(VAE_IMAGE_SIZE, image.width / image.height)
        multiple = self.size_multiple(denoiser_config, vae_config)
        return replace(settled, height=height // multiple * multiple, width=width // multiple * multiple)

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        refused = super().refusal(generation, components)
        if refused:
            return refused
        for image in generation.images:
            sizes = (self.condition_size(image.width, image.height), calculate_dimensions(VAE_IMAGE_SIZE,
                                                                                          image.width / image.height))
            if any(0 in size or max(size) > 200 * min(size) for size in sizes):
                return (f"{self.title()} resizes each input image to about {math.isqrt(CONDITION_IMAGE_SIZE)}² pixels "
                        f"for Qwen2.5-VL, which leaves a {image.width}x{image.height} image no usable side: use an "
                        "image less than about 1:150 in aspect ratio.")
        if self.plus and (generation.num_images or 1) > 1:
            return (f"{self.title()} (QwenImageEditPlusPipeline) makes one image per prompt: drop --num-images, or run "
                    "the prompt again with another --seed.")
        return None

    # --- run --------------------------------------------------------------------------------------

    def images(self, pipe, job: Job) -> list:
        """The job's images, read as diffusers' load_image reads them."""
        return [open_input(image) for image in job.images]

    def condition_images(self, pipe, job: Job) -> list:
        """The images as the pipeline resizes them for Qwen2.5-VL (its __call__, step 3)."""
        out = []
        for image in self.images(pipe, job):
            width, height = pipeline_dimensions(pipe, "CONDITION_IMAGE_SIZE", image.width / image.height)
            out.append(pipe.image_processor.resize(image, height, width))
        return out

    def encode(self, pipe, job: Job, device) -> Embeds:
        """The pipeline's own encode_prompt with the images' vision tokens (Plus: a list; Edit: its one image)."""
        images = self.condition_images(pipe, job)
        image = images if self.plus else images[0]
        max_seq = job.max_sequence_length or self.default_max_sequence_length
        pe, mask = pipe.encode_prompt(prompt=job.prompt, image=image, device=device, num_images_per_prompt=job.num_images,
                                      max_sequence_length=max_seq)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if self.true_cfg(job):
            npe, nmask = pipe.encode_prompt(prompt=job.negative_prompt, image=image, device=device,
                                            num_images_per_prompt=job.num_images, max_sequence_length=max_seq)
            out.update(negative_prompt_embeds=npe, negative_prompt_embeds_mask=nmask)
        return Embeds(out)

    def vae_images(self, pipe, job: Job) -> list:
        """The images as the pipeline prepares them for its VAE: (1, 3, 1, H, W) tensors at about VAE_IMAGE_SIZE."""
        out = []
        for image in self.images(pipe, job):
            width, height = pipeline_dimensions(pipe, "VAE_IMAGE_SIZE", image.width / image.height)
            if not self.plus:  # Edit resizes first, then preprocesses the resized image
                image = pipe.image_processor.resize(image, height, width)
            out.append(pipe.image_processor.preprocess(image, height, width).unsqueeze(2))
        return out

    def encode_image(self, pipe, job: Job, device):
        """Each image VAE-encoded as the pipeline's prepare_latents does (its own `_encode_vae_image`: the mode,
        normalised), flattened and joined in order into one tensor (`denoising_pipeline` cuts it up again)."""
        import torch  # lazy: torch (heavy, off start-up)

        latents = [pipe._encode_vae_image(image=image.to(device=device, dtype=pipe.vae.dtype), generator=None)
                   for image in self.vae_images(pipe, job)]
        return torch.cat([latent.flatten() for latent in latents])

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The images themselves: the pipeline reads their sizes (output size, `img_shapes`) and resizes them; their
        latents come from `denoising_pipeline`'s encode, not the VAE."""
        images = self.images(pipe, job)
        return {"image": images if self.plus else images[0]}

    def denoising_pipeline(self, pipe, job: Job, image_latents=None):
        """A shallow copy of the pipeline (the same components) whose `_encode_vae_image` gives back the encode_image
        stage's latents, in the order the pipeline asks for them, shaped as the VAE would give them."""
        if image_latents is None:
            return pipe
        view = copy.copy(pipe)
        state = {"offset": 0}
        channels, factor = pipe.latent_channels, pipe.vae_scale_factor

        def encoded(image, generator=None):
            shape = (image.shape[0], channels, 1, image.shape[-2] // factor, image.shape[-1] // factor)
            count = math.prod(shape)
            start = state["offset"]
            if start + count > image_latents.numel():
                raise RuntimeError("the pipeline asked for more image latents than the encode_image stage made")
            state["offset"] = start + count
            return image_latents[start:start + count].view(shape).to(image.device)

        view._encode_vae_image = encoded
        return view


class QwenImageEditFamily(QwenImageEditPlusFamily):
    name = "qwen-image-edit"
    pipelines = ("QwenImageEditPipeline",)
    max_input_images = 1
    plus = False


class QwenImageImg2ImgFamily(QwenImageFamily):
    name = "qwen-image-img2img"
    pipelines = ("QwenImageImg2ImgPipeline",)
    related = ()
    max_input_images = 1
    min_input_images = 1
    settings = (*QwenImageFamily.settings,
                Setting("strength", float, DEFAULT_STRENGTH, "How far image-to-image departs from the input image: 0 "
                        "keeps it, 1 ignores it (the pipeline runs about steps x strength steps).",
                        for_whom="image-to-image pipelines (FluxImg2ImgPipeline, QwenImageImg2ImgPipeline)",
                        instead="drop --strength, or run an image-to-image folder (flux-dev-img2img, qwen-image-img2img)"))
    declared_stages = image_to_image_stages(("text_encoder",))

    def title(self) -> str:
        return "Qwen-Image image-to-image"

    def matches(self, pipeline_class, component_cls, config) -> bool:
        return bool(pipeline_class) and super().matches(pipeline_class, component_cls, config)

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        return super().refusal(generation, components) or strength_refusal(generation)

    def call_kwargs(self, pipe, job: Job) -> dict:
        return {**super().call_kwargs(pipe, job), "strength": job.setting("strength", DEFAULT_STRENGTH)}

    def encode_image(self, pipe, job: Job, device):
        """The input image noised to the first step `strength` leaves, as QwenImageImg2ImgPipeline.__call__ does."""
        # lazy: diffusers (heavy, off start-up)
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import calculate_shift, retrieve_timesteps

        return noised_image_latents(pipe, job, device, calculate_shift, retrieve_timesteps)

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The prepared latents as `latents` (taken as they are, nothing drawn); the image only for the pipeline's
        preprocess, whose result its prepare_latents then leaves alone."""
        return {"latents": image_latents, "image": open_input(job.images[0])}


FAMILIES = (QwenImageEditPlusFamily(), QwenImageEditFamily(), QwenImageImg2ImgFamily())
FAMILY = FAMILIES[0]

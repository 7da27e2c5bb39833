"""FLUX.1 Kontext [dev] (FluxKontextPipeline): FLUX.1 that edits a reference image.

The pipeline resizes the reference (to the preferred Kontext resolution of its aspect ratio, `_auto_resize`),
VAE-encodes it (the distribution's mode: no randomness), packs it into tokens and appends them to the
denoiser's image tokens at every step (image ids with a first coordinate 1); only the generated tokens are
denoised and decoded. dmap runs the encode as its own stage (`encode_image`: IMAGE -> IMAGE_LATENTS, the VAE
serving it and the decode) and hands the latents to the pipeline's own __call__ as `image` (a tensor with the
VAE's latent channels is taken as encoded, not encoded again): pixel-identical to
`FluxKontextPipeline(...)(prompt, image=..., generator=...)`. Without an image it denoises from text alone, as
the pipeline does.

The output size: Kontext's __call__ resizes height x width to about `max_area` pixels (multiples of 16); dmap
refuses a size the pipeline would change (`refusal`) rather than make another one than asked, and names one
it keeps. No torch at import.
"""

from __future__ import annotations

from dataclasses import replace

from dm_cli.errors import UsageError
from dm_cli.families import Job, Setting
from dm_cli.families.calls import CallSpec, Component, TensorSpec, vae_config
from dm_cli.families.flux import FluxFamily
from dm_cli.families.stages import image_to_image_stages
from dm_cli.inputs import LIMITS, Generation, InputSpec
from dm_cli.io.input_images import open_input

# diffusers.pipelines.flux.pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS as (width, height), copied so
# that plans need no diffusers import; tests/families/test_flux_edit.py checks they are the pipeline's.
PREFERRED_KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)
DEFAULT_MAX_AREA = 1024**2  # FluxKontextPipeline.__call__'s max_area
# The FLUX.1 VAE's decode needs 1.19x the activations of its encode at the same pixels (bf16, traced at 512 and
# 1024): the plan traces the VAE once, for whichever of its two stages needs more (see `call_spec`).
DECODE_OVER_ENCODE = 1.2


def reference_size(width: int, height: int, vae_scale: int, auto_resize: bool = True) -> tuple[int, int]:
    """(width, height) FluxKontextPipeline resizes a `width` x `height` reference to: rounded down to the image
    processor's multiple (twice the VAE scale), then (auto_resize) the preferred Kontext resolution of the
    nearest aspect ratio, then rounded down to the packing multiple (twice the VAE scale)."""
    multiple = vae_scale * 2
    width, height = width - width % multiple, height - height % multiple  # get_default_height_width
    if auto_resize:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return width // multiple * multiple, height // multiple * multiple


def output_size(height: int, width: int, max_area: int, vae_scale: int) -> tuple[int, int]:
    """(height, width) FluxKontextPipeline.__call__ generates for a requested height x width: the same aspect
    ratio at about `max_area` pixels, each side rounded down to twice the VAE scale."""
    multiple = vae_scale * 2
    aspect = width / height
    new_width, new_height = round((max_area * aspect) ** 0.5), round((max_area / aspect) ** 0.5)
    return new_height // multiple * multiple, new_width // multiple * multiple


def kept_size(height: int, width: int, max_area: int, vae_scale: int) -> tuple[int, int]:
    """The size nearest the pipeline's resize of height x width that its resize keeps (applied until it stays)."""
    size = (height, width)
    for _ in range(64):  # it settles within 9 for every multiple of 16 up to 4096 a side
        nxt = output_size(*size, max_area, vae_scale)
        if nxt == size or 0 in nxt:
            break
        size = nxt
    return size


class FluxKontextFamily(FluxFamily):
    name = "flux-kontext"
    pipelines = ("FluxKontextPipeline",)
    related = ()  # FluxKontextInpaintPipeline and the others stay FLUX's (traced, not run)
    max_input_images = 1
    settings = (
        Setting("max_area", int, DEFAULT_MAX_AREA, "Pixels FLUX.1 Kontext generates (height x width are resized to "
                "about this many, keeping their aspect ratio).", for_whom="FLUX.1 Kontext (FluxKontextPipeline)",
                instead="drop --max-area"),
        Setting("auto_resize", bool, True, "Resize the reference image to the preferred FLUX.1 Kontext resolution of "
                "its aspect ratio, as the pipeline does (default); --no-auto-resize keeps its size (rounded down to a "
                "multiple of 16).",
                argument="_auto_resize", for_whom="FLUX.1 Kontext (FluxKontextPipeline)", instead="drop --auto-resize / --no-auto-resize"),
    )
    declared_stages = image_to_image_stages(("text_encoder", "text_encoder_2"))

    step_caches = {}  # its pipeline sets no cache_context, which diffusers' cache hooks need

    def title(self) -> str:
        return "FLUX.1 Kontext"

    # --- the tracer's view ------------------------------------------------------------------------

    def reference_geometry(self, inputs: InputSpec, factor: int) -> tuple[int, int, int]:
        """(reference width, height, packed tokens) of the reference as the pipeline resizes it (no image: 0s).
        The plan sees the default resize (auto_resize on): InputSpec carries no family settings."""
        if not inputs.image_sizes:
            return 0, 0, 0
        width, height = reference_size(*inputs.image_sizes[0], factor)
        return width, height, (height // factor // 2) * (width // factor // 2)

    def reference_tokens(self, inputs: InputSpec, vae_config: dict | None) -> tuple[int, ...]:
        """The one reference's packed tokens, appended to the generated ones (Family.reference_tokens)."""
        tokens = self.reference_geometry(inputs, self.vae_scale(vae_config))[2]
        return (tokens,) if tokens else ()

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        spec = super().call_spec(comp, inputs)
        if spec is None or inputs.weights_only or not inputs.image_sizes:
            return spec  # without a reference, Kontext is FLUX.1's text-to-image call
        factor = self.vae_scale(vae_config(comp))
        ref_w, ref_h, ref_tokens = self.reference_geometry(inputs, factor)
        if comp.cls in self.denoiser_classes:
            kwargs = dict(spec.kwargs)
            images, tokens, channels = kwargs["hidden_states"].shape
            kwargs["hidden_states"] = TensorSpec((images, tokens + ref_tokens, channels))
            kwargs["img_ids"] = TensorSpec((tokens + ref_tokens, 3))
            return CallSpec("forward", kwargs, description=f"{tokens} image tokens + {ref_tokens} reference tokens, "
                                                           f"{spec.description.split(', ', 1)[1]}")
        if spec.method == "decode" and ref_w * ref_h > DECODE_OVER_ENCODE * inputs.effective_batch * (
                inputs.height * inputs.width):
            # the encode of a reference larger than the output needs more than the decode: trace that
            return CallSpec("encode", {"x": TensorSpec((1, 3, ref_h, ref_w)), "return_dict": False},
                            description=f"encode a {ref_w}x{ref_h} reference image")
        return spec

    # --- one generation ---------------------------------------------------------------------------

    def settle(self, generation: Generation, denoiser_config: dict, vae_config: dict | None,
               defaults: dict | None = None) -> Generation:
        """FLUX's defaults; without a size given (or a plan's), a square the pipeline keeps at `max_area`."""
        settled = super().settle(generation, denoiser_config, vae_config, defaults)
        given = generation.height is not None or generation.width is not None or (defaults or {}).get("height")
        if given or settled.weights_only:
            return settled
        side = settled.setting("max_area", DEFAULT_MAX_AREA)
        if not isinstance(side, int) or isinstance(side, bool) or side < 1:
            return settled  # refused by `refusal`
        height, width = kept_size(settled.height, settled.width, side, self.vae_scale(vae_config))
        return replace(settled, height=height or settled.height, width=width or settled.width)

    def validate(self, generation: Generation, pipeline_class: str, denoiser_config: dict, vae_config: dict | None,
                 components: tuple[str, ...] = (), per_prompt_images: bool = False) -> None:
        super().validate(generation, pipeline_class, denoiser_config, vae_config, components, per_prompt_images)
        if generation.weights_only:
            return
        factor = self.vae_scale(vae_config)
        area = generation.setting("max_area", DEFAULT_MAX_AREA)
        height, width = generation.height, generation.width
        if output_size(height, width, area, factor) != (height, width):
            new_h, new_w = kept_size(height, width, area, factor)
            raise UsageError(f"FLUX.1 Kontext resizes its output to about --max-area {area} pixels, so {height}x{width} "
                             f"would come out another size: ask for --height {new_h} --width {new_w}, or keep "
                             f"{height}x{width} with --max-area {height * width}.")
        for image in generation.images:
            ref = reference_size(image.width, image.height, factor, bool(generation.setting("auto_resize", True)))
            if 0 in ref:
                raise UsageError(f"FLUX.1 Kontext needs a reference image of at least {2 * factor}x{2 * factor} "
                                 f"pixels, not {image.width}x{image.height}.")

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        refused = super().refusal(generation, components)
        if refused:
            return refused
        area = generation.setting("max_area", DEFAULT_MAX_AREA)  # auto_resize: a bool, checked by its Setting
        if area is not None and not 1 <= area <= LIMITS["height"] * LIMITS["width"]:
            return f"--max-area must be from 1 to {LIMITS['height'] * LIMITS['width']} pixels, not {area}."
        return None

    # --- run --------------------------------------------------------------------------------------

    def encode_image(self, pipe, job: Job, device):
        """The reference resized and VAE-encoded as FluxKontextPipeline.prepare_latents does (unpacked latents,
        shifted and scaled); no reference: an empty tensor (the denoise then runs from text alone)."""
        import torch  # lazy: torch (heavy, off start-up)

        if not job.images:
            return torch.zeros(0)
        image = open_input(job.images[0])
        width, height = reference_size(image.width, image.height, pipe.vae_scale_factor,
                                       bool(job.setting("auto_resize", True)))
        image = pipe.image_processor.resize(image, height, width)
        image = pipe.image_processor.preprocess(image, height, width)
        image = image.to(device=device, dtype=pipe.vae.dtype)  # prompt_embeds' dtype in the pipeline: the run's
        return pipe._encode_vae_image(image=image, generator=None)  # the distribution's mode: no generator draw

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        return {"image": image_latents} if image_latents.numel() else {}

    def call_kwargs(self, pipe, job: Job) -> dict:
        """Guidance and the settings; `max_area` as the settled size, which the pipeline's resize then keeps."""
        kwargs = super().call_kwargs(pipe, job)
        kwargs["max_area"] = job.height * job.width
        return kwargs


FAMILY = FluxKontextFamily()

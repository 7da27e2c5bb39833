"""Pipeline families: everything dmap knows about one kind of diffusers pipeline, in one module each.

A family (a `Family` subclass, one instance `FAMILY` per module listed in `FAMILY_MODULES`) owns:
which pipeline and denoiser classes it matches; what the pipeline feeds each component for given
inputs (the tracer's `CallSpec`s, including how guidance multiplies denoiser calls); its defaults
(steps, guidance, sequence length, image size and multiple); its stages (diffusers'
`model_cpu_offload_seq`); and, for `dmap run`, how to encode a prompt to embeddings, which extra
arguments the pipeline's own `__call__` needs to denoise from them, and how to decode latents.

The tracer, planner and runner ask `family_for(...)` and never name a pipeline themselves. A
pipeline no family matches still gets inspect and a weights-only (or generic-trace) plan.
No torch at import: families are read by warm `inspect`/`plan` runs, which must not import it.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.families.calls import CallSpec, Component, block_scale, component_call
from dm_cli.families.stages import declared, default_stages
from dm_cli.inputs import SCALES, Generation, InputSpec, check_number, check_scale, check_text, read_through
from dm_cli.units import shorten

# One module per family, in the order they are asked: the first that matches wins, so a family whose
# `related` prefix is a prefix of another's (Flux of Flux2, FluxKontext, FluxImg2Img; StableDiffusion of
# StableDiffusion3) comes after it.
FAMILY_MODULES = ("sd3", "sdxl", "sd15", "flux2", "flux_kontext", "flux_img2img", "flux", "qwenimage_edit", "qwenimage", "wan_i2v", "wan", "zimage", "ltx2")

# How guidance multiplies the denoiser's work per step.
GUIDANCE_BATCH = "batch"  # classifier-free guidance: one call on a doubled batch (SD, SDXL, SD3)
GUIDANCE_SEPARATE = "separate"  # true CFG: a second call per step with the negative prompt (Qwen-Image)
GUIDANCE_DISTILLED = "distilled"  # guidance is an input of the model: one call, batch unchanged (FLUX)

DENOISER_NAMES = ("transformer", "unet", "prior", "decoder")


@dataclass(frozen=True)
class Setting:
    """A setting a family adds to its generations (Qwen-Image's true_cfg_scale, Wan 2.2's guidance_scale_2).

    Declared once in the family module, it becomes an option of `dmap plan` and `dmap run`, a keyword of
    `dm_cli.plan`, `dm_cli.load` and `Session.generate`, a queue JSONL key, an image metadata entry and part
    of the resume key, and it reaches the pipeline's __call__ as `argument`.
    """

    name: str
    type: type = float  # float, int, str or bool (a bool is an on/off pair of flags: --NAME / --no-NAME)
    default: object = None  # None: not passed, the pipeline's own default applies
    help: str = ""
    argument: str | None = None  # the pipeline __call__ keyword (None: `name`)
    for_whom: str = ""  # refusing it elsewhere: "--NAME is for <for_whom>, not FLUX: <instead>."
    instead: str = ""
    needs_component: str | None = None  # a component the pipeline must have for it (Wan 2.2's transformer_2)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> str:
        """The command-line declaration: `--NAME`, or `--NAME/--no-NAME` for a bool."""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.type is bool else self.flag

    def check(self, value, where: str | None = None):
        """`value` as this setting's type (a float: `dm_cli.inputs.check_number`'s bounds, shared with every number
        a request carries; a str: encodable text), else UsageError naming `where`."""
        where = where or self.flag
        if self.type is bool:
            if not isinstance(value, bool):
                raise UsageError(f"{where} must be true or false, not {shorten(value, quote=True)}.")
            return value
        if self.type is str:
            return check_text(value, where)
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{where} must be a whole number, not {shorten(value, quote=True)}.")
            return value
        # a scale from 0 (true_cfg_scale, guidance_scale_2), any other number within what every dtype holds
        return check_scale(value, where) if self.name in SCALES else check_number(value, where)


@dataclass(frozen=True)
class Job:
    """One generation, with every default settled: what a stage needs to encode, denoise or decode. Its settings are
    the settled `Generation` it was made from, held whole and read through the properties below, so that the
    request, the settled run and the job share one record of them."""

    prompt: str
    seed: int
    generation: Generation  # settled: every default filled in (Family.settle)

    negative_prompt = read_through("generation", "negative_prompt")
    steps = read_through("generation", "steps")
    guidance_scale = read_through("generation", "guidance_scale")
    height = read_through("generation", "height")
    width = read_through("generation", "width")
    num_images = read_through("generation", "num_images")
    max_sequence_length = read_through("generation", "max_sequence_length")
    num_frames = read_through("generation", "num_frames")  # video families only
    settings = read_through("generation", "settings")  # the family's own settings (Family.settings), given or default
    images = read_through("generation", "images")  # input images, in order (read with dm_cli.io.input_images.read_image)
    last_image = read_through("generation", "last_image")  # a first-last-frame video's last frame (Wan 2.2 image-to-video)
    loras = read_through("generation", "loras")  # the LoRA adapters this job runs with (settled, in order)

    def setting(self, name: str, default=None):
        return self.generation.setting(name, default)

    @classmethod
    def of(cls, generation: Generation, prompt: str, seed: int) -> "Job":
        """The job of a settled generation."""
        return cls(prompt=prompt, seed=seed, generation=generation)


def denormalized(vae, latents):
    """Undo the per-channel latents_mean/latents_std of a Wan-style VAE, exactly as WanPipeline and
    QwenImagePipeline do (dividing by 1 / std, for the same bits)."""
    import torch  # lazy: torch (heavy, off start-up)

    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    return latents / inverse_std + mean


@dataclass
class Embeds:
    """What encode hands to denoise: keyword arguments of the pipeline's __call__ (prompt_embeds, ...)."""

    tensors: dict


def packed_latents(inputs: InputSpec, factor: int) -> tuple[int, int, int]:
    """(latent height, latent width, tokens) of 2x2-packed latents, as FLUX-style pipelines compute
    them: each side 2 * (size // (factor * 2)), one token per 2x2 patch."""
    latent_h, latent_w = 2 * (inputs.height // (factor * 2)), 2 * (inputs.width // (factor * 2))
    return latent_h, latent_w, (latent_h // 2) * (latent_w // 2)


def check_video_length(inputs: InputSpec, temporal: int, model: str) -> None:
    """A video family's rule on --frames (t*k + 1, t the VAE's temporal compression) and --fps, one sentence each."""
    frames = inputs.num_frames
    if frames is not None and frames < 1:
        raise UsageError(f"--frames must be at least 1 (got {frames}).")
    if frames is not None and (frames - 1) % temporal:
        lower = frames - (frames - 1) % temporal
        raise UsageError(f"--frames {frames} is not {temporal}k+1, which {model} needs (its VAE compresses {temporal} "
                         f"frames into one): use {max(lower, 1)} or {lower + temporal}.")
    if inputs.fps is not None and inputs.fps < 1:
        raise UsageError(f"--fps must be at least 1 (got {inputs.fps}).")


def pooled_embeds(do_cfg: bool, pe, npe, ppe, nppe) -> Embeds:
    """__call__ arguments from an encode_prompt that returns pooled embeddings (SDXL, SD3), negatives under CFG."""
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
    if do_cfg:
        out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    return Embeds(out)


class Family:
    """What dmap knows about one pipeline family. Subclasses set the attributes and implement
    `call_spec`, `encode` and `decode`; the rest has defaults that fit most diffusers pipelines."""

    name: str = ""
    denoiser: str = "transformer"  # the component that denoises (the denoise stage)
    experts: tuple[str, ...] = ()  # more denoisers taking turns with `denoiser` at switch steps (Wan 2.2's transformer_2)
    pipelines: tuple[str, ...] = ()  # pipeline classes (model_index.json _class_name) that dmap run runs
    related: tuple[str, ...] = ()  # class-name prefixes traced like them (img2img, inpaint variants)
    denoiser_classes: tuple[str, ...] = ()  # denoiser classes, to recognise a lone component folder
    offload_seq: str = ""  # diffusers' model_cpu_offload_seq: the stage order without importing diffusers
    guidance: str = GUIDANCE_BATCH
    default_steps: int = 50
    default_guidance: float = 7.5
    settings: tuple[Setting, ...] = ()  # the family's own generation settings (see Setting)
    default_max_sequence_length: int | None = None  # T5/LLM tokens; None: the family has no such knob
    default_sample_size: int | None = None  # latent size of the default image; None: denoiser config sample_size
    negative_prompt: bool = True  # False: a negative prompt is refused (guidance-distilled)
    packs_latents: bool = False  # True: the denoiser takes 2x2-packed latents (FLUX-style; see packed_latents())
    default_num_frames: int | None = None  # video families: frames when none are asked for; None: images
    default_fps: int | None = None  # video families: frames per second of the written video
    # component -> tensors the pipeline's __call__ reads while that component is not loaded (for
    # `dmap run`'s meta placeholders; e.g. FLUX.2 [klein] un-normalises latents with the VAE's batch norm)
    placeholder_tensors: dict[str, tuple[str, ...]] = {}
    # The family's stages (dm_cli.families.stages.Stage: name, components, what each consumes and produces), in
    # run order; () declares the default: encode / denoise / decode around `denoiser` and `experts` (`stages`).
    declared_stages: tuple = ()
    # How many input images (Generation.images: references, the image to edit, a first frame) the pipeline
    # takes; 0: none (text to image or video), and --image is refused.
    max_input_images = 0
    min_input_images = 0  # 1: the pipeline cannot run without one (image-to-image)
    takes_last_image = False  # True: a video's last frame (Generation.last_image, --last-image) is conditioned on too
    takes_keyframes = False  # True: input images may name the video frame they condition (`--image PATH@FRAME`: LTX-2)
    # The step caches (`--cache`, dm_cli.planning.step_cache) its denoiser runs, each with the family's own defaults
    # for diffusers' config (taylorseer's cache_identifiers, magcache's mag_ratios); {}: none (refused)
    step_caches: dict[str, dict] = {}

    # --- matching -------------------------------------------------------------------------------

    def matches(self, pipeline_class: str | None, component_cls: str | None, config: dict | None) -> bool:
        """By pipeline class; for a lone component (no pipeline), by its denoiser class."""
        if pipeline_class:
            return pipeline_class in self.pipelines or bool(self.related) and pipeline_class.startswith(self.related)
        return component_cls in self.denoiser_classes

    def runs(self, pipeline_class: str | None) -> bool:
        """`dmap run` knows how to encode, denoise and decode for this pipeline class."""
        return pipeline_class in self.pipelines

    # --- what the pipeline feeds its models (the tracer's view) ----------------------------------

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        """The call the pipeline makes to `comp` for `inputs`; None when the family does not know it."""
        raise NotImplementedError

    def guidance_scale(self, inputs: InputSpec) -> float:
        return float(inputs.guidance_scale) if inputs.guidance_scale is not None else self.default_guidance

    def cfg_batch(self, inputs: InputSpec) -> int:
        """2 when classifier-free guidance doubles the denoiser's batch, else 1."""
        return 2 if self.guidance == GUIDANCE_BATCH and self.guidance_scale(inputs) > 1.0 else 1

    def denoiser_calls(self, inputs: InputSpec) -> int:
        """Denoiser calls per step: 2 under true CFG (separate conditional and unconditional calls)."""
        return 1

    def calls_at_run(self, inputs: InputSpec, negative_prompt: str | None, settings: dict) -> int:
        """Denoiser calls per step a run makes with this negative prompt and these settings (the time it takes);
        `denoiser_calls` is the plan's (memory) view, which may count a second call the run only makes on request."""
        return self.denoiser_calls(inputs)

    def run_text_tokens(self, tokenizer_folder, prompt: str | None, negative_prompt: str | None,
                        max_length: int) -> int | None:
        """The text tokens the denoiser sees at run time for `prompt` (tokenized with the pipeline's tokenizer in
        `tokenizer_folder`); None when the pipeline pads the text to `max_length` (the traced length) or the prompt
        or tokenizer is not known."""
        return None

    def max_sequence_length(self, comp: Component, inputs: InputSpec) -> int | None:
        if inputs.max_sequence_length:
            return int(inputs.max_sequence_length)
        return self.default_max_sequence_length

    # --- sizes ----------------------------------------------------------------------------------

    def vae_scale(self, vae_config: dict | None) -> int:
        """The pipeline's vae_scale_factor (`pipelines.block_scale`; families with another VAE override it)."""
        return block_scale(vae_config)

    def default_image_size(self, denoiser_config: dict, vae_config: dict | None) -> int:
        sample = self.default_sample_size or int((denoiser_config or {}).get("sample_size", 64))
        return sample * self.vae_scale(vae_config)

    def default_size(self, denoiser_config: dict, vae_config: dict | None) -> tuple[int, int]:
        """(height, width) when the user gives neither: square images by default."""
        size = self.default_image_size(denoiser_config, vae_config)
        return size, size

    def size_multiple(self, denoiser_config: dict, vae_config: dict | None) -> int:
        """What height and width must be multiples of, as the pipeline's own check_inputs demands."""
        if self.packs_latents:  # 2x2 latent patches: twice the VAE's scale (see packed_latents())
            return self.vae_scale(vae_config) * 2
        return math.lcm(8, self.vae_scale(vae_config))

    def reference_tokens(self, inputs: InputSpec, vae_config: dict | None) -> tuple[int, ...]:
        """Tokens each input image of `inputs` adds to the denoiser's sequence, in order (FLUX.2's references);
        () where input images add none (image-to-image, image-to-video: the same sequence)."""
        return ()

    def check_inputs(self, inputs: InputSpec, vae_config: dict | None) -> None:
        """The family's own rules on frames (UsageError, one sentence); images take no --frames."""
        if self.default_num_frames is None and (inputs.num_frames is not None or inputs.fps is not None):
            raise UsageError(f"{self.title()} pipelines make images, not videos: drop --frames and --fps.")

    # --- one generation: defaults and rules, for plan and run alike ------------------------------

    def settle(self, generation: Generation, denoiser_config: dict, vae_config: dict | None,
               defaults: dict | None = None) -> Generation:
        """Every default filled in: given, else `defaults` (the demo's, a plan file's), else the pipeline's."""
        defaults = defaults or {}

        def pick(name: str, fallback):
            given = getattr(generation, name)
            if given is not None:
                return given
            return defaults[name] if defaults.get(name) is not None else fallback

        height, width = self.default_size(denoiser_config, vae_config)
        video = self.default_num_frames is not None
        settled = replace(
            generation, height=pick("height", height), width=pick("width", width),
            num_frames=pick("num_frames", self.default_num_frames) if video else generation.num_frames,
            fps=pick("fps", self.default_fps) if video else generation.fps,
            steps=pick("steps", self.default_steps), guidance_scale=pick("guidance_scale", self.default_guidance),
            max_sequence_length=pick("max_sequence_length", self.default_max_sequence_length),
            num_images=pick("num_images", 1))
        declared = {s.name: s.default for s in self.settings if s.default is not None}
        return replace(settled, settings=()).with_settings({**declared, **dict(generation.settings)})

    def validate(self, generation: Generation, pipeline_class: str, denoiser_config: dict, vae_config: dict | None,
                 components: tuple[str, ...] = (), per_prompt_images: bool = False) -> None:
        """The pipeline's rules on a settled generation, one sentence each (UsageError): the same check for
        `dmap plan`, `dmap run`, the API and every queue item. `per_prompt_images`: the generation is a session's
        default, and its input images may come with each prompt (`generate(image=...)`, a queue item's "image")."""
        refusal = self.refusal(generation, components)
        if refusal:
            raise UsageError(refusal)
        if not generation.weights_only:
            multiple = self.size_multiple(denoiser_config, vae_config)
            for flag, value in (("--height", generation.height), ("--width", generation.width)):
                if value < multiple or value % multiple:
                    lower = max(multiple, value - value % multiple)
                    raise UsageError(f"{flag} {value} is not a multiple of {multiple}, which {pipeline_class} needs "
                                     f"for this model: use {lower} or {lower + multiple}.")
        self.check_inputs(generation.inputs(), vae_config)
        if len(generation.images) < self.min_input_images and not generation.weights_only and not per_prompt_images:
            raise UsageError(f"{self.title()} needs an input image: add --image PATH.")  # last: what else is wrong first

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        """A sentence when the request asks for something this family cannot do, else None."""
        declared = {s.name: s for s in self.settings}
        for name, value in generation.settings:
            setting = declared.get(name)
            if setting is None:
                other = next((s for f in all_families() for s in f.settings if s.name == name), None)
                if other is None:
                    return f"Unknown setting '{name}': the settings are {', '.join(sorted(all_settings())) or 'none'}."
                return f"{other.flag} is for {other.for_whom}, not {self.title()}: {other.instead}."
            setting.check(value)
            if setting.needs_component and components and setting.needs_component not in components:
                return (f"{setting.flag} sets the guidance of {setting.needs_component}, which this pipeline does not "
                        f"have (one expert, as Wan 2.1): {setting.instead}.")
        if len(generation.images) > self.max_input_images:
            if not self.max_input_images:
                return f"{self.title()} pipelines take no input image: drop --image."
            return (f"{self.title()} takes at most {self.max_input_images} input image(s), not "
                    f"{len(generation.images)}: drop some --image.")
        keyframe = next((image for image in generation.images if image.frame is not None), None)
        if keyframe is not None and not self.takes_keyframes:
            return (f"{self.title()} pipelines take no frame index on an input image (PATH@FRAME is for LTX-2's "
                    f"keyframes): drop @{keyframe.frame} from --image.")
        if generation.last_image is not None and generation.last_image.frame is not None:
            return f"--last-image is the video's last frame and takes no frame index: drop @{generation.last_image.frame}."
        if generation.last_image is not None and not self.takes_last_image:
            return (f"{self.title()} pipelines take no last frame (--last-image is for WanImageToVideoPipeline, Wan 2.2 I2V-A14B): "
                    "drop --last-image.")
        if generation.cache is not None and generation.cache.name not in self.step_caches:
            if not self.step_caches:
                return (f"{self.title()} pipelines take no --cache in dmap (its denoiser's blocks are not among those "
                        "dmap applies diffusers' cache hooks to): drop --cache.")
            return (f"{self.title()} pipelines take --cache {' or '.join(self.step_caches)}, not {generation.cache.name}: "
                    "use one of those, or drop --cache.")
        if generation.negative_prompt and not self.negative_prompt:
            return f"{self.title()} pipelines ignore negative prompts (guidance is distilled): drop --negative-prompt."
        return None

    def setting_kwargs(self, job: "Job") -> dict:
        """The family's settings as the pipeline's __call__ keywords (those given or with a default)."""
        values = dict(job.settings)
        return {s.argument or s.name: values[s.name] for s in self.settings if values.get(s.name) is not None}

    # --- run ------------------------------------------------------------------------------------

    def title(self) -> str:
        return self.name.upper() if len(self.name) <= 4 else self.name

    def encode(self, pipe, job: Job, device) -> Embeds:
        """The pipeline's own encode_prompt, called as its __call__ would call it."""
        raise NotImplementedError

    def call_kwargs(self, pipe, job: Job) -> dict:
        """Guidance arguments of the pipeline's __call__ when it denoises from embeddings."""
        return {"guidance_scale": job.guidance_scale, **self.setting_kwargs(job)}

    def decode(self, pipe, latents, job: Job, device) -> list:
        """The pipeline's own decode tail (unpack, unscale, VAE decode, postprocess to PIL; video
        families: one uint8 array (frames, height, width, 3) per video)."""
        raise NotImplementedError

    def step_components(self, pipe, job: Job) -> list[str] | None:
        """Families with `experts`: the denoiser component that runs at each step (None: `denoiser` always)."""
        return None

    # --- stages ---------------------------------------------------------------------------------

    def stages(self, components: list[str], offload_seq: list[str] | None) -> list:
        """The stages of a pipeline with these components, in run order: `declared_stages` (each with the
        components the pipeline has), else encode (what runs before the denoiser in `offload_seq`), denoise
        (`denoiser` and `experts`), decode (what runs after it)."""
        if self.declared_stages:
            return declared(self.declared_stages, components)
        return default_stages(components, offload_seq, (self.denoiser, *self.experts))

    def encode_image(self, pipe, job: Job, device):
        """Families with an image-encode stage (consumes IMAGE, produces IMAGE_LATENTS): the input image in
        latent space, as the pipeline's own VAE encode computes it."""
        raise NotImplementedError(f"the {self.name} family declares no image-encode stage")

    def denoising_pipeline(self, pipe, job: Job, image_latents=None):
        """The pipeline object whose __call__ denoises `job` (from `image_latents`, when its stage consumes them):
        `pipe` (built from model_index.json's class), or another class over the same components (LTX-2's and Wan 2.2
        TI2V-5B's image-to-video)."""
        return pipe

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """Families whose denoise consumes IMAGE_LATENTS: the pipeline __call__ arguments that start the
        denoising from them (an img2img pipeline's `image`, a text-to-image one's `latents`)."""
        raise NotImplementedError(f"the {self.name} family declares no denoising from an input image")


@lru_cache(maxsize=None)
def all_families() -> tuple[Family, ...]:
    """Each module's FAMILY, or its FAMILIES in order (one module per model family with variants: qwenimage_edit)."""
    modules = [importlib.import_module(f"{__name__}.{module}") for module in FAMILY_MODULES]
    return tuple(family for module in modules for family in getattr(module, "FAMILIES", (module.FAMILY,)))


def all_settings() -> dict[str, Setting]:
    """Every registered family's settings by name (one declaration per name: the first family's)."""
    found: dict[str, Setting] = {}
    for family in all_families():
        for setting in family.settings:
            found.setdefault(setting.name, setting)
    return found


def family_for(pipeline_class: str | None, component_cls: str | None = None, config: dict | None = None) -> Family | None:
    """The family of a pipeline class (or, without one, of a lone denoiser component); None if unknown."""
    return next((f for f in all_families() if f.matches(pipeline_class, component_cls, config)), None)


FALLBACK_IMAGE_SIZE = 1024  # a pipeline or lone component no family knows


def default_size(pipeline_class: str | None, components) -> tuple[int, int]:
    """(height, width) a pipeline makes when neither is given: its family's rule on the denoiser and VAE
    configs, as its __call__ computes it (Wan: 480x832). The one default `dmap plan` and `dmap run`
    share; 1024x1024 for what no family knows."""
    family, denoiser, vae = family_parts(pipeline_class, components)
    if family is None or denoiser is None:
        return FALLBACK_IMAGE_SIZE, FALLBACK_IMAGE_SIZE
    return family.default_size(denoiser.config or {}, vae.config if vae is not None else None)


def source_family(pipeline_class: str | None, components) -> Family | None:
    """The family of a pipeline class, or of a lone component folder (by its denoiser or VAE class)."""
    return family_parts(pipeline_class, components)[0]


def family_parts(pipeline_class: str | None, components):
    """(family, denoiser component, vae component) of a pipeline or of a lone component folder (None: unknown)."""
    by_name = {c.name: c for c in components}
    if pipeline_class:
        family = family_for(pipeline_class)
        denoiser = by_name.get(family.denoiser) if family is not None else None
    else:  # a lone component folder: its own family when it is a denoiser
        denoiser = next((c for c in components if family_for(None, c.cls, c.config) is not None), None)
        family = family_for(None, denoiser.cls, denoiser.config) if denoiser is not None else None
    return family, denoiser, by_name.get("vae")


def call_spec(comp: Component, pipeline_class: str | None, inputs: InputSpec) -> CallSpec | None:
    """The call the pipeline makes to this component for `inputs`; None when dmap does not know it.

    The component's family knows; for a pipeline no family matches, the shared component calls
    (VAE decode, CLIP, T5) still apply, else the tracer falls back to the forward's signature.
    """
    family = family_for(pipeline_class, comp.cls, comp.config)
    spec = family.call_spec(comp, inputs) if family is not None else None
    return spec if spec is not None else component_call(comp, inputs)


def supported_pipelines() -> list[str]:
    return [p for f in all_families() for p in f.pipelines]


def offload_sequence(pipeline_class: str | None) -> list[str] | None:
    """model_cpu_offload_seq: the family's, else the diffusers pipeline class attribute (unknown families)."""
    if not pipeline_class:
        return None
    family = family_for(pipeline_class)
    seq = family.offload_seq if family is not None else None
    if not seq:
        try:
            import diffusers  # lazy: diffusers (heavy, off start-up)

            seq = getattr(getattr(diffusers, pipeline_class, None), "model_cpu_offload_seq", None)
        except Exception:
            seq = None
    return seq.split("->") if seq else None


def pipeline_stages(pipeline_class: str | None, components: list[str]):
    """The stages of a pipeline's components (dm_cli.families.stages.Stage), in run order: as its family
    declares them (`Family.stages`); for an unknown family, encode / denoise / decode in offload order
    around the first component with a name diffusers gives denoisers (transformer, unet, prior, decoder).
    """
    family = family_for(pipeline_class)
    if family is not None:
        return family.stages(components, offload_sequence(pipeline_class))
    return default_stages(components, offload_sequence(pipeline_class), DENOISER_NAMES)


def unknown_family_warning(pipeline_class: str) -> str:
    """What dmap lacks for a pipeline no family matches (plans still place its weights)."""
    return (f"dmap has no family for {pipeline_class}: it does not know what the pipeline feeds its components (activations "
            "are estimated only where a forward can be called with generic inputs), takes the stage order from "
            "diffusers' model_cpu_offload_seq, and dmap run cannot run it; a family module in dm_cli/families adds all "
            "three (docs/adding-a-family.md).")


def local_tokenizer(folder):
    """The pipeline's tokenizer from its folder (local files only), or None when it has none that loads."""
    if folder is None or not (Path(folder) / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer  # lazy: transformers (heavy, off start-up)

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001 - a tokenizer that does not load: the prediction keeps the traced length
        return None

"""The stages of a pipeline: which components run together, in which order, and what each hands the next.

A family declares its stages (`Family.declared_stages`; by default encode / denoise / decode around its
denoiser, `default_stages`): each names the components it runs, the values it consumes and the values it
produces (text to image: PROMPT -> encode -> EMBEDS -> denoise -> LATENTS -> decode -> IMAGES). A component
may serve several stages (a VAE that encodes an input image before the denoiser and decodes after it).
The planner places per stage, the plan file records each stage's values, and the stage loop runs a stage
by its kind (`Stage.kind`: what it produces), never by its name.

Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The values stages hand each other (the stage loop's Carry has one field of each name but the inputs).
PROMPT = "prompt"  # the job's prompt and negative prompt: there from the start
IMAGE = "image"  # the job's input image (image-to-image families): there from the start, the family reads it
EMBEDS = "embeds"  # the prompt embeddings (Family.encode)
IMAGE_LATENTS = "image_latents"  # the input image in latent space (Family.encode_image), where denoising starts
LATENTS = "latents"  # the denoised latents
IMAGES = "images"  # the output: PIL images, or one frame array per video
AUDIO_LATENTS = "audio_latents"  # the denoised audio latents (LTX-2: made by the denoise stage beside LATENTS)
AUDIO = "audio"  # the output's audio track: one waveform per video and its sample rate (Family.decode_audio)
INPUTS = (PROMPT, IMAGE)
VALUES = (PROMPT, IMAGE, EMBEDS, IMAGE_LATENTS, LATENTS, IMAGES, AUDIO_LATENTS, AUDIO)
# Values a stage may make beside the one that names its kind (LTX-2's denoise: LATENTS and AUDIO_LATENTS)
RIDERS = (AUDIO_LATENTS,)

# What runs a stage, by the one value it produces: the stage loop has one runner per kind.
ENCODE = "encode"  # PROMPT -> EMBEDS: Family.encode
ENCODE_IMAGE = "encode_image"  # IMAGE -> IMAGE_LATENTS: Family.encode_image
DENOISE = "denoise"  # EMBEDS (and IMAGE_LATENTS) -> LATENTS: the pipeline's own __call__
DECODE = "decode"  # LATENTS -> IMAGES: Family.decode
DECODE_AUDIO = "decode_audio"  # AUDIO_LATENTS -> AUDIO: Family.decode_audio (the audio VAE and the vocoder)
KIND_OF = {EMBEDS: ENCODE, IMAGE_LATENTS: ENCODE_IMAGE, LATENTS: DENOISE, IMAGES: DECODE, AUDIO: DECODE_AUDIO}

# What the stages `default_stages` names consume and produce: also what a plan file written before stages
# recorded their values means by these names.
NAMED_VALUES = {
    "encode": ((PROMPT,), (EMBEDS,)),
    "denoise": ((EMBEDS,), (LATENTS,)),
    "decode": ((LATENTS,), (IMAGES,)),
}


def stage_kind(produces) -> str | None:
    """The kind of a stage that produces `produces` (RIDERS aside); None: no runner makes that (the stage cannot run)."""
    main = [value for value in produces if value not in RIDERS]
    return KIND_OF.get(main[0]) if len(main) == 1 else None


@dataclass(frozen=True)
class Stage:
    name: str
    components: tuple[str, ...]
    # The components run one after another and never together (Wan 2.2's two experts, switched at a
    # boundary step): the planner may load them one at a time, as consecutive sub-stages of this stage.
    exclusive: bool = False
    consumes: tuple[str, ...] = ()  # values (PROMPT, EMBEDS, ...) an earlier stage or the job provides
    produces: tuple[str, ...] = ()

    @property
    def kind(self) -> str | None:
        return stage_kind(self.produces)


def named_stage(name: str, components, exclusive: bool = False) -> Stage:
    """A stage of one of today's names (encode, denoise, decode), consuming and producing what that name does."""
    consumes, produces = NAMED_VALUES.get(name, ((), ()))
    return Stage(name, tuple(components), exclusive, consumes, produces)


def image_to_image_stages(encoders: tuple[str, ...], denoiser: str = "transformer", vae: str = "vae") -> tuple:
    """The stages of a pipeline that VAE-encodes an input image before its denoiser and decodes after it (the
    same VAE in two stages): encode, encode_image, denoise, decode."""
    return (Stage("encode", encoders, consumes=(PROMPT,), produces=(EMBEDS,)),
            Stage("encode_image", (vae,), consumes=(IMAGE,), produces=(IMAGE_LATENTS,)),
            Stage("denoise", (denoiser,), consumes=(EMBEDS, IMAGE_LATENTS), produces=(LATENTS,)),
            Stage("decode", (vae,), consumes=(LATENTS,), produces=(IMAGES,)))


def declared(stages, components: list[str]) -> list[Stage]:
    """A family's declared stages for the components a pipeline has: components it lacks left out, stages
    left with none dropped. ValueError for a component no stage runs (the planner must place every one)."""
    present = set(components)
    out = []
    for stage in stages:
        kept = tuple(c for c in stage.components if c in present)
        if kept:
            out.append(Stage(stage.name, kept, stage.exclusive and len(kept) > 1, stage.consumes, stage.produces))
    used = {c for stage in out for c in stage.components}
    missing = [c for c in components if c not in used]
    if missing:
        raise ValueError(f"no declared stage runs {', '.join(missing)} (stages: {', '.join(s.name for s in stages)})")
    return out


def default_stages(components: list[str], offload_seq: list[str] | None,
                   denoisers: tuple[str, ...] = ("transformer", "unet")) -> list[Stage]:
    """encode (everything before the denoiser), denoise, decode (after it), from model_cpu_offload_seq.

    `denoisers`: component names that denoise (the family's; see dm_cli.families.pipeline_stages).
    Denoisers that follow each other in the sequence (Wan 2.2's `transformer`, `transformer_2`) form one
    denoise stage whose components run one at a time (`exclusive`).
    """
    order = [c for c in (offload_seq or []) if c in components]
    order += [c for c in components if c not in order]
    denoiser_names = denoisers
    denoisers = [c for c in order if c in denoiser_names]
    if not denoisers:
        return [Stage("run", tuple(order))] if order else []
    pivot = order.index(denoisers[0])
    end = pivot + 1
    while end < len(order) and order[end] in denoiser_names:
        end += 1
    extra = [c for c in components if c not in (offload_seq or []) and "controlnet" in c]
    encode = tuple(c for c in order[:pivot] if c not in extra)
    denoise = (*order[pivot:end], *extra)
    decode = tuple(c for c in order[end:] if c not in extra)
    stages = []
    if encode:
        stages.append(named_stage("encode", encode))
    stages.append(named_stage("denoise", denoise, exclusive=end - pivot > 1))
    if decode:
        stages.append(named_stage("decode", decode))
    return stages

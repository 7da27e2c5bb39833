"""LTX-2's image conditioning (`dm_cli.families.ltx2`): where a first frame or keyframes may go and which pipeline
they select (`pipeline_kind`, `check_keyframes`), and, for `dmap run`, how the `encode_image` stage encodes them and
how the denoise stage hands the encoded frames to the pipeline's own __call__ (`LTX2ImageConditioning`,
`EncodedConditions`). Kept apart from the family's trace and text/audio parts, which never touch an image.

torch, numpy, PIL and diffusers are imported inside the run-time functions only: families are read by warm
`inspect`/`plan` runs (and `dmap --help`), which must not import them.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from dm_cli.errors import UsageError
from dm_cli.families import Job
from dm_cli.inputs import InputSpec
from dm_cli.io.input_images import open_input

TEXT_TO_VIDEO, IMAGE_TO_VIDEO, CONDITION = "LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline"


def vae_factors(vae: dict | None) -> tuple[int, int]:
    """(temporal, spatial) compression of the LTX-2 video VAE, as AutoencoderKLLTX2Video computes them."""
    config = vae or {}
    if "spatio_temporal_scaling" not in config:  # no VAE config: LTX-2's (the pipeline's own fallbacks)
        return 8, 32
    scaling = sum(bool(s) for s in config.get("spatio_temporal_scaling") or [True, True, True, True])
    temporal = config.get("temporal_compression_ratio") or int(config.get("patch_size_t", 1)) * 2 ** scaling
    spatial = config.get("spatial_compression_ratio") or int(config.get("patch_size", 4)) * 2 ** scaling
    return int(temporal), int(spatial)


def pipeline_kind(frames) -> str:
    """The pipeline for input images with these frame indices (None: a plain path): LTX2Pipeline without any,
    LTX2ImageToVideoPipeline for one plain image (the first frame), else LTX2ConditionPipeline (keyframes)."""
    frames = list(frames)
    if not frames:
        return TEXT_TO_VIDEO
    return IMAGE_TO_VIDEO if frames == [None] else CONDITION


def latent_index(frame: int | None, temporal: int) -> int:
    """LTX2VideoCondition.index (a latent frame) of a keyframe at video frame `frame` (checked: 0 or t*j + 1)."""
    return 0 if not frame else (frame - 1) // temporal + 1


def input_frames(inputs: InputSpec) -> list[int | None]:
    """The frame index of each input image of `inputs`, in order (None: a plain path)."""
    frames = list(inputs.image_frames[:len(inputs.image_sizes)])
    return frames + [None] * (len(inputs.image_sizes) - len(frames))


def check_keyframes(frames: list[int | None], num_frames: int, temporal: int, names: list[str]) -> None:
    """LTX2ConditionPipeline's rule on frame indices, one sentence each: 0 or t*j + 1 up to num_frames - t (latent
    frames it can condition; a later index it skips with a warning), and one image per frame."""
    if pipeline_kind(frames) != CONDITION:
        return
    last = num_frames - temporal  # the first frame of the last latent frame
    seen: dict[int, str] = {}
    for frame, name in zip(frames, names):
        at = frame or 0
        if at and ((at - 1) % temporal or at > last):
            lower = min(at - (at - 1) % temporal, last) if last >= 1 else 0
            upper = lower + temporal if 1 <= lower and lower + temporal <= last else None
            allowed = f"frame 0 or a frame {temporal}k+1 up to {last}" if last >= 1 else "frame 0"
            raise UsageError(f"{name} is at frame {at}, which LTX-2 cannot condition: a keyframe goes at {allowed} for "
                             f"--frames {num_frames} (where one of the VAE's latent frames of {temporal} frames starts): "
                             f"use @{lower}" + (f" or @{upper}." if upper is not None else "."))
        if at in seen:
            raise UsageError(f"{seen[at]} and {name} are both at frame {at}: LTX-2 conditions a frame on one image, so "
                             "give the others their own frame with PATH@FRAME.")
        seen[at] = name


class LTX2ImageConditioning:
    """The run-time image parts of `LTX2Family`: the `encode_image` stage (a first frame or keyframes) and what the
    denoise stage passes for them. Needs the family's `default_num_frames`."""

    def encode_image(self, pipe, job: Job, device):
        """The first frame as LTX2ImageToVideoPipeline encodes it: H.264 re-compressed at `image_crf`, resized to
        height x width (bilinear), VAE-encoded (the distribution's mode: no generator draw), in float32 and not yet
        normalised: `(1, C, 1, H', W')`. Keyframes: `encode_keyframes`. No image: an empty tensor (text-to-video;
        the VAE is not loaded)."""
        import torch  # lazy: torch (heavy, off start-up)

        if not job.images:
            return torch.zeros(0)
        if pipeline_kind(image.frame for image in job.images) == CONDITION:
            return self.encode_keyframes(pipe, job, device)
        # lazy: numpy, PIL, diffusers (heavy, off start-up)
        import numpy as np
        import PIL.Image
        from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import retrieve_latents
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from diffusers.video_processor import VideoProcessor

        image = open_input(job.images[0])
        crf = job.setting("image_crf")
        crf = resolve_default_image_crf(pipe.text_encoder) if crf is None else crf
        if crf != 0:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        processor = VideoProcessor(vae_scale_factor=pipe.vae_spatial_compression_ratio, resample="bilinear")  # I2V's
        pixels = processor.preprocess(image, height=job.height, width=job.width)
        pixels = pixels.to(device=device, dtype=pipe.vae.dtype)  # prompt_embeds' dtype in the pipeline: the run's
        encoded = pipe.vae.encode(pixels[0].unsqueeze(0).unsqueeze(2))
        return retrieve_latents(encoded, None, "argmax").to(torch.float32)

    def encode_keyframes(self, pipe, job: Job, device):
        """Every keyframe as LTX2ConditionPipeline.prepare_latents encodes it: its own preprocess_conditions (H.264
        at `image_crf`, resized to cover height x width and centre-cropped), then one VAE encode per image (the
        distribution's mode), in the VAE's dtype and not yet normalised: `(N, C, 1, H', W')`, in --image order."""
        # lazy: torch, diffusers (heavy, off start-up)
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition, retrieve_latents
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        crf = job.setting("image_crf")
        crf = resolve_default_image_crf(pipe.text_encoder) if crf is None else crf
        temporal, _ = vae_factors(dict(pipe.vae.config))
        conditions = [LTX2VideoCondition(frames=open_input(image), index=latent_index(image.frame, temporal), crf=crf)
                      for image in job.images]
        frames = job.num_frames or self.default_num_frames
        pixels, _, _, _ = denoising_pipeline(pipe, CONDITION).preprocess_conditions(
            conditions, job.height, job.width, frames, device=device)
        return torch.cat([retrieve_latents(pipe.vae.encode(p), None, "argmax") for p in pixels])

    def conditions(self, pipe, job: Job) -> list:
        """__call__'s `conditions`: each input image at its latent index with its strength (default 1). Their pixels
        are a blank of the output size (crf 0: nothing to re-compress): the VAE stand-in of the denoise stage
        (`EncodedConditions`) hands back the latents encode_keyframes made instead of encoding them."""
        # lazy: torch, diffusers (heavy, off start-up)
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

        temporal, _ = vae_factors(dict(pipe.vae.config))
        blank = torch.zeros(1, 3, job.height, job.width)
        return [LTX2VideoCondition(frames=blank, index=latent_index(image.frame, temporal),
                                   strength=1.0 if image.strength is None else float(image.strength), crf=0)
                for image in job.images]

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The encoded first frame as __call__'s unpacked `latents`, repeated over the latent frames (and videos),
        with `noise_scale=1`: prepare_latents then normalises them, draws the noise of the shape and generator it
        draws without latents and keeps frame 0 clean with the conditioning mask ((1 - m) * noise + m * latents,
        the same values as its own m * latents + (1 - m) * noise); noise_scale reaches nothing else here."""
        if not image_latents.numel():
            return {}
        if pipeline_kind(image.frame for image in job.images) == CONDITION:
            return {"conditions": self.conditions(pipe, job)}
        temporal, _ = vae_factors(dict(pipe.vae.config))
        frames = ((job.num_frames or self.default_num_frames) - 1) // temporal + 1
        return {"latents": image_latents.repeat(job.num_images, 1, frames, 1, 1), "noise_scale": 1.0}

    def denoising_pipeline(self, pipe, job: Job, image_latents):
        """The pipeline whose __call__ denoises this job: LTX2ImageToVideoPipeline with a first frame,
        LTX2ConditionPipeline with keyframes (its VAE a stand-in handing back the encoded keyframes), else
        LTX2Pipeline, over the loaded components (an LTX-2 folder's model_index names one of them)."""
        if job.images and image_latents is None:
            raise UsageError("This plan has no encode_image stage (LTX-2 plans made before image-to-video): plan again "
                             "to run with --image.")
        encoded = image_latents is not None and bool(image_latents.numel())
        kind = pipeline_kind(image.frame for image in job.images) if encoded else TEXT_TO_VIDEO
        if kind != CONDITION:
            return denoising_pipeline(pipe, kind)
        other = denoising_pipeline(pipe, CONDITION, fresh=True)
        other.vae = EncodedConditions(other.vae, image_latents.to(getattr(pipe, "_dmap_device", "cpu")))
        return other


def denoising_pipeline(pipe, kind: str, fresh: bool = False):
    """`pipe` as the pipeline class `kind` (LTX2Pipeline, LTX2ImageToVideoPipeline or LTX2ConditionPipeline): itself
    when it is that class (unless `fresh`), else that class built over its components, its execution device the
    stage loop's (as dm_cli.run.load.loading builds it)."""
    import diffusers  # here only: families are read by warm inspect/plan runs, without diffusers or torch

    wanted = getattr(diffusers, kind)
    if isinstance(pipe, wanted) and not fresh:
        return pipe
    staged = type(wanted.__name__, (wanted,), {"_execution_device": property(lambda self: self._dmap_device)})
    accepted = inspect.signature(wanted.__init__).parameters
    other = staged(**{name: module for name, module in pipe.components.items() if name in accepted})
    other._dmap_device = getattr(pipe, "_dmap_device", "cpu")
    other.set_progress_bar_config(disable=True)
    return other


class EncodedConditions:
    """The VAE as LTX2ConditionPipeline.prepare_latents sees it in the denoise stage, where the VAE is not loaded
    (its meta placeholder, or the resident VAE): `encode` hands back the keyframes encode_keyframes encoded, one
    per call in --image order (prepare_latents encodes the conditions in that order); everything else (the
    latents_mean and latents_std it normalises with, its config and dtype) is the VAE's own."""

    def __init__(self, vae, latents):
        self._vae = vae
        self._latents = list(latents.split(1))

    def encode(self, pixels):
        if not self._latents:
            raise RuntimeError("LTX2ConditionPipeline encoded more conditions than the encode_image stage made")
        latents = self._latents.pop(0)
        spatial = self._vae.spatial_compression_ratio
        if tuple(pixels.shape[-2:]) != (latents.shape[-2] * spatial, latents.shape[-1] * spatial):
            raise RuntimeError(f"a condition of {tuple(pixels.shape)} pixels does not match latents {tuple(latents.shape)}")
        return SimpleNamespace(latents=latents)  # retrieve_latents returns .latents as they are

    def __getattr__(self, name):
        return getattr(self.__dict__["_vae"], name)

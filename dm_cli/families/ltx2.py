"""LTX-2 (Lightricks; diffusers' LTX2Pipeline, LTX2ImageToVideoPipeline and LTX2ConditionPipeline): text, a first
frame or keyframes to video with its synchronized audio track.

What LTX2Pipeline feeds its models (diffusers 0.42.1, `pipelines/ltx2/pipeline_ltx2.py`):
- text encoder (Gemma-3): `input_ids (B, L)` left-padded to `max_sequence_length` (1024) with its mask,
  `output_hidden_states=True`; the pipeline stacks every hidden state into `(B, L, hidden * (layers + 1))`.
  Under CFG the negative prompt ("" by default) is encoded too.
- connectors (`LTX2TextConnectors`): run inside `__call__` on the [negative, positive] batch, so they belong to
  the denoise stage; they turn the stacked states into video and audio text tokens `(2B, L, caption_channels)`.
- transformer (`LTX2VideoTransformer3DModel`): one joint call per step on video tokens
  `(2B, F' * H' * W', in_channels)` (F' = (F - 1) / t + 1, H' = H / s, W' = W / s, t and s the video VAE's
  temporal and spatial compression, 8 and 32 for LTX-2) and audio tokens `(2B, A, audio_in_channels)`,
  A = round(F / frame_rate * sample_rate / hop / 4). CFG doubles the batch (the pipeline's default
  audio_guidance_scale 7.0 keeps it on); spatio-temporal and modality-isolation guidance add two calls per step
  on the plain batch (smaller than the doubled one, so the doubled call is the peak).
- video VAE: `decode(z (B, 128, F', H', W'))` after un-normalising; audio VAE: `decode(z (B, 8, A, 16))` to a
  mel spectrogram `(B, 2, 4A - 3, 64)`; vocoder: the spectrogram to a waveform `(B, 2, samples)` at its
  `output_sampling_rate`.
- frames must be t*k + 1 (8k + 1); height and width multiples of 32 (check_inputs).

Image-to-video (LTX2ImageToVideoPipeline, the same components): `--image` on any LTX-2 folder (model_index naming
either class) selects it. The pipeline re-compresses the first frame with H.264 (`image_crf`, 33 for Gemma-3
checkpoints; PyAV), resizes it to height x width (bilinear), VAE-encodes it (the distribution's mode) into latent
frame 0 and keeps that frame clean: a conditioning mask gives its tokens timestep 0, so the video timestep becomes
one per token `(2B, F' * H' * W')` and the AdaLN modulation per token (the audio keeps one per sample). No tokens
are added. dmap runs the encode as its own stage (`encode_image`, the VAE serving it and the decode) and hands the
encoded frame to the pipeline's own __call__ as unpacked latents with `noise_scale=1`: the pipeline's two-stage
path then draws the same noise and mixes it in with the same mask, bit for bit (see `image_kwargs`). The VAE is
traced once, for its decode: encoding the one first frame at height x width needs 0.98x the decode of a single
frame (bf16, 512x768 on the meta device) and less than any longer decode, so the decode's peak covers both stages.

Keyframes (LTX2ConditionPipeline): `--image PATH@FRAME[:STRENGTH]` conditions video frame FRAME on the image, with
STRENGTH in (0, 1] (default 1: kept as given). A plain `--image PATH` alone stays LTX2ImageToVideoPipeline's first
frame; any `@FRAME`, or more than one image, runs LTX2ConditionPipeline, where a plain path is frame 0. The pipeline
takes a *latent* frame index k: frame 0 is latent frame 0, which the image replaces (its tokens keep timestep
(1 - strength) * t); latent frame k >= 1 starts at frame (k - 1) * t + 1, so FRAME must be 0 or t*j + 1 up to
--frames - t (t = 8: 0, 1, 9, ..., 113 of 121 frames), one image per frame (`check_keyframes`). A keyframe past
frame 0 adds its own latent frame, H' * W' tokens, to the video sequence (appended after the F' * H' * W' generated
ones, with their own positions): the trace counts them (`keyframe_tokens`, `Family.reference_tokens`) and passes the
pipeline's explicit `video_coords`. dmap VAE-encodes every keyframe in the `encode_image` stage with the pipeline's
own `preprocess_conditions` (H.264 at `image_crf`, resized to cover height x width and centre-cropped, bilinear) and
the distribution's mode, one image at a time, as prepare_latents does (so the decode's peak still covers the stage);
the denoise stage then calls the pipeline's own __call__ with its `conditions` (each at its latent index and
strength; their pixels are a blank of the output size, crf 0) and a stand-in for the VAE whose `encode` hands back
those latents in order (`EncodedConditions`): prepare_latents normalises, packs, appends and noises them itself.

The image parts (`check_keyframes`, the `encode_image` stage, `EncodedConditions`) live in
`dm_cli.families.ltx2_conditioning`.
"""

from __future__ import annotations

from dataclasses import replace
from importlib.util import find_spec

from dm_cli.errors import UsageError
from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job, Setting, check_video_length
from dm_cli.families.calls import CallSpec, Component, TensorSpec, sibling_config
from dm_cli.families.ltx2_conditioning import (
    CONDITION,
    IMAGE_TO_VIDEO,
    TEXT_TO_VIDEO,
    LTX2ImageConditioning,
    check_keyframes,
    input_frames,
    pipeline_kind,
    vae_factors,
)
from dm_cli.families.stages import (
    AUDIO,
    AUDIO_LATENTS,
    EMBEDS,
    IMAGE,
    IMAGE_LATENTS,
    IMAGES,
    LATENTS,
    PROMPT,
    Stage,
)
from dm_cli.inputs import Generation, InputSpec
from dm_cli.io.input_images import shown_path
from dm_cli.io.video import to_uint8

TRANSFORMER = "LTX2VideoTransformer3DModel"
VAE = "AutoencoderKLLTX2Video"
AUDIO_VAE = "AutoencoderKLLTX2Audio"
VOCODER = "LTX2Vocoder"
CONNECTORS = "LTX2TextConnectors"
TEXT_ENCODERS = ("Gemma3ForConditionalGeneration",)
AUDIO_COMPRESSION = 4  # the audio VAE's temporal and mel compression (LATENT_DOWNSAMPLE_FACTOR)
AUDIO_GUIDANCE = 7.0  # LTX2Pipeline.__call__'s audio_guidance_scale: with it CFG is on whatever guidance_scale is
DEFAULT_IMAGE_CRF = 33  # diffusers.pipelines.ltx2.utils.DEFAULT_IMAGE_CRF (Gemma-3 checkpoints: LTX-2 to 2.3)
MAX_CRF = 51  # libx264's range


class LTX2Family(LTX2ImageConditioning, Family):
    """LTX-2's text, trace and audio parts; the first frame's and keyframes' run-time parts come from
    `LTX2ImageConditioning` (dm_cli.families.ltx2_conditioning)."""

    name = "ltx-2"
    pipelines = (TEXT_TO_VIDEO, IMAGE_TO_VIDEO, CONDITION)
    # a first frame (LTX2ImageToVideoPipeline) or keyframes (LTX2ConditionPipeline: one per latent frame at most,
    # check_keyframes; this bounds the list before that)
    max_input_images = 64
    takes_keyframes = True
    related = ("LTX2",)
    denoiser_classes = (TRANSFORMER,)
    offload_seq = "text_encoder->connectors->transformer->vae->audio_vae->vocoder"
    guidance = GUIDANCE_BATCH
    default_steps = 30  # LTX2Pipeline.__call__'s defaults
    default_guidance = 3.0
    default_max_sequence_length = 1024
    default_num_frames = 121
    default_fps = 24
    default_height, default_width = 512, 768
    settings = (Setting("frame_rate", float, None,
                        "LTX-2: the frame rate the video and its audio are generated for (default: --fps, 24).",
                        for_whom="LTX-2, whose audio length follows the frame rate", instead="use --fps"),
                Setting("image_crf", int, None,
                        "LTX-2 image-to-video: the H.264 CRF each input image (first frame, keyframes) is re-compressed "
                        "with before it is encoded, as the model was trained (default: the pipeline's, 33, through "
                        "PyAV); 0 skips it.",
                        for_whom="LTX-2 image-to-video (--image)", instead="drop --image-crf"))
    # __call__ un-normalises both outputs with the VAEs' statistics while only the denoise stage is loaded
    placeholder_tensors = {"vae": ("latents_mean", "latents_std"), "audio_vae": ("latents_mean", "latents_std")}
    declared_stages = (
        Stage("encode", ("text_encoder",), consumes=(PROMPT,), produces=(EMBEDS,)),
        # the first frame (--image); without one it makes an empty tensor and loads nothing (run/loops/stages.py)
        Stage("encode_image", ("vae",), consumes=(IMAGE,), produces=(IMAGE_LATENTS,)),
        Stage("denoise", ("connectors", "transformer"), consumes=(EMBEDS, IMAGE_LATENTS),
              produces=(LATENTS, AUDIO_LATENTS)),
        Stage("decode", ("vae",), consumes=(LATENTS,), produces=(IMAGES,)),
        Stage("decode_audio", ("audio_vae", "vocoder"), consumes=(AUDIO_LATENTS,), produces=(AUDIO,)),
    )

    def title(self) -> str:
        return "LTX-2"

    def default_size(self, denoiser_config, vae_config_) -> tuple[int, int]:
        return self.default_height, self.default_width

    def size_multiple(self, denoiser_config, vae_config_) -> int:
        return 32  # LTX2Pipeline.check_inputs

    def cfg_batch(self, inputs: InputSpec) -> int:
        """The pipeline's CFG is guidance_scale > 1 or audio_guidance_scale (7.0) > 1: always a doubled batch."""
        return 2 if self.guidance_scale(inputs) > 1.0 or AUDIO_GUIDANCE > 1.0 else 1

    def settle(self, generation, denoiser_config, vae_config_, defaults=None):
        """Every default filled in; frame_rate is --fps unless given (the audio follows the frame rate)."""
        settled = super().settle(generation, denoiser_config, vae_config_, defaults)
        if settled.num_frames is not None and dict(settled.settings).get("frame_rate") is None:
            settled = replace(settled, settings=()).with_settings(
                {**dict(settled.settings), "frame_rate": float(settled.fps or self.default_fps)})
        return settled

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        refused = super().refusal(generation, components)
        crf = generation.setting("image_crf")
        if refused or crf is None:
            return refused
        if not 0 <= crf <= MAX_CRF:
            return f"--image-crf must be from 0 (no re-compression) to {MAX_CRF}, not {crf}."
        return None

    def validate(self, generation: Generation, pipeline_class: str, denoiser_config: dict, vae_config: dict | None,
                 components: tuple[str, ...] = (), per_prompt_images: bool = False) -> None:
        """The base rules, the keyframes' (`check_keyframes`, each named as given); an image to re-compress (a run's
        file, not a plan's size) needs PyAV, as diffusers' apply_image_conditioning_crf does: said before anything
        loads."""
        read = any(image.digest or image.pixels is not None for image in generation.images)
        if read and not generation.weights_only:  # a run's images, named by their paths, before the rest
            inputs = generation.inputs()
            check_video_length(inputs, vae_factors(vae_config)[0], "LTX-2")
            names = [(f"--image {shown_path(image.path)}" if image.path else f"input image {n + 1}")
                     + (f"@{image.frame}" if image.frame is not None else "") for n, image in enumerate(generation.images)]
            check_keyframes(input_frames(inputs), self.frames(inputs), vae_factors(vae_config)[0], names)
        super().validate(generation, pipeline_class, denoiser_config, vae_config, components, per_prompt_images)
        files = [image for image in generation.images if image.path is not None or image.pixels is not None
                 or image.encoded is not None]
        crf = generation.setting("image_crf")
        if files and (DEFAULT_IMAGE_CRF if crf is None else crf) and find_spec("av") is None:
            raise UsageError(f"LTX-2 re-compresses its conditioning images with H.264 (CRF {crf or DEFAULT_IMAGE_CRF}, "
                             "as it was trained) through PyAV, which is not installed: pip install av, or skip the "
                             "re-compression with --image-crf 0.")

    def check_inputs(self, inputs: InputSpec, vae_config_: dict | None) -> None:
        """Frames t*k + 1 (t the video VAE's temporal compression, 8 for LTX-2); sizes are multiples of 32; keyframes
        at frames the pipeline conditions (`check_keyframes`)."""
        temporal = vae_factors(vae_config_)[0]
        check_video_length(inputs, temporal, "LTX-2")
        frames = input_frames(inputs)
        if not inputs.weights_only and any(frame is not None for frame in frames):  # sizes alone carry no frame
            check_keyframes(frames, self.frames(inputs), temporal, [f"input image {n + 1}" for n in range(len(frames))])

    def reference_tokens(self, inputs: InputSpec, vae_config: dict | None) -> tuple[int, ...]:
        """Tokens each keyframe past frame 0 appends to the video sequence (its latent frame); () when none does
        (text-to-video, a first frame: the same sequence)."""
        tokens = self.keyframe_tokens(inputs, vae_config)
        return tuple(tokens) if any(tokens) else ()

    def keyframe_tokens(self, inputs: InputSpec, vae: dict | None, patch: int = 1) -> list[int]:
        """Tokens each input image appends to the video sequence, in order: a keyframe past frame 0 its latent frame
        (H' * W' / patch^2, the transformer's patch_size; LTX-2's is 1), a first frame none."""
        frames = input_frames(inputs)
        if inputs.weights_only or pipeline_kind(frames) != CONDITION:
            return [0] * len(frames)
        _, height, width = self.latent_grid(inputs, vae)
        return [(height // patch) * (width // patch) if frame else 0 for frame in frames]

    # --- the tracer's view ----------------------------------------------------------------------

    def frames(self, inputs: InputSpec) -> int:
        return int(inputs.num_frames or self.default_num_frames)

    def latent_grid(self, inputs: InputSpec, vae: dict | None) -> tuple[int, int, int]:
        temporal, spatial = vae_factors(vae)
        return (self.frames(inputs) - 1) // temporal + 1, inputs.height // spatial, inputs.width // spatial

    def audio_frames(self, inputs: InputSpec, audio_vae: dict | None) -> int:
        """Audio latent frames, as __call__ computes them from the frames and the frame rate."""
        config = audio_vae or {}
        rate = float(inputs.fps or self.default_fps)
        per_second = int(config.get("sample_rate", 16000)) / int(config.get("mel_hop_length", 160)) / AUDIO_COMPRESSION
        return round(self.frames(inputs) / rate * per_second)

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        seq = self.max_sequence_length(comp, inputs)
        audio_vae = sibling_config(comp, "audio_vae")
        audio = self.audio_frames(inputs, audio_vae if comp.cls != AUDIO_VAE else config)
        batch = inputs.effective_batch
        if comp.cls == TRANSFORMER:
            return self._transformer_call(comp, inputs, seq, audio)
        if comp.cls == CONNECTORS:
            width = int(config.get("caption_channels", 3840)) * int(config.get("text_proj_in_factor", 49))
            rows = batch * self.cfg_batch(inputs)
            kwargs = {"text_encoder_hidden_states": TensorSpec((rows, seq, width)),
                      "attention_mask": TensorSpec((rows, seq), "long")}
            return CallSpec("forward", kwargs, description=f"{seq} text tokens x {width} features, batch {rows}")
        if comp.cls == VAE:
            frames, height, width = self.latent_grid(inputs, config)
            shape = (batch, int(config.get("latent_channels", 128)), frames, height, width)
            return CallSpec("decode", {"z": TensorSpec(shape), "return_dict": False}, description=(
                f"decode {self.frames(inputs)} frames from latents {frames}x{height}x{width}, batch {batch}"))
        if comp.cls == AUDIO_VAE:
            mels = int(config.get("mel_bins", 64)) // AUDIO_COMPRESSION
            shape = (batch, int(config.get("latent_channels", 8)), audio, mels)
            return CallSpec("decode", {"z": TensorSpec(shape), "return_dict": False},
                            description=f"decode {audio} audio latent frames to a mel spectrogram, batch {batch}")
        if comp.cls == VOCODER:
            channels = int((audio_vae or {}).get("output_channels", 2))  # it flattens channels x mel bins
            bins = max(1, int(config.get("in_channels", 128)) // channels)
            shape = (batch, channels, max(1, 4 * audio - 3), bins)
            return CallSpec("forward", {"hidden_states": TensorSpec(shape)},
                            description=f"{shape[2]} mel frames to a waveform, batch {batch}")
        if comp.cls in TEXT_ENCODERS:
            kwargs = {"input_ids": TensorSpec((inputs.batch_size, seq), "long"), "output_hidden_states": True,
                      "use_cache": False}
            return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {inputs.batch_size}, all hidden states")
        return None

    def _transformer_call(self, comp: Component, inputs: InputSpec, seq: int, audio: int) -> CallSpec:
        config = comp.config or {}
        frames, height, width = self.latent_grid(inputs, sibling_config(comp, "vae"))
        patch, patch_t = int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1))
        tokens = (frames // patch_t) * (height // patch) * (width // patch)
        batch = inputs.effective_batch * self.cfg_batch(inputs)
        caption = int(config.get("caption_channels", 3840))
        kind = TEXT_TO_VIDEO if inputs.weights_only else pipeline_kind(input_frames(inputs))
        added = self.keyframe_tokens(inputs, sibling_config(comp, "vae"), patch)
        total = tokens + sum(added)
        kwargs = {
            "hidden_states": TensorSpec((batch, total, int(config.get("in_channels", 128)))),
            "audio_hidden_states": TensorSpec((batch, audio, int(config.get("audio_in_channels", 128)))),
            "encoder_hidden_states": TensorSpec((batch, seq, caption)),
            "audio_encoder_hidden_states": TensorSpec((batch, seq, caption)),
            "timestep": TensorSpec((batch,)),
            "sigma": TensorSpec((batch,)),  # the pipeline passes sigma=timestep (the cross-modal timestep)
            "encoder_attention_mask": TensorSpec((batch, seq), "long"),
            "audio_encoder_attention_mask": TensorSpec((batch, seq), "long"),
            "num_frames": frames, "height": height, "width": width, "fps": float(inputs.fps or self.default_fps),
            "audio_num_frames": audio, "use_cross_timestep": True, "return_dict": False,
        }
        if kind != TEXT_TO_VIDEO:  # a timestep per video token (0 on a kept frame's, keyframes' included), the audio's own
            kwargs.update(timestep=TensorSpec((batch, total)), audio_timestep=TensorSpec((batch,)))
        conditioned = f" (latent frame 0 the first frame, {tokens // frames} tokens at timestep 0)" if kind == IMAGE_TO_VIDEO else ""
        if kind == CONDITION:  # LTX2ConditionPipeline passes every token's position, the appended keyframes' too
            kwargs["video_coords"] = TensorSpec((batch, 3, total, 2), "float32")
            appended = sum(1 for n in added if n)
            conditioned = (f" + {sum(added)} keyframe tokens ({appended} keyframe(s) appended)" if appended else
                           " (latent frame 0 a keyframe)")
        return CallSpec("forward", kwargs, description=(
            f"{self.frames(inputs)} frames -> {tokens} video tokens ({frames}x{height}x{width}){conditioned} + {audio} "
            f"audio tokens, {seq} text tokens, batch {batch} (CFG), then 2 guidance calls on batch {batch // 2} per step"))

    # --- run ------------------------------------------------------------------------------------

    def encode(self, pipe, job: Job, device) -> Embeds:
        """The pipeline's encode_prompt as __call__ calls it (CFG on: the negative prompt, "" by default)."""
        pe, mask, npe, nmask = pipe.encode_prompt(
            prompt=job.prompt, negative_prompt=job.negative_prompt, do_classifier_free_guidance=True,
            num_videos_per_prompt=job.num_images, device=device,
            max_sequence_length=job.max_sequence_length or self.default_max_sequence_length)
        return Embeds({"prompt_embeds": pe, "prompt_attention_mask": mask, "negative_prompt_embeds": npe,
                       "negative_prompt_attention_mask": nmask})

    def call_kwargs(self, pipe, job: Job) -> dict:
        """Guidance, frames and frame_rate; image_crf is spent by `encode_image` (the text-to-video call has none)."""
        settings = {k: v for k, v in self.setting_kwargs(job).items() if k != "image_crf"}
        return {"guidance_scale": job.guidance_scale, "num_frames": job.num_frames or self.default_num_frames,
                **settings}

    def decode(self, pipe, latents, job: Job, device) -> list:
        """The video tail of __call__ (its output_type="latent" latents are un-normalised already)."""
        vae = pipe.vae
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0.0: no noise is mixed in
            import torch  # lazy: torch (heavy, off start-up)

            timestep = torch.zeros(latents.shape[0], device=device, dtype=vae.dtype)
        video = vae.decode(latents.to(device, dtype=vae.dtype), timestep, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
        return [to_uint8(frames[i]) for i in range(frames.shape[0])]

    def decode_audio(self, pipe, audio_latents, job: Job, device) -> tuple[list, int]:
        """The audio tail of __call__: the audio VAE to a mel spectrogram, the vocoder to a waveform.
        Returns (one float32 array (channels, samples) per video, the sample rate)."""
        audio_vae = pipe.audio_vae
        mel = audio_vae.decode(audio_latents.to(device, dtype=audio_vae.dtype), return_dict=False)[0]
        waves = pipe.vocoder(mel)
        rate = int(getattr(pipe.vocoder.config, "output_sampling_rate", None) or audio_vae.config.sample_rate)
        return [waves[i].float().cpu().numpy() for i in range(waves.shape[0])], rate


FAMILY = LTX2Family()

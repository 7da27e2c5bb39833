"""LTX-2 (Lightricks; diffusers' LTX2Pipeline): text to video with its synchronized audio track.

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
"""

from __future__ import annotations

from dataclasses import replace

from dm_cli.errors import UsageError
from dm_cli.families import GUIDANCE_BATCH, Embeds, Family, Job, Setting
from dm_cli.families.calls import CallSpec, Component, TensorSpec, sibling_config
from dm_cli.families.stages import AUDIO, AUDIO_LATENTS, EMBEDS, IMAGES, LATENTS, PROMPT, Stage
from dm_cli.inputs import InputSpec

TRANSFORMER = "LTX2VideoTransformer3DModel"
VAE = "AutoencoderKLLTX2Video"
AUDIO_VAE = "AutoencoderKLLTX2Audio"
VOCODER = "LTX2Vocoder"
CONNECTORS = "LTX2TextConnectors"
TEXT_ENCODERS = ("Gemma3ForConditionalGeneration",)
AUDIO_COMPRESSION = 4  # the audio VAE's temporal and mel compression (LATENT_DOWNSAMPLE_FACTOR)
AUDIO_GUIDANCE = 7.0  # LTX2Pipeline.__call__'s audio_guidance_scale: with it CFG is on whatever guidance_scale is


def vae_factors(vae: dict | None) -> tuple[int, int]:
    """(temporal, spatial) compression of the LTX-2 video VAE, as AutoencoderKLLTX2Video computes them."""
    config = vae or {}
    if "spatio_temporal_scaling" not in config:  # no VAE config: LTX-2's (the pipeline's own fallbacks)
        return 8, 32
    scaling = sum(bool(s) for s in config.get("spatio_temporal_scaling") or [True, True, True, True])
    temporal = config.get("temporal_compression_ratio") or int(config.get("patch_size_t", 1)) * 2 ** scaling
    spatial = config.get("spatial_compression_ratio") or int(config.get("patch_size", 4)) * 2 ** scaling
    return int(temporal), int(spatial)


class LTX2Family(Family):
    name = "ltx-2"
    pipelines = ("LTX2Pipeline",)
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
                        for_whom="LTX-2, whose audio length follows the frame rate", instead="use --fps"),)
    # __call__ un-normalises both outputs with the VAEs' statistics while only the denoise stage is loaded
    placeholder_tensors = {"vae": ("latents_mean", "latents_std"), "audio_vae": ("latents_mean", "latents_std")}
    declared_stages = (
        Stage("encode", ("text_encoder",), consumes=(PROMPT,), produces=(EMBEDS,)),
        Stage("denoise", ("connectors", "transformer"), consumes=(EMBEDS,), produces=(LATENTS, AUDIO_LATENTS)),
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

    def check_inputs(self, inputs: InputSpec, vae_config_: dict | None) -> None:
        """Frames t*k + 1 (t the video VAE's temporal compression, 8 for LTX-2); sizes are multiples of 32."""
        temporal, _ = vae_factors(vae_config_)
        frames = inputs.num_frames
        if frames is not None and frames < 1:
            raise UsageError(f"--frames must be at least 1 (got {frames}).")
        if frames is not None and (frames - 1) % temporal:
            lower = frames - (frames - 1) % temporal
            raise UsageError(f"--frames {frames} is not {temporal}k+1, which LTX-2 needs (its VAE compresses "
                             f"{temporal} frames into one): use {max(lower, 1)} or {lower + temporal}.")
        if inputs.fps is not None and inputs.fps < 1:
            raise UsageError(f"--fps must be at least 1 (got {inputs.fps}).")

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
        kwargs = {
            "hidden_states": TensorSpec((batch, tokens, int(config.get("in_channels", 128)))),
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
        return CallSpec("forward", kwargs, description=(
            f"{self.frames(inputs)} frames -> {tokens} video tokens ({frames}x{height}x{width}) + {audio} audio tokens, "
            f"{seq} text tokens, batch {batch} (CFG), then 2 guidance calls on batch {batch // 2} per step"))

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
        return {"guidance_scale": job.guidance_scale, "num_frames": job.num_frames or self.default_num_frames,
                **self.setting_kwargs(job)}

    def decode(self, pipe, latents, job: Job, device) -> list:
        """The video tail of __call__ (its output_type="latent" latents are un-normalised already)."""
        from dm_cli.io.video import to_uint8

        vae = pipe.vae
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0.0: no noise is mixed in
            import torch

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

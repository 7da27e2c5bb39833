"""Wan 2.1 / 2.2 text-to-video (diffusers' WanPipeline): frames, 5-D latents, two experts, video out.

Facts from diffusers 0.42's `pipeline_wan.py`:
- latents are (B, z_dim, (F - 1) / t + 1, H / s, W / s), t and s the VAE's temporal and spatial
  compression (`scale_factor_temporal` 4, `scale_factor_spatial` 8); F must be t*k + 1;
- height and width must be multiples of 16 (the pipeline's check_inputs);
- CFG calls the transformer twice per step with batch B (two calls, not a doubled batch);
- Wan 2.2 A14B has two experts: `transformer` for the steps with t >= boundary_ratio * 1000 (high
  noise), `transformer_2` for the rest (`guidance_scale_2`, default `guidance_scale`, for those);
- the text encoder (UMT5) gets `input_ids` and a mask of max_sequence_length (512) tokens;
- the VAE decodes the latent frames one by one with a feature cache and concatenates the output;
- Wan 2.2 TI2V-5B is a WanPipeline with `expand_timesteps` and the Wan 2.2 VAE (16x16x4, 48 channels): one timestep
  per latent token, and with a first frame it runs as WanImageToVideoPipeline (dm_cli.families.wan_i2v).
"""

from __future__ import annotations

import copy

from dm_cli.errors import UsageError
from dm_cli.families import (
    GUIDANCE_SEPARATE,
    Embeds,
    Family,
    Job,
    Setting,
    check_video_length,
    denormalized,
    family_for,
)
from dm_cli.families.calls import CallSpec, Component, TensorSpec, vae_config
from dm_cli.inputs import InputSpec
from dm_cli.io.video import to_uint8

TRANSFORMER = "WanTransformer3DModel"
VAE = "AutoencoderKLWan"


def vae_factors(vae: dict | None) -> tuple[int, int]:
    """(temporal, spatial) compression of the Wan VAE, as the pipeline reads them (class defaults 4 and 8)."""
    config = vae or {}
    return int(config.get("scale_factor_temporal") or 4), int(config.get("scale_factor_spatial") or 8)


def wan22_vae(vae: dict | None) -> bool:
    """The Wan 2.2 VAE (16x16 spatial, 4 temporal, 48 latent channels): Wan 2.2 TI2V-5B's, whose pipelines expand
    the timestep to one per latent token (`expand_timesteps`) and may start from a first frame."""
    return vae_factors(vae)[1] == 16


def image_to_video() -> Family:
    """The family of WanImageToVideoPipeline (dm_cli.families.wan_i2v), which also runs TI2V-5B's image-to-video."""
    return family_for("WanImageToVideoPipeline")


class WanFamily(Family):
    name = "wan"
    pipelines = ("WanPipeline",)
    denoiser_classes = (TRANSFORMER,)
    experts = ("transformer_2",)
    offload_seq = "text_encoder->transformer->transformer_2->vae"
    guidance = GUIDANCE_SEPARATE  # CFG: a second transformer call per step
    default_steps = 50
    default_guidance = 5.0
    default_max_sequence_length = 512
    default_num_frames = 81
    default_fps = 16
    default_height, default_width = 480, 832
    max_input_images = 1  # Wan 2.2 TI2V-5B's first frame (as WanImageToVideoPipeline); the others refuse one
    settings = (Setting("guidance_scale_2", float, None,
                        "Two-expert pipelines (Wan 2.2 A14B): guidance of the low-noise expert (default: --guidance-scale).",
                        for_whom="pipelines with two experts such as Wan 2.2 A14B", instead="use --guidance-scale",
                        needs_component="transformer_2"),)

    # fbc hooks its blocks; taylorseer's default patterns (`.*attn`) match no Wan module, so its self- and cross-
    # attentions are named (MagCache has no magnitude ratios for Wan in diffusers)
    step_caches = {"fbc": {}, "taylorseer": {"cache_identifiers": (r"blocks\.\d+\.attn1", r"blocks\.\d+\.attn2")}}

    def title(self) -> str:
        return "Wan"

    def matches(self, pipeline_class, component_cls, config) -> bool:
        if pipeline_class:
            return pipeline_class in self.pipelines
        return component_cls in (TRANSFORMER, VAE)

    def denoiser_calls(self, inputs: InputSpec) -> int:
        return 2 if self.guidance_scale(inputs) > 1.0 else 1

    def default_size(self, denoiser_config, vae_config_) -> tuple[int, int]:
        return self.default_height, self.default_width

    def size_multiple(self, denoiser_config, vae_config_) -> int:
        """WanPipeline.check_inputs' 16; the VAE's spatial compression x the patch (WanImageToVideoPipeline rounds
        down to it): 8 x 2 = 16, 32 for the Wan 2.2 VAE."""
        patch = (denoiser_config or {}).get("patch_size") or [1, 2, 2]
        return max(16, vae_factors(vae_config_)[1] * int(patch[1]))

    def check_inputs(self, inputs: InputSpec, vae_config_: dict | None) -> None:
        """Frames t*k + 1 (t the VAE's temporal compression); sizes are `size_multiple`'s (16)."""
        check_video_length(inputs, vae_factors(vae_config_)[0], "Wan")
        self.check_images(inputs, vae_config_)

    def check_images(self, inputs: InputSpec, vae_config_: dict | None) -> None:
        """Of text-to-video pipelines, only TI2V-5B (the Wan 2.2 VAE) makes a video from a first frame."""
        if inputs.image_sizes and not wan22_vae(vae_config_):
            raise UsageError("Wan text-to-video pipelines take no input image (of WanPipelines only Wan 2.2 TI2V-5B, "
                             "with the Wan 2.2 VAE, starts from one): drop --image, or use a WanImageToVideoPipeline.")

    # --- the tracer's view ----------------------------------------------------------------------

    def latent_shape(self, inputs: InputSpec, vae: dict | None, channels: int) -> tuple[int, ...]:
        temporal, spatial = vae_factors(vae)
        frames = (self.frames(inputs) - 1) // temporal + 1
        return (inputs.effective_batch, channels, frames, inputs.height // spatial, inputs.width // spatial)

    def frames(self, inputs: InputSpec) -> int:
        return int(inputs.num_frames or self.default_num_frames)

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        config = comp.config or {}
        seq = self.max_sequence_length(comp, inputs)
        if comp.cls == TRANSFORMER:
            shape = self.latent_shape(inputs, vae_config(comp), int(config.get("in_channels", 16)))
            timestep = TensorSpec((shape[0],))
            if wan22_vae(vae_config(comp)):  # expand_timesteps: one timestep per latent token (TI2V-5B)
                patch = config.get("patch_size") or [1, 2, 2]
                tokens = shape[2] // int(patch[0]) * (shape[3] // int(patch[1])) * (shape[4] // int(patch[2]))
                timestep = TensorSpec((shape[0], tokens))
            kwargs = {
                "hidden_states": TensorSpec(shape),
                "timestep": timestep,
                "encoder_hidden_states": TensorSpec((shape[0], seq, int(config.get("text_dim", 4096)))),
                "return_dict": False,
            }
            calls = self.denoiser_calls(inputs)
            return CallSpec("forward", kwargs, description=(
                f"{self.frames(inputs)} frames -> latents {shape[2]}x{shape[3]}x{shape[4]}, {seq} text tokens, "
                f"batch {shape[0]}, {calls} call{'s' if calls > 1 else ''} per step"))
        if comp.cls == VAE:
            shape = self.latent_shape(inputs, config, int(config.get("z_dim", 16)))
            return CallSpec("decode", {"z": TensorSpec(shape), "return_dict": False}, description=(
                f"decode {self.frames(inputs)} frames from latents {shape[2]}x{shape[3]}x{shape[4]}, batch {shape[0]}"))
        if comp.cls in ("UMT5EncoderModel", "T5EncoderModel"):
            # The pipeline passes an attention mask too; transformers inspects its values (`mask.all()`), which
            # the meta device cannot do. Without it the trace is the same forward (a 512x512 mask is negligible).
            kwargs = {"input_ids": TensorSpec((inputs.batch_size, seq), "long")}
            return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {inputs.batch_size}")
        return None

    # --- run ------------------------------------------------------------------------------------

    def encode(self, pipe, job: Job, device) -> Embeds:
        do_cfg = job.guidance_scale > 1.0
        pe, npe = pipe.encode_prompt(prompt=job.prompt, negative_prompt=job.negative_prompt,
                                     do_classifier_free_guidance=do_cfg, num_videos_per_prompt=job.num_images,
                                     max_sequence_length=job.max_sequence_length or 512, device=device)
        return Embeds({"prompt_embeds": pe, "negative_prompt_embeds": npe} if do_cfg else {"prompt_embeds": pe})

    def call_kwargs(self, pipe, job: Job) -> dict:
        # guidance_scale_2 only when given: else the pipeline uses guidance_scale for both experts
        return {"guidance_scale": job.guidance_scale, "num_frames": job.num_frames or self.default_num_frames,
                **self.setting_kwargs(job)}

    def step_components(self, pipe, job: Job) -> list[str] | None:
        """`transformer` while t >= boundary_ratio * num_train_timesteps, then `transformer_2` (as __call__ does)."""
        ratio = pipe.config.get("boundary_ratio") if hasattr(pipe, "config") else None
        if ratio is None or getattr(pipe, "transformer_2", None) is None:
            return None
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(job.steps, device="cpu")
        boundary = ratio * scheduler.config.num_train_timesteps
        return ["transformer" if t >= boundary else "transformer_2" for t in scheduler.timesteps]

    # --- image-to-video of TI2V-5B (one transformer): WanImageToVideoPipeline's, through its family ------------------

    def stages(self, components: list[str], offload_seq: list[str] | None) -> list:
        """Two experts (Wan 2.2 A14B, text only): encode / denoise / decode. One transformer (Wan 2.1, TI2V-5B): also
        the VAE encode of a first frame before the denoise, as image-to-video runs it (nothing without an image)."""
        if "transformer_2" in components:
            return super().stages(components, offload_seq)
        return image_to_video().stages(components, offload_seq)

    def encode_image(self, pipe, job: Job, device):
        return image_to_video().encode_image(pipe, job, device)

    def denoising_pipeline(self, pipe, job: Job, image_latents=None):
        return image_to_video().denoising_pipeline(pipe, job, image_latents)

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        return image_to_video().image_kwargs(pipe, job, image_latents)

    def decode(self, pipe, latents, job: Job, device) -> list:
        vae = pipe.vae
        latents = latents.to(device, dtype=vae.dtype)
        video = vae.decode(denormalized(vae, latents), return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")
        return [to_uint8(frames[i]) for i in range(frames.shape[0])]


FAMILY = WanFamily()

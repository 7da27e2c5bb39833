"""Wan 2.2 image-to-video: I2V-A14B (WanImageToVideoPipeline) and TI2V-5B's image-to-video.

Facts from diffusers 0.42.1's `pipeline_wan_i2v.py`:
- I2V-A14B has two experts switched at `boundary_ratio` (as Wan 2.2 text-to-video, `dm_cli.families.wan`) and no image
  encoder (`image_dim` None: the transformer gets no image embeddings). Its `prepare_latents` VAE-encodes a
  full-length conditioning video, (1, 3, F, H, W): the first frame, F - 1 zero frames (F - 2 and the last frame with
  `last_image`), takes the distribution's mode (no randomness), normalises it and puts a 4-channel frame mask in front:
  the condition (B, 4 + 16, F', H/8, W/8) is concatenated to the noise on the channels (in_channels 36), never to the
  tokens. The noise is the first draw of the generator.
- TI2V-5B is a WanPipeline with `expand_timesteps` and the Wan 2.2 VAE (16x16x4, 48 channels): text-to-video is
  WanPipeline's own call (one timestep per latent token); image-to-video is WanImageToVideoPipeline's over the same
  components (`WanImageToVideoPipeline.from_pretrained(TI2V folder)`): the first frame alone is encoded, it replaces
  the first latent frame at every step, and that frame's tokens get timestep 0. It takes no last frame.
- `prompt_clean` calls `ftfy.fix_text` unconditionally (ftfy is a dependency).

dmap runs the encode as its own stage (`encode_image`: IMAGE -> IMAGE_LATENTS, the VAE serving it and the decode) by
calling the pipeline's own `prepare_latents` with a generator seeded as the run's, and hands the noise and the
condition to the denoise's __call__ in place of its `prepare_latents` (which would encode again): pixel-identical to
`WanImageToVideoPipeline(...)(image=..., last_image=..., generator=...)`. The tracer's calls are Wan's: the
transformer sees in_channels (36) channels, and the VAE's decode of the output needs more than the encode of the
conditioning video (1.34x at batch 1, traced at 9, 17 and 81 frames), so the VAE is traced for its decode and its
encode stage is planned with that peak. No torch at import.
"""

from __future__ import annotations

from dm_cli.errors import UsageError
from dm_cli.families import Family, Job
from dm_cli.families.calls import CallSpec, Component, TensorSpec
from dm_cli.families.stages import EMBEDS, IMAGE, IMAGE_LATENTS, IMAGES, LATENTS, PROMPT, Stage, declared
from dm_cli.families.wan import WanFamily, wan22_vae
from dm_cli.inputs import Generation, InputSpec
from dm_cli.io.input_images import open_input

PIPELINE = "WanImageToVideoPipeline"
# encode the prompt; VAE-encode the conditioning video; denoise (the experts one at a time); decode
IMAGE_TO_VIDEO_STAGES = (
    Stage("encode", ("text_encoder",), consumes=(PROMPT,), produces=(EMBEDS,)),
    Stage("encode_image", ("vae",), consumes=(IMAGE,), produces=(IMAGE_LATENTS,)),
    Stage("denoise", ("transformer", "transformer_2"), exclusive=True, consumes=(EMBEDS, IMAGE_LATENTS),
          produces=(LATENTS,)),
    Stage("decode", ("vae",), consumes=(LATENTS,), produces=(IMAGES,)),
)


def conditioning_encode(inputs: InputSpec, frames: int, ti2v: bool) -> CallSpec:
    """The VAE encode `prepare_latents` makes: the full-length conditioning video at batch 1 (TI2V: the first frame)."""
    length = 1 if ti2v else frames
    return CallSpec("encode", {"x": TensorSpec((1, 3, length, inputs.height, inputs.width)), "return_dict": False},
                    description=f"encode a {length}-frame conditioning video of {inputs.width}x{inputs.height}")


class WanImageToVideoFamily(WanFamily):
    name = "wan-i2v"
    pipelines = (PIPELINE,)
    min_input_images = 1
    takes_last_image = True
    declared_stages = IMAGE_TO_VIDEO_STAGES

    def title(self) -> str:
        return "Wan image-to-video"

    def matches(self, pipeline_class, component_cls, config) -> bool:
        return pipeline_class in self.pipelines  # a lone Wan component is Wan's (dm_cli.families.wan)

    def stages(self, components: list[str], offload_seq: list[str] | None) -> list:
        return declared(self.declared_stages, components)

    def check_images(self, inputs: InputSpec, vae_config_: dict | None) -> None:
        """A first frame is what it takes (counted by min/max_input_images)."""

    # --- one generation ---------------------------------------------------------------------------

    def validate(self, generation: Generation, pipeline_class: str, denoiser_config: dict, vae_config: dict | None,
                 components: tuple[str, ...] = (), per_prompt_images: bool = False) -> None:
        if generation.last_image is not None and not generation.weights_only:
            if wan22_vae(vae_config):
                raise UsageError("Wan 2.2 TI2V-5B starts from a first frame only (its pipeline expands timesteps and "
                                 "ignores a last one): drop --last-image.")
            if not generation.images and not per_prompt_images:
                raise UsageError("--last-image is the last frame of a video from a first frame: add --image PATH.")
        super().validate(generation, pipeline_class, denoiser_config, vae_config, components, per_prompt_images)

    def refusal(self, generation: Generation, components: tuple[str, ...] = ()) -> str | None:
        if "image_encoder" in components:
            return ("This WanImageToVideoPipeline has a CLIP image encoder (Wan 2.1 I2V), which dmap does not run: "
                    "dmap runs Wan 2.2 image-to-video (I2V-A14B, TI2V-5B), which has none.")
        return super().refusal(generation, components)

    # --- the tracer's view ------------------------------------------------------------------------

    def call_spec(self, comp: Component, inputs: InputSpec) -> CallSpec | None:
        spec = super().call_spec(comp, inputs)
        if spec is None or spec.method != "decode" or inputs.weights_only:
            return spec
        encode = conditioning_encode(inputs, self.frames(inputs), wan22_vae(comp.config))
        return CallSpec(spec.method, spec.kwargs, spec.upcast_fp16,
                        description=f"{spec.description}; its {encode.description} needs less")

    # --- run --------------------------------------------------------------------------------------

    def denoising_pipeline(self, pipe, job: Job, image_latents=None):
        """`pipe`, or for TI2V-5B's image-to-video (a WanPipeline folder) a WanImageToVideoPipeline over its
        components, as `WanImageToVideoPipeline.from_pretrained` builds it from the same folder. With the
        `image_latents` of `encode_image`, its `prepare_latents` returns them for one call instead of encoding again."""
        import diffusers  # lazy: diffusers (heavy, off start-up)

        target = pipe
        if job.images and not isinstance(pipe, diffusers.WanImageToVideoPipeline):
            target = image_to_video_pipeline(pipe)
        if image_latents is not None and image_latents.numel():
            prepared = unpacked(image_latents.to(pipe._dmap_device), target.vae.config.z_dim,
                                bool(target.config.get("expand_timesteps")))

            def prepare_latents(*_args, **_kwargs):
                del target.prepare_latents  # one call: the pipeline's own method is back for anything after it
                return prepared

            target.prepare_latents = prepare_latents
        return target

    def encode_image(self, pipe, job: Job, device):
        """The noise and the condition of WanImageToVideoPipeline.prepare_latents (the pipeline's own, with the VAE
        loaded and the run's seed), in one tensor on the channels: noise, condition (and TI2V's first-frame mask).
        No image (TI2V-5B from text): an empty tensor, and the denoise is WanPipeline's own."""
        import torch  # lazy: torch (heavy, off start-up)

        if not job.images:
            return torch.zeros(0)
        i2v = self.denoising_pipeline(pipe, job)

        def frame(image):
            pixels = i2v.video_processor.preprocess(open_input(image), height=job.height, width=job.width)
            return pixels.to(device, dtype=torch.float32)

        last = frame(job.last_image) if job.last_image is not None else None
        frames = job.num_frames or self.default_num_frames
        # the class's method: never a stale one-call stand-in of `image_kwargs`
        out = type(i2v).prepare_latents(i2v, frame(job.images[0]), job.num_images or 1, i2v.vae.config.z_dim,
                                        job.height, job.width, frames, torch.float32, device,
                                        torch.Generator().manual_seed(job.seed), None, last)
        if len(out) == 3:  # expand_timesteps: the first frame's condition (B, C, 1, h, w) and its mask ride along
            latents, condition, mask = out
            frames = latents.shape[2]
            return torch.cat([latents, condition.expand(-1, -1, frames, -1, -1),
                              mask.expand(latents.shape[0], -1, -1, -1, -1)], dim=1)
        return torch.cat(out, dim=1)

    def image_kwargs(self, pipe, job: Job, image_latents) -> dict:
        """The first frame as `image` (the call checks and preprocesses it; `denoising_pipeline` hands it the
        prepared latents)."""
        if not image_latents.numel():
            return {}
        return {"image": open_input(job.images[0])}


def image_to_video_pipeline(pipe):
    """WanImageToVideoPipeline over a TI2V-5B WanPipeline's components, its execution device the stage loop's (as
    dm_cli.run.load.loading builds pipelines)."""
    import diffusers  # lazy: diffusers (heavy, off start-up)

    if not pipe.config.get("expand_timesteps"):
        raise UsageError("This WanPipeline does not expand timesteps (model_index.json), which image-to-video with "
                         "one transformer needs (Wan 2.2 TI2V-5B): drop --image.")
    cls = diffusers.WanImageToVideoPipeline
    staged = type(cls.__name__, (cls,), {"_execution_device": property(lambda _self: pipe._dmap_device)})
    sibling = staged(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                     transformer=pipe.transformer, transformer_2=getattr(pipe, "transformer_2", None),
                     boundary_ratio=pipe.config.get("boundary_ratio"), expand_timesteps=True)
    sibling.set_progress_bar_config(disable=True)
    return sibling


def unpacked(image_latents, channels: int, expand_timesteps: bool) -> tuple:
    """`encode_image`'s tensor as prepare_latents returns it: (noise, condition) or (noise, condition, mask)."""
    noise = image_latents[:, :channels]
    if expand_timesteps:
        return noise, image_latents[:, channels:2 * channels, :1], image_latents[:1, 2 * channels:]
    return noise, image_latents[:, channels:]


FAMILY: Family = WanImageToVideoFamily()

"""Wan 2.1 / 2.2 text-to-video (diffusers' WanPipeline): frames, 5-D latents, the two experts.

Facts from diffusers 0.42's `pipeline_wan.py`, as plain data (no torch):
- latents are (B, z_dim, (F - 1) / t + 1, H / s, W / s), t and s the VAE's temporal and spatial
  compression (`scale_factor_temporal` 4, `scale_factor_spatial` 8); F must be t*k + 1;
- height and width must be multiples of 16 (the pipeline's check_inputs);
- CFG calls the transformer twice per step with batch B (two calls, not a doubled batch);
- Wan 2.2 A14B has two experts: `transformer` for the steps with t >= boundary_ratio * 1000 (high
  noise), `transformer_2` for the rest, with `guidance_scale_2` for the low-noise steps;
- the text encoder (UMT5) gets `input_ids` (and a mask) of max_sequence_length (512) tokens;
- the VAE decodes the latent frames one by one with a feature cache and concatenates the output.
"""

from __future__ import annotations

from .errors import UsageError
from .inputs import InputSpec
from .pipelines import CallSpec, TensorSpec, sibling_config

PIPELINES = ("WanPipeline",)
TRANSFORMER = "WanTransformer3DModel"
VAE = "AutoencoderKLWan"
EXPERTS = ("transformer", "transformer_2")  # high-noise expert, low-noise expert
DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 5.0, "max_sequence_length": 512,
            "fps": 16}
SIZE_MULTIPLE = 16  # WanPipeline.check_inputs


def is_wan(pipeline_class: str | None, component_cls: str) -> bool:
    if pipeline_class:
        return pipeline_class in PIPELINES
    return component_cls in (TRANSFORMER, VAE)


def vae_factors(vae_config: dict | None) -> tuple[int, int]:
    """(temporal, spatial) compression of the Wan VAE, as the pipeline reads them (defaults 4 and 8)."""
    config = vae_config or {}
    temporal = config.get("scale_factor_temporal") or 4
    spatial = config.get("scale_factor_spatial") or 8
    return int(temporal), int(spatial)


def num_frames(inputs: InputSpec) -> int:
    return int(inputs.num_frames) if inputs.num_frames else DEFAULTS["num_frames"]


def check_inputs(inputs: InputSpec, vae_config: dict | None) -> None:
    """Wan's own rules, one clear sentence each: frames t*k + 1, height and width multiples of 16."""
    temporal, _ = vae_factors(vae_config)
    frames = inputs.num_frames
    if frames is not None:
        if frames < 1:
            raise UsageError(f"--frames must be at least 1 (got {frames}).")
        if (frames - 1) % temporal:
            lower = frames - (frames - 1) % temporal
            raise UsageError(
                f"--frames {frames} is not {temporal}k+1, which Wan needs (its VAE compresses {temporal} frames into "
                f"one): use {max(lower, 1)} or {lower + temporal}."
            )
    if inputs.weights_only:
        return
    for flag, value in (("--height", inputs.height), ("--width", inputs.width)):
        if value % SIZE_MULTIPLE:
            lower = max(SIZE_MULTIPLE, value - value % SIZE_MULTIPLE)
            raise UsageError(f"{flag} {value} is not a multiple of {SIZE_MULTIPLE}, which WanPipeline needs: "
                             f"use {lower} or {lower + SIZE_MULTIPLE}.")


def latent_shape(inputs: InputSpec, vae_config: dict | None, channels: int) -> tuple[int, int, int, int, int]:
    temporal, spatial = vae_factors(vae_config)
    frames = (num_frames(inputs) - 1) // temporal + 1
    return (inputs.effective_batch, channels, frames, inputs.height // spatial, inputs.width // spatial)


def sequence_length(inputs: InputSpec) -> int:
    return int(inputs.max_sequence_length or DEFAULTS["max_sequence_length"])


def guidance(inputs: InputSpec) -> float:
    return float(inputs.guidance_scale if inputs.guidance_scale is not None else DEFAULTS["guidance_scale"])


def call_spec(comp, inputs: InputSpec) -> CallSpec | None:
    """The call WanPipeline makes to this component for `inputs` (None: not a Wan component)."""
    config = comp.config or {}
    cls = comp.cls
    prompts = inputs.batch_size
    seq = sequence_length(inputs)
    if cls == TRANSFORMER:
        vae = sibling_config(comp, "vae")
        shape = latent_shape(inputs, vae, int(config.get("in_channels", 16)))
        calls = "2 calls per step (CFG)" if guidance(inputs) > 1.0 else "1 call per step"
        kwargs = {
            "hidden_states": TensorSpec(shape),
            "timestep": TensorSpec((shape[0],)),
            "encoder_hidden_states": TensorSpec((shape[0], seq, int(config.get("text_dim", 4096)))),
            "return_dict": False,
        }
        frames = num_frames(inputs)
        return CallSpec("forward", kwargs, description=(
            f"{frames} frames -> latents {shape[2]}x{shape[3]}x{shape[4]}, {seq} text tokens, batch {shape[0]}, {calls}"))
    if cls == VAE:
        shape = latent_shape(inputs, config, int(config.get("z_dim", 16)))
        return CallSpec("decode", {"z": TensorSpec(shape), "return_dict": False},
                        description=f"decode {num_frames(inputs)} frames from latents {shape[2]}x{shape[3]}x{shape[4]}, "
                                    f"batch {shape[0]}")
    if cls in ("UMT5EncoderModel", "T5EncoderModel"):
        # The pipeline passes an attention mask too; transformers inspects its values (`mask.all()`), which
        # the meta device cannot do. Without it the trace is the same forward (a 512x512 mask is negligible).
        kwargs = {"input_ids": TensorSpec((prompts, seq), "long")}
        return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {prompts}")
    return None

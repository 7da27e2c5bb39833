"""What each pipeline feeds each of its models, as plain data (no torch).

The tracer turns a `CallSpec` into meta tensors; the planner and runner can read the same facts
(CFG doubling, default sequence lengths, VAE scale factor). Numbers follow diffusers 0.42's
pipelines; see the table "What each pipeline feeds its models" in the reference README.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .inputs import InputSpec

# family -> default guidance_scale of the pipeline's __call__
DEFAULT_GUIDANCE = {"flux": 3.5, "sdxl": 5.0, "sd15": 7.5, "sd3": 7.0, "wan": 5.0}
CFG_FAMILIES = ("sdxl", "sd15", "sd3")  # classifier-free guidance runs the denoiser on 2B samples
CLIP_TOKENS = 77


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor: shape and kind ("float": the model's dtype, "long": token ids)."""

    shape: tuple[int, ...]
    kind: str = "float"


@dataclass
class CallSpec:
    """How the pipeline calls a component: method name and arguments (TensorSpec, dict of them, or constants)."""

    method: str  # "forward" or e.g. "decode"
    kwargs: dict = field(default_factory=dict)
    upcast_fp16: bool = False  # the pipeline runs it in float32 when loaded in float16 (SDXL VAE, force_upcast)
    description: str = ""

    def shapes(self) -> dict:
        """JSON-friendly view of the arguments, for cache keys and reports."""

        def view(value):
            if isinstance(value, TensorSpec):
                return {"shape": list(value.shape), "kind": value.kind}
            if isinstance(value, dict):
                return {k: view(v) for k, v in value.items()}
            return value

        return {"method": self.method, "kwargs": view(self.kwargs), "upcast_fp16": self.upcast_fp16}


def pipeline_family(pipeline_class: str | None, component_cls: str, config: dict | None) -> str | None:
    """flux / sdxl / sd15 / sd3 from the pipeline class, else guessed from the denoiser class."""
    name = pipeline_class or ""
    if "Flux" in name:
        return "flux"
    if "StableDiffusion3" in name:
        return "sd3"
    if name == "WanPipeline":
        return "wan"
    if "StableDiffusionXL" in name:
        return "sdxl"
    if "StableDiffusion" in name:
        return "sd15"
    if pipeline_class:
        return None
    config = config or {}
    if component_cls == "FluxTransformer2DModel":
        return "flux"
    if component_cls == "SD3Transformer2DModel":
        return "sd3"
    if component_cls in ("WanTransformer3DModel", "AutoencoderKLWan"):
        return "wan"
    if component_cls == "UNet2DConditionModel":
        return "sdxl" if config.get("addition_embed_type") == "text_time" else "sd15"
    return None


def guidance_scale(family: str | None, inputs: InputSpec) -> float:
    if inputs.guidance_scale is not None:
        return float(inputs.guidance_scale)
    return DEFAULT_GUIDANCE.get(family or "", 1.0)


def cfg_multiplier(family: str | None, inputs: InputSpec) -> int:
    """2 when the pipeline doubles the denoiser batch for classifier-free guidance."""
    return 2 if family in CFG_FAMILIES and guidance_scale(family, inputs) > 1.0 else 1


def sibling_config(comp, name: str) -> dict | None:
    """config.json of another component of the same pipeline folder (e.g. the VAE's), if present."""
    folder = getattr(comp, "folder", None)
    if folder is None:
        return None
    path = Path(folder).parent / name / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def vae_scale_factor(comp, config: dict | None) -> int:
    """2 ** (len(vae.block_out_channels) - 1), as the pipelines compute it; 8 without a VAE config."""
    vae = config if (config or {}).get("_class_name", "").startswith("Autoencoder") else sibling_config(comp, "vae")
    blocks = (vae or {}).get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8


def max_sequence_length(family: str | None, comp, inputs: InputSpec) -> int:
    """T5 tokens: the user's value, else 512 for FLUX dev, 256 for schnell (no guidance embedding) and SD3."""
    if inputs.max_sequence_length:
        return int(inputs.max_sequence_length)
    if family == "flux":
        config = comp.config if comp.cls == "FluxTransformer2DModel" else sibling_config(comp, "transformer")
        if config is not None and not config.get("guidance_embeds", False):
            return 256
        return 512
    return 256


def _latent_hw(family: str | None, inputs: InputSpec, factor: int) -> tuple[int, int]:
    if family == "flux":  # packed 2x2 latents: height = 2 * (H // (factor * 2))
        return 2 * (inputs.height // (factor * 2)), 2 * (inputs.width // (factor * 2))
    return inputs.height // factor, inputs.width // factor


def call_spec(comp, pipeline_class: str | None, inputs: InputSpec) -> CallSpec | None:
    """The call the pipeline makes to this component for `inputs`; None when dmap does not know it."""
    config = comp.config or {}
    cls = comp.cls
    family = pipeline_family(pipeline_class, cls, config)
    images = inputs.effective_batch
    prompts = inputs.batch_size
    factor = vae_scale_factor(comp, config)
    latent_h, latent_w = _latent_hw(family, inputs, factor)
    seq = max_sequence_length(family, comp, inputs)
    if family == "wan":
        from .wan import call_spec as wan_call_spec

        return wan_call_spec(comp, inputs)

    if cls == "FluxTransformer2DModel":
        tokens = (latent_h // 2) * (latent_w // 2)
        kwargs = {
            "hidden_states": TensorSpec((images, tokens, config.get("in_channels", 64))),
            "encoder_hidden_states": TensorSpec((images, seq, config.get("joint_attention_dim", 4096))),
            "pooled_projections": TensorSpec((images, config.get("pooled_projection_dim", 768))),
            "timestep": TensorSpec((images,)),
            "img_ids": TensorSpec((tokens, 3)),
            "txt_ids": TensorSpec((seq, 3)),
            "return_dict": False,
        }
        if config.get("guidance_embeds", False):
            kwargs["guidance"] = TensorSpec((images,))
        return CallSpec("forward", kwargs, description=f"{tokens} image tokens, {seq} text tokens, batch {images}")

    if cls == "SD3Transformer2DModel":
        batch = images * cfg_multiplier(family or "sd3", inputs)
        kwargs = {
            "hidden_states": TensorSpec((batch, config.get("in_channels", 16), latent_h, latent_w)),
            "encoder_hidden_states": TensorSpec((batch, CLIP_TOKENS + seq, config.get("joint_attention_dim", 4096))),
            "pooled_projections": TensorSpec((batch, config.get("pooled_projection_dim", 2048))),
            "timestep": TensorSpec((batch,)),
            "return_dict": False,
        }
        return CallSpec("forward", kwargs, description=f"latents {latent_h}x{latent_w}, batch {batch}")

    if cls == "UNet2DConditionModel":
        batch = images * cfg_multiplier(family, inputs)
        cross = config.get("cross_attention_dim", 768)
        if isinstance(cross, (list, tuple)):
            cross = cross[0]
        kwargs = {
            "sample": TensorSpec((batch, config.get("in_channels", 4), latent_h, latent_w)),
            "timestep": TensorSpec(()),
            "encoder_hidden_states": TensorSpec((batch, CLIP_TOKENS, cross)),
            "return_dict": False,
        }
        if config.get("addition_embed_type") == "text_time":
            time_dim = config.get("addition_time_embed_dim", 256)
            text_dim = config.get("projection_class_embeddings_input_dim", 2816) - 6 * time_dim
            kwargs["added_cond_kwargs"] = {
                "text_embeds": TensorSpec((batch, text_dim)),
                "time_ids": TensorSpec((batch, 6)),
            }
        return CallSpec("forward", kwargs, description=f"latents {latent_h}x{latent_w}, batch {batch}")

    if cls.startswith("Autoencoder") and "latent_channels" in config:
        upcast = family == "sdxl" and bool(config.get("force_upcast", True))
        kwargs = {"z": TensorSpec((images, config["latent_channels"], latent_h, latent_w)), "return_dict": False}
        return CallSpec("decode", kwargs, upcast, description=f"decode latents {latent_h}x{latent_w}, batch {images}")

    if cls.startswith("CLIPText"):
        length = min(CLIP_TOKENS, config.get("max_position_embeddings", CLIP_TOKENS))
        kwargs = {"input_ids": TensorSpec((prompts, length), "long")}
        if family in ("sdxl", "sd3"):
            kwargs["output_hidden_states"] = True  # these pipelines read the penultimate hidden state
        return CallSpec("forward", kwargs, description=f"{length} tokens, batch {prompts}")

    if cls in ("T5EncoderModel", "UMT5EncoderModel"):
        kwargs = {"input_ids": TensorSpec((prompts, seq), "long")}
        return CallSpec("forward", kwargs, description=f"{seq} tokens, batch {prompts}")

    return None


# Argument names the generic fallback knows how to fill, from the component's config.
def generic_argument(name: str, comp, inputs: InputSpec):
    """A plausible value for one forward argument of an unknown model, or None."""
    config = comp.config or {}
    batch = inputs.effective_batch
    factor = vae_scale_factor(comp, config)
    latent_h, latent_w = max(1, inputs.height // factor), max(1, inputs.width // factor)
    cross = config.get("cross_attention_dim") or config.get("joint_attention_dim") or config.get("hidden_size") or 768
    if isinstance(cross, (list, tuple)):
        cross = cross[0]
    if name in ("sample", "hidden_states", "x", "latents"):
        return TensorSpec((batch, config.get("in_channels", 4), latent_h, latent_w))
    if name in ("timestep", "timesteps", "t"):
        return TensorSpec((batch,))
    if name == "encoder_hidden_states":
        return TensorSpec((batch, CLIP_TOKENS, cross))
    if name == "controlnet_cond":
        return TensorSpec((batch, config.get("conditioning_channels", 3), inputs.height, inputs.width))
    if name in ("pixel_values", "images"):
        return TensorSpec((batch, config.get("in_channels", 3), inputs.height, inputs.width))
    if name == "input_ids":
        length = min(CLIP_TOKENS, config.get("max_position_embeddings", CLIP_TOKENS))
        return TensorSpec((inputs.batch_size, length), "long")
    if name == "return_dict":
        return False
    return None

"""What pipelines feed their models, as plain data (no torch): call specs, and the calls families share.

The tracer turns a `CallSpec` into meta tensors. Which call a component gets is its family's
(`dm_cli.families`); `call_spec` asks the family and falls back on the shared component calls.
Numbers follow diffusers 0.42's pipelines; see the reference README.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dm_cli.errors import CheckpointError
from dm_cli.inputs import InputSpec
from dm_cli.io.checkpoint import read_json_object

CLIP_TOKENS = 77


class Component(Protocol):
    """What a family reads of a pipeline component: `dm_cli.model.sources.ComponentSource` has it (the families
    wing sits beside the model wing, not above it, so it names the shape and not the class)."""

    name: str
    cls: str
    config: dict | None
    folder: Path | None


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor: shape and kind ("float": the model's dtype, "long": token ids, "bool": masks,
    "float32": float32 whatever the model's dtype)."""

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


def sibling_config(comp: Component, name: str) -> dict | None:
    """config.json of another component of the same pipeline folder (e.g. the VAE's), if present."""
    folder = getattr(comp, "folder", None)
    if folder is None:
        return None
    try:
        return read_json_object(Path(folder).parent / name / "config.json", "config.json")
    except CheckpointError:
        return None


def vae_config(comp: Component) -> dict | None:
    """The VAE config of `comp`'s pipeline (its own when it is the VAE)."""
    config = comp.config or {}
    return config if config.get("_class_name", "").startswith("Autoencoder") else sibling_config(comp, "vae")


def block_scale(vae: dict | None) -> int:
    """2 ** (len(vae.block_out_channels) - 1), as the pipelines compute it; 8 without a VAE config."""
    blocks = (vae or {}).get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8


def vae_scale_factor(comp: Component, config: dict | None = None) -> int:
    """`block_scale` of the VAE: `config` when it is the VAE's own, else the pipeline's VAE."""
    return block_scale(config if (config or {}).get("_class_name", "").startswith("Autoencoder") else vae_config(comp))


# --- calls of components many families share ----------------------------------------------------


def component_call(comp: Component, inputs: InputSpec, *, latent_hw: tuple[int, int] | None = None,
                   clip_hidden_states: bool = False, seq: int | None = None, upcast_fp16: bool = False) -> CallSpec | None:
    """VAE decode, CLIP and T5 text encoders, called as the diffusers pipelines call them."""
    config = comp.config or {}
    seq = seq or inputs.max_sequence_length or 256
    cls = comp.cls
    images, prompts = inputs.effective_batch, inputs.batch_size
    if cls.startswith("Autoencoder") and "latent_channels" in config:
        factor = vae_scale_factor(comp, config)
        latent_h, latent_w = latent_hw or (inputs.height // factor, inputs.width // factor)
        kwargs = {"z": TensorSpec((images, config["latent_channels"], latent_h, latent_w)), "return_dict": False}
        return CallSpec("decode", kwargs, upcast_fp16,
                        description=f"decode latents {latent_h}x{latent_w}, batch {images}")
    if cls.startswith("CLIPText"):
        length = min(CLIP_TOKENS, config.get("max_position_embeddings", CLIP_TOKENS))
        kwargs = {"input_ids": TensorSpec((prompts, length), "long")}
        if clip_hidden_states:
            kwargs["output_hidden_states"] = True  # SDXL and SD3 read the penultimate hidden state
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

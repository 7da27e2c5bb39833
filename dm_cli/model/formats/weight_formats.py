"""Smaller weights: fp8 storage through diffusers' layerwise casting, int8 weight-only through torchao.

One rule decides which tensors are stored in low precision, and `inspect`, `plan` and `run` all use
it, so planned bytes are the bytes the runner really allocates:

- a module is skipped (with everything under it) when one of its skip patterns matches its dotted
  name with `re.search`: diffusers' `DEFAULT_SKIP_MODULES_PATTERN` (norms, positional and patch
  embeddings, `proj_in`/`proj_out`), plus the class's `_skip_layerwise_casting_patterns` and
  `_keep_in_fp32_modules` (and transformers' `_keep_in_fp32_modules_strict`), exactly as
  `ModelMixin.enable_layerwise_casting` builds its list;
- otherwise a Conv/ConvTranspose/Linear/Embedding layer (diffusers' supported layer classes) is cast
  as a whole: its floating tensors are stored in float8_e4m3fn and upcast to the run dtype for its
  forward, one layer at a time (`diffusers.hooks.apply_layerwise_casting`, which works on
  transformers text encoders too);
- for int8, the weights of the same nn.Linear layers become torchao `Int8Tensor`s (int8 data, one
  float32 scale and one int8 zero point per output row); biases and everything else stay in the run dtype;
- for nf4, the weights of the nn.Linear layers bitsandbytes' 4-bit loading converts (its own rule, which is
  not the fp8 one: `nf4.py`) become packed NF4 `Params4bit`s; biases and everything else stay in the run dtype.

The pure part (names, the spec parser, byte sizes, the transient compute copy) needs no torch; the
tags are computed once on the meta device when a skeleton is built, and the loader at the end is
the only part that touches real weights.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

from dm_cli.devices import covers, streams_blocks
from dm_cli.errors import UsageError
from dm_cli.model.formats.nf4 import nf4_bytes, nf4_layers
from dm_cli.units import DTYPE_ALIASES, DTYPE_BYTES

# format name -> dtype the bulk of the converted tensors is stored in
STORAGE_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8", "nf4": "uint8"}  # nf4: two 4-bit values a byte
FP8_NAMES = ("fp8", "float8", "float8_e4m3fn")  # what --weights and --dtype accept for fp8
FORMAT_OF_DTYPE = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
# torchao Int8Tensor (weight-only, per output row): a float32 scale and an int8 zero point per row
INT8_ROW_BYTES = 4 + 1
# the component a bare `--weights fp8` leaves alone: small, and its convolutions decide the pixels
KEPT_BY_DEFAULT = ("vae",)
TORCHAO_VERSION = "0.18.0"


def parse_weights_spec(spec: str | None, components: list[str]) -> dict[str, str | None]:
    """`fp8`, `int8`, `none` or `name=fmt,...`: component -> format (None: weights in the run dtype).

    A bare format applies to every component but the VAE; components the spec does not cover are
    left out (they keep what their checkpoint stores: see `component_format`).
    """
    out: dict[str, str | None] = {}
    if spec is None or not spec.strip():
        return out
    named: dict[str, str | None] = {}
    for item in spec.split(","):
        name, sep, value = item.strip().partition("=")
        fmt = _format(value if sep else name, spec)
        if not sep:
            out.update({c: fmt for c in components if c not in KEPT_BY_DEFAULT})
            continue
        if name.strip() not in components:
            raise UsageError(f"--weights names component '{name.strip()}', which this source lacks: it has "
                             f"{', '.join(components)}.")
        named[name.strip()] = fmt
    out.update(named)
    return out


def component_format(formats: dict[str, str | None], name: str, skeleton) -> str | None:
    """The format asked for this component, else fp8 when its checkpoint already stores fp8.

    A checkpoint without a config (header-only skeleton, class "?") is sized as stored: which layers
    a run would cast is unknown, so it is not treated as fp8 unless asked, and asking is refused."""
    if name in formats:
        if formats[name] and skeleton.cls == "?":
            raise UsageError(f"--weights {formats[name]} needs the config of '{name}' (which layers are cast): "
                             "give its folder with config.json.")
        return formats[name]
    return "fp8" if skeleton.stored and skeleton.cls != "?" and any(t.dtype == STORAGE_DTYPES["fp8"] for t in skeleton.tensors) else None


def _format(text: str, spec: str) -> str | None:
    value = text.strip().lower()
    if value in ("none", "") or value in DTYPE_ALIASES:  # a plain dtype: the run dtype, no low-precision storage
        if not value:
            raise UsageError(f"--weights '{spec}' has an empty entry: use fp8, int8, nf4 or none, e.g. transformer=fp8.")
        return None
    if value in FP8_NAMES:
        return "fp8"
    if value in ("int8", "nf4"):
        return value
    raise UsageError(f"Unknown weight format '{text.strip()}' in --weights: use fp8, int8, nf4 or none.")


def int8_offload_problem(name: str, fmt: str | None, device_map: dict) -> str | None:
    """Why a run cannot load this component, or None: torchao's int8 tensors and bitsandbytes' NF4 ones cannot be
    streamed from cpu/disk by accelerate's hooks (they would be re-quantized on every use; diffusers refuses such
    a map too), so such a component with blocks there is refused unless it sits all on the cpu, which then simply
    runs it (`--simulate` runs every device on the cpu, so it is never refused there)."""
    if fmt not in ("int8", "nf4") or not streams_blocks(device_map):
        return None
    return (f"The plan offloads blocks of '{name}' to cpu/disk, which {fmt} weights cannot be streamed from: "
            f"plan with more GPU memory or with --weights {name}=fp8.")


def storage_dtype(fmt: str | None, dtype: str) -> str:
    """What the plan JSON records per component: the low-precision dtype, or the run dtype."""
    return STORAGE_DTYPES[fmt] if fmt else dtype


def format_of(storage) -> str | None:
    """fp8 / int8 / nf4 from a plan's `storage_dtype` (anything else, a run-dtype or a damaged value: None)."""
    return FORMAT_OF_DTYPE.get(storage) if isinstance(storage, str) else None


def low_precision_bytes(fmt: str, shape: tuple[int, ...], numel: int) -> int:
    if fmt == "nf4":
        return nf4_bytes(numel)
    if fmt == "int8":
        return numel + (shape[0] if shape else 1) * INT8_ROW_BYTES
    return numel  # float8: one byte per element


# --- transient memory ------------------------------------------------------------------------


def layer_compute_bytes(tensors, fmt: str | None, compute_dtype: str | None) -> dict[str, int]:
    """Layer prefix -> bytes of its compute copy (the upcast weights while its forward runs)."""
    layers: dict[str, int] = {}
    for tensor in tensors:
        if tensor.quantized_bytes:  # GGUF: diffusers dequantizes the weight for each forward
            prefix = tensor.name.rpartition(".")[0]
            layers[prefix] = layers.get(prefix, 0) + tensor.numel * DTYPE_BYTES[compute_dtype or "bfloat16"]
        elif fmt and fmt in tensor.low_precision:
            prefix = tensor.name.rpartition(".")[0]
            layers[prefix] = layers.get(prefix, 0) + tensor.bytes_at(compute_dtype)
    return layers


def transient_by_key(keys: list[tuple[str, ...]], layers: dict[str, int]) -> list[int]:
    """For each block (its device_map keys): the compute copy of its largest low-precision layer."""
    out = []
    for block_keys in keys:
        largest = 0
        for layer, nbytes in layers.items():
            if any(covers(k, layer) for k in block_keys):
                largest = max(largest, nbytes)
        out.append(largest)
    return out


# --- the rule on a built model (needs torch) ---------------------------------------------------


def skip_patterns(model) -> tuple[str, ...]:
    """The module-name patterns kept in high precision, as `ModelMixin.enable_layerwise_casting` builds them."""
    # diffusers: imported on use, so start-up stays free of torch
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    patterns = set(DEFAULT_SKIP_MODULES_PATTERN)
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict", "_skip_layerwise_casting_patterns"):
        patterns.update(getattr(model, attr, None) or ())
    return tuple(sorted(patterns))


def low_precision_tags(model) -> dict[str, tuple[str, ...]]:
    """Tensor name -> the formats that store it in low precision (tied names: every alias listed).

    Walks the module tree exactly as diffusers' `_apply_layerwise_casting` does.
    """
    # torch and diffusers: imported on use, so start-up stays free of torch
    import torch
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    patterns = skip_patterns(model)
    tags: dict[str, tuple[str, ...]] = {}

    def walk(module, prefix: str) -> None:
        if any(re.search(pattern, prefix) for pattern in patterns):
            return
        if isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            linear = isinstance(module, torch.nn.Linear)
            tensors = list(module.named_parameters(remove_duplicate=False)) + list(
                module.named_buffers(remove_duplicate=False))
            for name, tensor in tensors:
                if tensor is not None and tensor.is_floating_point():
                    full = f"{prefix}.{name}" if prefix else name
                    tags[full] = ("fp8", "int8") if linear and name == "weight" else ("fp8",)
            return
        for name, child in module.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    for layer in nf4_layers(model):  # bitsandbytes' own rule, which keeps fewer layers than layerwise casting
        full = f"{layer}.weight"
        tags[full] = (*tags.get(full, ()), "nf4")
    return tags


# --- applying it to a loaded model (needs torch) -------------------------------------------------


def apply_fp8(model, compute_dtype) -> None:
    """diffusers' layerwise casting with the rule above (a no-op cast for tensors already in fp8).

    transformers reads a model's `dtype` from its first floating parameter, which is now fp8, and
    the pipelines cast prompt embeddings to that dtype (FluxPipeline then fails drawing fp8 noise).
    Such a model reports its compute dtype instead, as diffusers' `ModelMixin.dtype` does under
    layerwise casting.
    """
    # torch and diffusers: imported on use, so start-up stays free of torch
    import torch
    from diffusers import ModelMixin
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype,
                            skip_modules_pattern=skip_patterns(model))
    if not isinstance(model, ModelMixin):
        cls = type(model)
        model.__class__ = type(cls.__name__, (cls,), {"dtype": property(lambda _self: compute_dtype),
                                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def quiet_torchao() -> None:
    """diffusers imports torchao when it is installed; on CPU builds its import logs kernels it cannot load."""
    for name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
        logging.getLogger(name).setLevel(logging.ERROR)


def torchao():
    """torchao's quantize_ and its weight-only int8 config, or a clear refusal when it cannot run here."""
    quiet_torchao()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # torchao: imported on use, so start-up stays free of torch
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception as error:  # noqa: BLE001 - missing, or built for another torch
        raise UsageError(
            f"--weights int8 needs torchao, which cannot be imported here ({type(error).__name__}: {error}): "
            f"install torchao=={TORCHAO_VERSION} or run with --weights fp8; plans are made without it."
        ) from None
    return quantize_, Int8WeightOnlyConfig


def quantize_int8(module) -> None:
    """Weight-only int8 on one nn.Linear, in place (its weight must be real, in the run dtype)."""
    quantize_, config = torchao()
    quantize_(module, config())


@dataclass
class LoadedTensor:
    """Where one checkpoint tensor goes: its file and stored name, and the dtypes it passes through."""

    name: str
    file: str
    stored_name: str
    compute: str  # the dtype the component runs in (what from_pretrained(torch_dtype=...) gives)
    storage: str  # the dtype it is kept in (compute, float8_e4m3fn, or compute before int8 quantization)


def read_cast(handle, entry: LoadedTensor):
    """One tensor from an open safetensors file: stored -> run dtype -> storage dtype, as diffusers does it."""
    # torch: imported on use, so start-up stays free of torch
    import torch

    value = handle.get_tensor(entry.stored_name)
    if value.is_floating_point():
        value = value.to(getattr(torch, entry.compute)).to(getattr(torch, entry.storage))
    return value


class CastingWeights:
    """A read-only mapping name -> tensor read and cast on access, for accelerate's offload hooks.

    accelerate's own loader casts a safetensors tensor straight to one dtype; fp8 needs the same two
    steps as `read_cast` to give diffusers' values bit for bit. Nothing is kept in RAM.
    """

    def __init__(self, entries: dict[str, LoadedTensor]):
        self._entries = entries

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __getitem__(self, key):
        # safetensors: imported on use, like torch (the house rule for the weight libraries)
        from safetensors import safe_open

        entry = self._entries[key]
        with safe_open(entry.file, framework="pt", device="cpu") as handle:
            return read_cast(handle, entry)

    def keys(self):
        return self._entries.keys()

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

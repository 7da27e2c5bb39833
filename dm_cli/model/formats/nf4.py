"""4-bit NF4 weights through bitsandbytes, as diffusers' and transformers' `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=<run dtype>)` quantize them.

Which layers: the nn.Linear layers the libraries' own `replace_with_bnb_linear` swaps for `bnb.nn.Linear4bit`:

- diffusers (`quantizers/bitsandbytes`): every nn.Linear (subclasses too) unless a name in the class's
  `_keep_in_fp32_modules` is the layer's own name, its dotted name, or `name + "."` occurs in that dotted name;
- transformers (`integrations/bitsandbytes.py`): every module whose type is exactly nn.Linear unless
  `should_convert_module` matches one of `get_keys_to_not_convert(model)` (tied weights, the last parameter's
  module, the output embeddings) or `_keep_in_fp32_modules` (T5's `wo` stays unquantized).

What one such weight holds once quantized (bitsandbytes' `Params4bit` and its `QuantState`, blocks of 64):
the packed weight, two 4-bit values a byte (uint8, `(numel + 1) // 2` of them); one float32 absmax per block;
the 16-entry float32 quant map (each layer has its own). With double quantization (`bnb_4bit_use_double_quant`,
`compress_statistics`) the absmax is uint8 (the quant map stays), plus a float32 absmax per 256 of those blocks, their own
256-entry float32 code and a float32 offset. The bias stays in the run dtype; everything else is untouched.

The sizes need no torch; the rule on a built model and the loader's two calls import bitsandbytes on use.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

from dm_cli.errors import UsageError

NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize (Linear4bit's default)
NF4_CODE_BYTES = 16 * 4  # the NF4 quant map: 16 float32 values, one copy per layer
NESTED_BLOCK = 256  # double quantization: blocks of absmax values
NESTED_CODE_BYTES = 256 * 4  # the dynamic 8-bit map of the nested absmax, one copy per layer
NESTED_OFFSET_BYTES = 4  # the float32 mean subtracted from the absmax before they are quantized
BITSANDBYTES_VERSION = "0.50.2"


def nf4_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes a `Params4bit` of `numel` weights holds once quantized (packed data and its QuantState)."""
    blocks = -(-numel // NF4_BLOCK)
    packed = (numel + 1) // 2
    if not double_quant:
        return packed + blocks * 4 + NF4_CODE_BYTES
    return packed + blocks + NF4_CODE_BYTES + -(-blocks // NESTED_BLOCK) * 4 + NESTED_CODE_BYTES + NESTED_OFFSET_BYTES


# --- the rule on a built model (torch, no bitsandbytes) ------------------------------------------


def _is_transformers(model) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def _diffusers_keeps(full: str, keep: list[str]) -> bool:
    """diffusers' `_replace_with_bnb_linear` test, on the layer's dotted name."""
    leaf = full.rpartition(".")[2]
    return leaf in keep or any(key + "." in full or key == full for key in keep)


def nf4_layers(model) -> set[str]:
    """Dotted names of the nn.Linear layers bitsandbytes' 4-bit loading turns into Linear4bit in this model."""
    import torch  # lazy: torch (heavy, off start-up)

    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not _is_transformers(model):
        return {name for name, module in model.named_modules()
                if name and isinstance(module, torch.nn.Linear) and not _diffusers_keeps(name, keep)}
    # transformers: its own rule, called on the meta model (no weights are read)
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = list(set(get_keys_to_not_convert(model) + keep))
    return {name for name, module in model.named_modules()
            if name and type(module) is torch.nn.Linear and should_convert_module(name, skip)}


# --- loading (bitsandbytes) ---------------------------------------------------------------------


def bitsandbytes():
    """The bitsandbytes module, or a clear refusal when it cannot be imported here."""
    try:
        import bitsandbytes as bnb  # lazy: bitsandbytes (heavy, off start-up)
    except Exception as error:  # noqa: BLE001 - missing, or built for another torch
        raise UsageError(
            f"--weights nf4 needs bitsandbytes, which cannot be imported here ({type(error).__name__}: {error}): "
            f"install bitsandbytes=={BITSANDBYTES_VERSION} or run with --weights fp8; plans are made without it."
        ) from None
    return bnb


def import_bitsandbytes_deferring_compile() -> None:
    """bitsandbytes imported now, before diffusers imports it (it does whenever bitsandbytes is installed), with the
    `torch.compile` its default kernels call as they are defined deferred to each kernel's first call.

    Wrapping a function in torch.compile imports inductor (about half a second of CPU at every start of a process
    that imports diffusers, `diffusers-cli run` too), although a run without NF4 never calls those kernels. Compiled
    on first call instead, they compute what they did: dynamo compiles on the first call either way, and
    bitsandbytes falls back to the plain function when compiling fails, then or now. A missing or broken
    bitsandbytes is left for diffusers' import (or `bitsandbytes()`) to report, as before."""
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    import torch  # lazy: torch (heavy, off start-up)

    compile_now = torch.compile
    torch.compile = _compile_on_first_call(compile_now)
    try:
        import bitsandbytes  # noqa: F401 - lazy: bitsandbytes (heavy, off start-up)
    except Exception:  # noqa: BLE001, S110 - reported where it is used, as without this import
        pass
    finally:
        torch.compile = compile_now


def _compile_on_first_call(compile_now):
    """`torch.compile` for plain functions, compiling each on its first call; modules compiled at once."""
    def compile(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda function: compile(function, **options)
        if not callable(model) or hasattr(model, "forward"):
            return compile_now(model, **options)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return compile


def to_linear4bit(model, layers: set[str], compute_dtype, quant_type: str = "nf4", double_quant: bool = False) -> None:
    """Each named nn.Linear swapped for an empty `bnb.nn.Linear4bit`, built with the arguments diffusers' and
    transformers' `replace_with_bnb_linear` pass (compute dtype, uint8 storage; NF4 without double quantization for
    `--weights nf4`, a folder saved quantized its own quant type and double quantization)."""
    import torch  # lazy: torch (heavy, off start-up)

    bnb = bitsandbytes()
    for name in sorted(layers):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = parent.get_submodule(child)
        with torch.device("meta"):
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, old.bias is not None, compute_dtype,
                                    compress_statistics=double_quant, quant_type=quant_type, quant_storage=torch.uint8)
        new.source_cls = type(old)
        new.requires_grad_(False)
        parent._modules[child] = new
    model.is_loaded_in_4bit = True  # what peft reads to give a Linear4bit its 4-bit LoRA layer


def quantize_weight(module, value, device) -> None:
    """`value` (the weight in the run dtype) quantized into the Linear4bit `module` on `device`, as diffusers'
    `create_quantized_param` does it: a Params4bit with the placeholder's settings, quantized by `.to(device)`."""
    bnb = bitsandbytes()
    kwargs = dict(module.weight.__dict__)
    kwargs.pop("_is_hf_initialized", None)
    module._parameters["weight"] = bnb.nn.Params4bit(value.to("cpu"), requires_grad=False, **kwargs).to(device)


def load_saved_weight(module, data, stats: dict, device) -> None:
    """A weight saved quantized (packed data and its statistics, by checkpoint name) put into its Linear4bit on
    `device` as it is, through bitsandbytes' `Params4bit.from_prequantized` (what diffusers' loader calls)."""
    bnb = bitsandbytes()
    module._parameters["weight"] = bnb.nn.Params4bit.from_prequantized(data, stats, requires_grad=False, device=device,
                                                                      module=module)

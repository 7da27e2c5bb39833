"""Pre-quantized component folders: a config.json with a `quantization_config`, as diffusers' and transformers'
`save_pretrained` write it after loading with a `BitsAndBytesConfig` (or a torchao config).

Sized from the safetensors headers alone, as the loaded model holds them:

- bitsandbytes 4-bit (`bnb_4bit_quant_type` nf4 or fp4): a quantized `L.weight` is stored packed (uint8) beside
  `L.weight.absmax`, `L.weight.quant_map` (and with double quantization `nested_absmax`, `nested_quant_map`) and
  `L.weight.quant_state.bitsandbytes__<type>`, a JSON blob the loader parses (not kept as a tensor; the nested
  offset it carries becomes a float32 scalar);
- bitsandbytes 8-bit (LLM.int8): `L.weight` is int8 beside `L.SCB` (a float32 scale per row) and `L.weight_format`
  (written by the layer's state_dict, not kept).

Each quantized weight is counted once, with what it holds: the planner places it with its layer. Which layers are
quantized is what the file says; the rest is as stored. torchao saves tensor subclasses in pickles, which dmap never
loads: such a folder is named and refused.
"""

from __future__ import annotations

from dm_cli.errors import SourceError

BNB_4BIT_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
QUANT_STATE = ".quant_state.bitsandbytes__"
NESTED_OFFSET_BYTES = 4


def quantization_of(config: dict | None) -> str | None:
    """The format a component's config says its weights are saved in: `bnb-nf4`, `bnb-fp4`, `bnb-int8`,
    `torchao`, the `quant_method` of another quantizer, or None (not pre-quantized)."""
    q = (config or {}).get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "?"))
    if method == "bitsandbytes":
        if q.get("load_in_4bit") or q.get("_load_in_4bit"):
            return f"bnb-{q.get('bnb_4bit_quant_type') or 'fp4'}"
        if q.get("load_in_8bit") or q.get("_load_in_8bit"):
            return "bnb-int8"
    return method


def readable_problem(name: str, fmt: str) -> str | None:
    """Why dmap cannot size or load a component saved as `fmt`, or None."""
    if fmt in ("bnb-nf4", "bnb-fp4", "bnb-int8"):
        return None
    if fmt == "torchao":
        return (f"Component '{name}' was saved quantized by torchao, whose tensor subclasses are stored as pickles "
                "that dmap never loads: give its unquantized folder and --weights int8.")
    return f"Component '{name}' was saved quantized by '{fmt}', which dmap cannot read: give its unquantized folder."


def check_readable(name: str, config: dict | None) -> str | None:
    """The pre-quantized format of a component (None: plain), refusing one dmap cannot read."""
    fmt = quantization_of(config)
    if fmt is not None and readable_problem(name, fmt):
        raise SourceError(readable_problem(name, fmt))
    return fmt


def held_bytes(tensors: dict, fmt: str) -> dict[str, int]:
    """Quantized weight name -> the bytes it holds once loaded (itself and its statistics), from header entries
    (`name -> entry` with `.nbytes`)."""
    out: dict[str, int] = {}
    if fmt == "bnb-int8":
        for key, entry in tensors.items():
            if key.endswith(".SCB") and f"{key[:-4]}.weight" in tensors:
                out[f"{key[:-4]}.weight"] = tensors[f"{key[:-4]}.weight"].nbytes + entry.nbytes
        return out
    for key in tensors:
        if QUANT_STATE not in key:
            continue
        weight = key.partition(QUANT_STATE)[0]
        if weight not in tensors:
            continue
        stats = [tensors[f"{weight}.{s}"].nbytes for s in BNB_4BIT_STATS if f"{weight}.{s}" in tensors]
        nested = f"{weight}.nested_absmax" in tensors
        out[weight] = tensors[weight].nbytes + sum(stats) + (NESTED_OFFSET_BYTES if nested else 0)
    return out


def is_statistic(name: str) -> bool:
    """A checkpoint tensor that belongs to a quantized weight (its statistics or state), not to the model."""
    return (QUANT_STATE in name or name.endswith((".SCB", ".weight_format"))
            or any(name.endswith(f".weight.{s}") for s in BNB_4BIT_STATS))

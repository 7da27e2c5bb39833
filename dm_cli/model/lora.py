"""LoRA adapter files (`--lora [COMPONENT=]FILE[:SCALE]`), read as hostile input: no torch, no tensor data.

A LoRA file is a safetensors file read through dm_cli.io.checkpoint's strict header reader (everything
`safetensors` refuses is refused, one sentence naming the file); its sha256 is streamed (the metadata and the
resume key name it); its keys say which component it patches (diffusers' `transformer.` / `unet.` /
`text_encoder.` prefixes, or bare peft keys for the pipeline's denoiser) and which layers (`MODULE.lora_A.weight`
and `MODULE.lora_B.weight`), whose shapes are checked against the component's own weights before anything loads:
a LoRA for another model is refused, not half applied. The tensors themselves are loaded at run time by diffusers'
own `load_lora_weights` (dm_cli.run.adapters).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import replace
from pathlib import Path

from dm_cli.errors import CheckpointError, UsageError
from dm_cli.inputs import LoraAdapter, LoraLayer
from dm_cli.units import FLOATING_DTYPES

# The largest LoRA file dmap reads: a rank-256 LoRA of every linear layer of a 20B model is a few GB.
MAX_LORA_BYTES = 32 * 2**30
# The components whose diffusers key prefix a LoRA file may use; the denoisers are the ones dmap patches.
PREFIXES = ("transformer", "transformer_2", "unet", "text_encoder", "text_encoder_2", "text_encoder_3", "prior")
DENOISERS = ("transformer", "transformer_2", "unet")
# Layouts diffusers converts while loading (kohya's `lora_unet_`, the original model's `diffusion_model.`, ...):
# their layers are counted per component, not per block (diffusers renames them only at load time).
_FOREIGN_TEXT_ENCODER = re.compile(r"^(lora_te\d*_|te\d*_|text_model\.|lora_te_text_model)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PEFT = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_EXTRA = re.compile(r"^(?P<module>.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.bias$|^(?P<alpha>.+)\.alpha$")


def parse_lora(text: str, where: str = "--lora") -> tuple[str | None, str, float]:
    """`[COMPONENT=]FILE[:SCALE]` -> (component or None, path, scale). The scale is the last ':' part only when it
    is a number (a path may hold ':'), the component the part before the first '=' only when it is a name and the
    whole text is not an existing file (a path may hold '=')."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{where} needs a file: --lora FILE, --lora FILE:0.8 or --lora transformer_2=FILE.")
    text = text.strip()
    component = None
    head, sep, rest = text.partition("=")
    if sep and _COMPONENT.fullmatch(head) and not os.path.exists(text):
        component, text = head, rest
    path, scale = text, 1.0
    stem, colon, last = text.rpartition(":")
    if colon and not os.path.exists(text):
        if _NUMBER.fullmatch(last):
            path, scale = stem, float(last)
        elif last.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity") or (stem and os.path.exists(stem)):
            raise UsageError(f"{where} {shown(text)}: the scale after ':' must be a finite number, like 0.8, "
                             f"not '{shown(last)}'.")
    if not math.isfinite(scale):
        raise UsageError(f"{where} {shown(text)}: the scale must be a finite number, not {last}.")
    if not path:
        raise UsageError(f"{where} needs a file before the scale: --lora FILE:{last}.")
    return component, path, scale


def shown(text) -> str:
    """A path or argument for a message: control characters escaped, at most about 120 characters."""
    from dm_cli.io.input_images import shown_path

    return shown_path(text)


def read_lora(value, where: str = "--lora") -> LoraAdapter:
    """One LoRA: a `[COMPONENT=]FILE[:SCALE]` string, a path, or a LoraAdapter already read. The file's header
    is read and checked, its layers listed and its sha256 streamed; every problem is one sentence (UsageError)."""
    if isinstance(value, LoraAdapter):
        return value
    if isinstance(value, os.PathLike):
        component, path, scale = None, os.fspath(value), 1.0
    elif isinstance(value, str):
        component, path, scale = parse_lora(value, where)
    else:
        raise UsageError(f"{where} takes '[COMPONENT=]FILE[:SCALE]' strings or paths, not a {type(value).__name__}.")
    from dm_cli.io.checkpoint import LEGACY_SUFFIXES, open_regular, read_safetensors_header

    name = shown(path)
    if not os.path.lexists(path):
        raise UsageError(f"{where} {name} does not exist.")
    if Path(path).suffix.lower() in LEGACY_SUFFIXES:
        raise UsageError(f"{where} {name} is a PyTorch pickle: dmap reads LoRAs as .safetensors only (a pickle can "
                         "run code); convert it to safetensors first.")
    try:
        handle, size = open_regular(Path(path), "LoRA file", MAX_LORA_BYTES)
        handle.close()
        header = read_safetensors_header(path)
    except CheckpointError as error:
        raise UsageError(f"{where} is not a readable LoRA file: {str(error).rstrip('.')}.") from None
    if not header.tensors:
        raise UsageError(f"{where} {name} holds no tensors: it is not a LoRA.")
    not_float = next((t for t in header.tensors.values() if t.dtype not in FLOATING_DTYPES), None)
    if not_float is not None:
        raise UsageError(f"{where} {name}: tensor '{shown(not_float.name)}' is {not_float.dtype}; a LoRA's tensors "
                         "are floating point (this is not a LoRA file).")
    layers, keys_component = _layers(header.tensors, where, name)
    return LoraAdapter(os.fspath(path), file_digest(path, size, where), scale, component, len(header.tensors),
                       header.data_bytes, layers, keys_component, sum(t.numel for t in header.tensors.values()))


def read_loras(values, where: str = "--lora") -> tuple[LoraAdapter, ...]:
    """LoRAs as a generation holds them, in order: one value or a list (strings, paths, LoraAdapters); the same
    file twice is refused (give one scale)."""
    if values is None:
        return ()
    if isinstance(values, (str, os.PathLike, LoraAdapter)):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise UsageError(f"{where} takes a list of '[COMPONENT=]FILE[:SCALE]' strings, not a {type(values).__name__}.")
    out = [read_lora(value, where) for value in values]
    seen: dict[tuple, LoraAdapter] = {}
    for lora in out:
        key = (lora.digest, lora.component)
        if key in seen:
            raise UsageError(f"{where} names {shown(lora.path)} twice: give it once, with one scale.")
        seen[key] = lora
    return tuple(out)


def file_digest(path, size: int | None = None, where: str = "--lora") -> str:
    """sha256 of the file's bytes, read in 1 MiB pieces (a LoRA of gigabytes never sits in memory)."""
    from dm_cli.io.checkpoint import open_regular

    digest = hashlib.sha256()
    try:
        handle, _ = open_regular(Path(path), "LoRA file", MAX_LORA_BYTES)
        with handle:
            read = 0
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                read += len(chunk)
    except (CheckpointError, OSError) as error:
        raise UsageError(f"{where} {shown(path)} cannot be read: {error}".rstrip(".") + ".") from None
    if size is not None and read != size:
        raise UsageError(f"{where} {shown(path)} changed while dmap read it: run again.")
    return digest.hexdigest()


def _layers(tensors: dict, where: str, name: str) -> tuple[tuple[LoraLayer, ...], str | None]:
    """(the layers of a peft-layout LoRA, the component its key prefixes name). A key in another layout
    (kohya's, the original model's) makes the whole file foreign: no layers, counted per component."""
    prefixes = set()
    shapes: dict[str, dict[str, tuple]] = {}
    counts: dict[str, int] = {}
    foreign = False
    text_encoder = False
    for key, entry in tensors.items():
        head, dot, rest = key.partition(".")
        if dot and head in PREFIXES:
            prefixes.add(head)
            key = rest
        elif _FOREIGN_TEXT_ENCODER.match(key):
            text_encoder = True
        match = _PEFT.match(key)
        if match:
            shapes.setdefault(match["module"], {})[match["which"]] = entry.shape
            counts[match["module"]] = counts.get(match["module"], 0) + entry.numel
            continue
        extra = _EXTRA.match(key)
        if extra and extra["module"]:
            counts[extra["module"]] = counts.get(extra["module"], 0) + entry.numel
            continue
        if extra:  # an `alpha` scalar: its bytes go with its layer when there is one
            continue
        foreign = True
    if len(prefixes) == 1:
        component = next(iter(prefixes))
    elif prefixes:  # settle_targets refuses a file that also patches a text encoder, naming it
        component = ",".join(sorted(prefixes))
    else:
        component = "text_encoder" if text_encoder else None
    if foreign:
        return (), component
    layers = []
    for module, pair in shapes.items():
        if set(pair) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise UsageError(f"{where} {name}: layer '{shown(module)}' has no {missing} weight: the file is "
                             "incomplete or not a LoRA.")
        a, b = pair["lora_A"], pair["lora_B"]
        if len(a) < 2 or len(b) < 2 or a[0] != b[1]:
            raise UsageError(f"{where} {name}: layer '{shown(module)}' has lora_A {list(a)} and lora_B {list(b)}, "
                             "whose ranks differ: the file is not a LoRA.")
        layers.append(LoraLayer(module, tuple(a), tuple(b), counts.get(module, 0)))
    return tuple(sorted(layers, key=lambda layer: layer.module)), component


# --- the components a LoRA patches, against a SOURCE -------------------------------------------------


def settle_targets(loras: tuple[LoraAdapter, ...], components: list[str], denoiser: str | None,
                   experts: tuple[str, ...] = ()) -> tuple[LoraAdapter, ...]:
    """Each LoRA with the component it patches: the one the user named (which must exist and be a denoiser), else
    the one its keys name, else the pipeline's denoiser. One that patches a text encoder or names a component this
    pipeline lacks is refused, one sentence."""
    out = []
    denoisers = [c for c in components if c in DENOISERS or c == denoiser or c in experts]
    for lora in loras:
        keys = lora.keys_component
        patched = [p for p in (keys or "").split(",") if p]
        others = [p for p in patched if p not in DENOISERS]
        if others:
            raise UsageError(f"--lora {shown(lora.name)} patches {', '.join(others)}: dmap applies LoRAs to the "
                             f"denoiser ({', '.join(denoisers) or 'transformer or unet'}) only; use a LoRA without "
                             "text-encoder layers.")
        target = lora.component
        if target is None:
            target = patched[0] if len(patched) == 1 else denoiser
        if target is None or target not in components:
            raise UsageError(f"--lora {shown(lora.name)} patches '{target}', which this pipeline does not have (it has "
                             f"{', '.join(components)}): name the component, e.g. --lora transformer=FILE.")
        if target not in denoisers:
            raise UsageError(f"--lora {target}={shown(lora.name)}: dmap applies LoRAs to the denoiser "
                             f"({', '.join(denoisers)}) only, not to '{target}'.")
        if lora.component is not None and patched and patched[0] != target and \
                not (patched[0] == "transformer" and target in experts):
            raise UsageError(f"--lora {target}={shown(lora.name)}: the file's layers are for '{patched[0]}', "
                             f"not '{target}'.")
        out.append(replace(lora, component=target))
    return tuple(out)


def layer_problems(lora: LoraAdapter, weights: dict[str, tuple[int, ...]]) -> str | None:
    """Why `lora` does not fit the component whose weight shapes are `weights` (tensor name -> shape), or None:
    every layer it patches must be there, with lora_A's input and lora_B's output sizes of the layer's weight."""
    if not lora.layers:
        return None
    missing, wrong = [], []
    for layer in lora.layers:
        shape = weights.get(f"{layer.module}.weight")
        if shape is None:
            missing.append(layer.module)
        elif len(shape) < 2 or shape[0] != layer.b_shape[0] or shape[1] != layer.a_shape[1]:
            wrong.append(f"{layer.module} is {list(shape)}, the LoRA's is {[layer.b_shape[0], layer.a_shape[1]]}")
    if not missing and not wrong:
        return None
    what = f"--lora {shown(lora.name)} does not fit {lora.component}"
    if missing and len(missing) == len(lora.layers):
        return (f"{what}: none of its {len(lora.layers)} layers is in it (such as '{shown(missing[0])}'): it is a "
                "LoRA for another model.")
    if missing:
        return (f"{what}: {len(missing)} of its {len(lora.layers)} layers are not in it (such as "
                f"'{shown(missing[0])}'): it is a LoRA for another model.")
    return f"{what}: {len(wrong)} layer(s) have other sizes ({wrong[0]}): it is a LoRA for another model."


def layer_bytes(lora: LoraAdapter, itemsize: int) -> dict[str, int]:
    """Bytes the LoRA adds beside each weight it patches (`MODULE.weight` -> bytes) once loaded: peft keeps lora_A
    and lora_B in the dtype of the layer they patch. Empty for a foreign layout (counted per component)."""
    return {f"{layer.module}.weight": layer.numel * itemsize for layer in lora.layers}

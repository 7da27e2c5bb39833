"""LoRA adapter files (`--lora [COMPONENT=]FILE[:SCALE]`), read as hostile input: no weight data read to plan.

A LoRA file is a safetensors file read through dm_cli.io.checkpoint's strict header reader (everything
`safetensors` refuses is refused, one sentence naming the file); its sha256 is streamed (the metadata and the
resume key name it); its keys say which component it patches (diffusers' `transformer.` / `unet.` /
`text_encoder.` prefixes, or bare peft keys for the pipeline's denoiser) and which layers (`MODULE.lora_A.weight`
and `MODULE.lora_B.weight`), whose shapes are checked against the component's own weights before anything loads:
a LoRA for another model is refused, not half applied. The tensors themselves are loaded at run time by diffusers'
own `load_lora_weights` (dm_cli.run.hooks.adapters).

What would only fail (or silently blacken the image) after the models load is refused here, one sentence naming
the key: a tensor of rank 0, an alpha (a `.alpha` scalar or the adapter metadata's `lora_alpha`) that is not
finite or is oversized, a scale beyond `inputs.MAX_SCALE`. A file in a layout diffusers converts while loading
(kohya's, ...) is converted on shapes alone (meta tensors) by the pipeline's own `lora_state_dict`
(`converted_layers`), so its
layers are checked against the component like a peft file's. NaN/Inf weights are found when the adapter loads
(`nonfinite_tensor`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import struct
import warnings
from dataclasses import replace
from pathlib import Path

from dm_cli.errors import CheckpointError, UsageError
from dm_cli.inputs import LoraAdapter, LoraLayer, lora_scale
from dm_cli.io.checkpoint import LEGACY_SUFFIXES, TensorEntry, open_regular, read_safetensors_header
from dm_cli.io.input_images import shown_path
from dm_cli.model import models  # the module: tests replace its quiet_libraries
from dm_cli.units import FLOATING_DTYPES

# The largest LoRA file dmap reads: a rank-256 LoRA of every linear layer of a 20B model is a few GB.
MAX_LORA_BYTES = 32 * 2**30
# The components whose diffusers key prefix a LoRA file may use; the denoisers are the ones dmap patches.
PREFIXES = ("transformer", "transformer_2", "unet", "text_encoder", "text_encoder_2", "text_encoder_3", "prior")
DENOISERS = ("transformer", "transformer_2", "unet")
# The largest alpha/rank a file may hold: a LoRA's weight is a number like 0.8 (alpha/rank 1 or 2); past it only
# overflow comes out (NaN latents, a black image). The largest scale is inputs.MAX_SCALE (`inputs.lora_scale`).
MAX_ALPHA_RATIO = 1000.0
# Layouts diffusers converts while loading (kohya's `lora_unet_`, the original model's `diffusion_model.`, ...):
# their layers are counted per component, not per block (diffusers renames them only at load time).
_FOREIGN_TEXT_ENCODER = re.compile(r"^(lora_te\d*_|te\d*_|text_model\.|lora_te_text_model)")
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
    if colon and not os.path.exists(text):  # the scale as a request's or a queue item's "lora" reads it (inputs)
        path, given = lora_scale(text, f"{where} {shown(text)}", strict=bool(stem) and os.path.exists(stem))
        scale = 1.0 if given is None else given
    if not path:
        raise UsageError(f"{where} needs a file before the scale: --lora FILE:{last}.")
    return component, path, scale


def shown(text) -> str:
    """A path or argument for a message: control characters escaped, at most about 120 characters."""
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
    _check_ranks_and_alphas(header, where, name)
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


def chosen_loras(loaded: tuple[LoraAdapter, ...], choices: tuple, where: str) -> tuple[LoraAdapter, ...]:
    """The adapters loaded at start (`loaded`, `--lora`'s) that a request's or a queue item's `"lora"` chooses
    (dm_cli.inputs.LoraChoice), in the order chosen, each at its chosen scale (else the one it loaded with). A name
    is the file's name, its path as `--lora` gave it, or its name without `.safetensors`; a file loaded into two
    components (Wan 2.2's experts) is chosen in both unless `COMPONENT=` names one. Refused, one sentence naming the
    loaded ones: a name that was not loaded (a path is never read here), an adapter chosen twice."""
    out: list[LoraAdapter] = []
    for choice in choices:
        component, name = choice.split
        found = [lora for lora in loaded if _is_named(lora, name) and component in (None, lora.component)]
        if not found and component is not None:  # a name holding '='
            found = [lora for lora in loaded if _is_named(lora, choice.text)]
        if not found:
            names = ", ".join(dict.fromkeys(lora.name for lora in loaded))
            offer = f"the loaded ones are {names}; give NAME[:SCALE], or [] for none" if names else "none was"
            raise UsageError(f"{where} chooses the LoRA {shown(choice.text)}, which is not among the adapters loaded "
                             f"at start: {offer}.")
        for lora in found:
            if any(lora.path == o.path and lora.component == o.component for o in out):
                raise UsageError(f"{where} chooses the LoRA {shown(choice.text)} twice: give it once, with one scale.")
            out.append(lora if choice.scale is None else replace(lora, scale=choice.scale))
    return tuple(out)


def _is_named(lora: LoraAdapter, name: str) -> bool:
    """`name` is this adapter's: its file's name, its path as given, or its name without the suffix."""
    return name in (lora.name, lora.path, Path(lora.name).stem)


def file_digest(path, size: int | None = None, where: str = "--lora") -> str:
    """sha256 of the file's bytes, read in 1 MiB pieces (a LoRA of gigabytes never sits in memory)."""
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


# --- ranks and alphas, from the header and the few alpha scalars ----------------------------------------

_DOWN = re.compile(r"^(?P<module>.+)\.(?:lora_A|lora_down|lora\.down)(?:\.[^.]+)?\.weight$")
# the scalars a file may hold that scale its layers (kohya's `X.alpha`, some peft exports' `X.alpha`)
_SCALAR_FORMATS = {"float32": "<f", "float16": "<e", "float64": "<d"}


def _check_ranks_and_alphas(header, where: str, name: str) -> None:
    """Refused, one sentence naming the key: an empty tensor (rank 0: peft refuses it after the models load), an
    alpha that is not finite or whose alpha/rank is past MAX_ALPHA_RATIO (it would scale the layer into overflow),
    in `.alpha` scalars or in the adapter metadata diffusers writes (`lora_alpha`, `alpha_pattern`, `r`)."""
    ranks: dict[str, int] = {}
    for key, entry in header.tensors.items():
        if entry.numel == 0:
            raise UsageError(f"{where} {name}: tensor '{shown(key)}' is empty (shape {list(entry.shape)}): a LoRA of "
                             "rank 0 changes nothing and cannot be loaded; export it again with a rank of 1 or more.")
        down = _DOWN.match(key)
        if down and entry.shape:
            ranks[down["module"]] = entry.shape[0]
    scalars = [e for k, e in header.tensors.items() if k.endswith("alpha") and e.numel == 1]
    try:
        values = _scalars(header.path, scalars)
    except OSError as error:
        raise UsageError(f"{where} {name} cannot be read: {error.strerror or error}.") from None
    for entry, value in zip(scalars, values):
        if value is not None:
            module = entry.name[:-len(".alpha")] if entry.name.endswith(".alpha") else entry.name
            _check_alpha(value, ranks.get(module, 1), entry.name, where, name)
    _check_metadata_alphas(header.metadata.get("lora_adapter_metadata"), where, name)


def _scalars(path, entries: list) -> list[float | None]:
    """The values of one-element tensors (alphas), each read at its offset: a few bytes, never a weight."""
    if not entries:
        return []
    with open(path, "rb") as handle:
        out = []
        for entry in entries:
            handle.seek(entry.begin)
            out.append(_scalar(entry.dtype, handle.read(entry.end - entry.begin)))
        return out


def _scalar(dtype: str, raw: bytes) -> float | None:
    """One stored number (a LoRA's alpha), or None for a dtype read here as no number (fp8 cannot hold an alpha
    past 448: nothing to refuse)."""
    if dtype == "bfloat16" and len(raw) == 2:
        return struct.unpack("<f", b"\0\0" + raw)[0]
    fmt = _SCALAR_FORMATS.get(dtype)
    if fmt is None or len(raw) != struct.calcsize(fmt):
        return None
    return struct.unpack(fmt, raw)[0]


def _check_alpha(value, rank: int, key: str, where: str, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if not math.isfinite(value):
        raise UsageError(f"{where} {name}: its alpha '{shown(key)}' is {value}: a LoRA's alpha must be a finite "
                         "number (this one would turn the image into NaN, all black).")
    if abs(value) / max(rank, 1) > MAX_ALPHA_RATIO:
        raise UsageError(f"{where} {name}: its alpha '{shown(key)}' is {value:g} for rank {rank}, an oversized scale "
                         f"(alpha/rank past {MAX_ALPHA_RATIO:g} overflows the model's numbers).")


def _number(value) -> int | float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _check_metadata_alphas(text, where: str, name: str) -> None:
    """The peft config diffusers keeps in the header (`lora_adapter_metadata`: `PREFIX.r`, `PREFIX.lora_alpha`,
    their per-module patterns): a rank of 0 or a non-finite or oversized alpha is refused as a tensor's would be.
    Metadata that is not such JSON is left to diffusers."""
    try:
        config = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return
    if not isinstance(config, dict):
        return
    for key, value in config.items():
        prefix = key[:-len("lora_alpha")] if key.endswith("lora_alpha") else None
        rank = _number(config.get(f"{prefix}r")) if prefix is not None else None
        if key.rpartition(".")[2] == "r" and _number(value) == 0:
            raise UsageError(f"{where} {name}: its metadata says '{shown(key)}' is 0: a LoRA of rank 0 changes "
                             "nothing and cannot be loaded; export it again with a rank of 1 or more.")
        if prefix is not None and _number(value) is not None:
            _check_alpha(value, int(rank) if rank and math.isfinite(rank) else 1, key, where, name)
        if key.endswith(("alpha_pattern", "rank_pattern")) and isinstance(value, dict):
            for module, each in value.items():
                if key.endswith("rank_pattern") and _number(each) == 0:
                    raise UsageError(f"{where} {name}: its metadata gives '{shown(module)}' rank 0: a LoRA of rank 0 "
                                     "cannot be loaded; export it again with a rank of 1 or more.")
                if key.endswith("alpha_pattern") and _number(each) is not None:
                    _check_alpha(each, 1, f"{key}.{module}", where, name)


@functools.lru_cache(maxsize=16)
def nonfinite_tensor(path: str, digest: str = "") -> str | None:
    """The first tensor of a LoRA file holding NaN or Inf, or None: read tensor by tensor (a LoRA is small beside
    its model) when the adapter loads, so it is refused instead of turning every image black. `digest`: the file's
    sha256 as dmap read it (a component loaded again does not read the same file again)."""
    import torch  # lazy: torch (heavy, off start-up)
    from safetensors import safe_open  # lazy: safetensors (heavy, off start-up)

    with safe_open(os.fspath(path), "pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor.float()).all()):
                return key
    return None


# --- layouts diffusers converts while loading, converted on shapes -----------------------------------------


def converted_layers(lora: LoraAdapter, pipeline_class: str | None) -> LoraAdapter:
    """`lora` with the layers diffusers' pipeline `pipeline_class` makes of a file in a layout it converts while
    loading (kohya's `lora_unet_...`, ...): `lora_state_dict`, the conversion `load_lora_weights` runs, on a state
    dict of meta tensors of the file's shapes (the alpha scalars read, as the conversion scales by them). Refused,
    one sentence naming the first key: a file that conversion rejects (a kohya LoRA for another model) or that
    converts to no layer of a denoiser. A peft-layout file, or one whose conversion cannot run on shapes alone, or
    ends in keys peft does not name, is returned as it is (checked then by diffusers while loading)."""
    if lora.layers or not pipeline_class or not lora.path:
        return lora
    layers = _converted_layers(lora.path, lora.digest, pipeline_class)
    return replace(lora, layers=layers) if layers else lora


@functools.lru_cache(maxsize=16)
def _converted_layers(path: str, digest: str, pipeline_class: str) -> tuple:
    """The LoraLayers of the denoiser part of `path` as `pipeline_class.lora_state_dict` converts it (see
    `converted_layers`); () when that cannot be told from shapes. `digest`: a changed file is converted again."""
    models.quiet_libraries()  # a pipeline class's first import: transformers' advice would precede dmap's own lines
    import diffusers  # lazy: diffusers (heavy, off start-up)
    import torch  # lazy: torch (heavy, off start-up)

    loader = getattr(getattr(diffusers, pipeline_class, None), "lora_state_dict", None)
    if loader is None:
        return ()
    header = read_safetensors_header(path)
    name = shown(os.path.basename(path))
    scalars = [e for k, e in header.tensors.items() if k.endswith("alpha") and e.numel == 1]
    alphas = {entry.name: torch.tensor(value if value is not None else 1.0).reshape(entry.shape)
              for entry, value in zip(scalars, _scalars(path, scalars))}

    def state_dict(tensor):
        return {key: alphas[key] if key in alphas else tensor(entry) for key, entry in header.tensors.items()}

    # meta tensors first (nothing allocated); a conversion that reads values (kohya's sparse-qkv test) runs
    # again on zero views of each shape, allocating only what the conversion itself makes
    attempts = (lambda e: torch.empty(e.shape, dtype=getattr(torch, e.dtype), device="meta"),
                lambda e: torch.zeros((), dtype=getattr(torch, e.dtype)).expand(e.shape))
    converted, refusals = None, []
    for tensor in attempts:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = loader(state_dict(tensor))
            break
        except ValueError as error:  # diffusers' own refusal of the keys (on values too: not a meta artefact)
            refusals.append(error)
        except Exception:  # noqa: BLE001 - a conversion that needs values: told by diffusers while loading
            continue
    if converted is None and len(refusals) == len(attempts):  # the run's load would end the same way
        first = _first_named_key(str(refusals[-1]), header.tensors) or next(iter(header.tensors))
        raise UsageError(f"--lora {name} matches no layer of this model's denoiser: diffusers' {pipeline_class} "
                         f"cannot convert its key '{shown(first)}' (it is a LoRA for another model).")
    if isinstance(converted, tuple):
        converted = converted[0]
    if not isinstance(converted, dict):
        return ()
    denoiser = {k: v for k, v in converted.items() if k.partition(".")[0] in DENOISERS and hasattr(v, "shape")}
    if not denoiser:
        first = next((k for k in header.tensors if not k.endswith("alpha")), next(iter(header.tensors)))
        raise UsageError(f"--lora {name} matches no layer of this model's denoiser: diffusers' {pipeline_class} "
                         f"converts none of its keys (such as '{shown(first)}') to one (it is a LoRA for another "
                         "model).")
    if any(".lora.down." in k or ".lora.up." in k or "_lora.down." in k for k in denoiser):
        from diffusers.utils import convert_unet_state_dict_to_peft  # lazy: diffusers; what its UNet loader does next

        try:
            denoiser = convert_unet_state_dict_to_peft(denoiser)
        except Exception:  # noqa: BLE001 - told by diffusers while loading
            return ()
    entries = {k: TensorEntry(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), 0, 0)
               for k, v in denoiser.items()}
    try:
        layers, _ = _layers(entries, "--lora", name)
    except UsageError:  # a conversion quirk: diffusers tells while loading
        return ()
    return layers


def _first_named_key(message: str, keys) -> str | None:
    """The first of the file's keys a diffusers error message names (its 'Incompatible keys detected' list)."""
    message = message[:20000]
    found = [(not key.endswith("alpha"), message.find(key), key) for key in keys if key in message]
    return max(found, key=lambda f: (f[0], -f[1]))[2] if found else None


# --- the components a LoRA patches, against a SOURCE -------------------------------------------------


def settle_targets(loras: tuple[LoraAdapter, ...], components: list[str], denoiser: str | None,
                   experts: tuple[str, ...] = (), pipeline_class: str | None = None) -> tuple[LoraAdapter, ...]:
    """Each LoRA with the component it patches: the one the user named (which must exist and be a denoiser), else
    the one its keys name, else the pipeline's denoiser. One that patches a text encoder or names a component this
    pipeline lacks is refused, one sentence. With `pipeline_class`, a file in a layout diffusers converts gets the
    layers that conversion makes (`converted_layers`), checked then against the component like a peft file's."""
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
        out.append(converted_layers(replace(lora, component=target), pipeline_class))
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

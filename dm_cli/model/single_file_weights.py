"""A single-file checkpoint (original layout safetensors, or GGUF) standing in for one component of a pipeline:
`dmap plan FILE --pipeline PRESET|FOLDER` and `dmap run FILE --pipeline FOLDER`.

What the file holds is read from its header alone (`read_safetensors_header`, `read_gguf_header`: the hostile-file
rules of both readers apply), then renamed and reshaped the way diffusers' `from_single_file` does it: the same
`checkpoint_mapping_fn` of `SINGLE_FILE_LOADABLE_CLASSES`, run on meta tensors (GGUF's quantized ones as
diffusers' own `GGUFParameter`, so row splits keep their quantization type). The result names every tensor as the
diffusers model names it, with the bytes it keeps once loaded: quantized tensors stay quantized (diffusers
dequantizes one layer at a time while it runs), the others are cast to the run dtype as `from_single_file` casts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import SourceError
from dm_cli.model.gguf_files import shown

GGUF = "gguf"
SAFETENSORS = "safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the component as the file gives it, after diffusers' renaming."""

    shape: tuple[int, ...]  # elements, outermost first (a quantized tensor's logical shape)
    dtype: str  # torch spelling for plain tensors; the ggml type (Q8_0, Q4_K, ...) for quantized ones
    quantized_bytes: int = 0  # > 0: stays quantized when loaded, at this many bytes


@dataclass(frozen=True)
class SingleFileWeights:
    path: Path
    format: str  # SAFETENSORS or GGUF
    tensors: dict[str, StoredTensor]  # diffusers' names

    @property
    def quantized(self) -> bool:
        return any(t.quantized_bytes for t in self.tensors.values())

    def quant_types(self) -> dict[str, int]:
        """ggml type -> tensor count, for the plan's notes."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            if tensor.quantized_bytes:
                counts[tensor.dtype] = counts.get(tensor.dtype, 0) + 1
        return counts


def is_single_file(spec: str) -> bool:
    """A SOURCE that names one .safetensors or .gguf file (a candidate for --pipeline)."""
    path = Path(spec).expanduser()
    return path.is_file() and path.name.lower().endswith((".safetensors", ".gguf"))


def mapping_function(cls: str):
    """diffusers' checkpoint_mapping_fn for a model class, or None when from_single_file cannot load it."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(cls)
    return entry.get("checkpoint_mapping_fn") if entry else None


def read_single_file(path: Path, cls: str, config: dict) -> SingleFileWeights:
    """The component `cls` as `path` stores it, in diffusers' names; one sentence (exit 2) when it is not that."""
    convert = mapping_function(cls)
    if convert is None:
        raise SourceError(f"diffusers cannot load a {cls} from a single file (from_single_file does not know the "
                          "class): give a diffusers folder instead.")
    fmt = GGUF if path.name.lower().endswith(".gguf") else SAFETENSORS
    meta = _meta_gguf(path) if fmt == GGUF else _meta_safetensors(path)
    try:
        converted = convert(meta, config=config)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as error:
        raise SourceError(f"{shown(path.name)} does not hold a {cls} in a layout diffusers' single-file loader knows "
                          f"({type(error).__name__}: {shown(str(error), 120)}).") from None
    return SingleFileWeights(path, fmt, {name: _stored(tensor) for name, tensor in converted.items()})


def _meta_safetensors(path: Path) -> dict:
    import torch

    from dm_cli.io.checkpoint import read_safetensors_header

    header = read_safetensors_header(path)
    meta = {}
    for name, entry in header.tensors.items():
        meta[name] = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")
    return meta


def _meta_gguf(path: Path) -> dict:
    """GGUF tensors on meta: plain types as their torch dtype, quantized ones as diffusers' GGUFParameter over
    their stored bytes (rows x bytes per row), exactly what `load_gguf_checkpoint` hands the mapping function."""
    import gguf
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    from dm_cli.model.gguf_files import read_gguf_header

    header = read_gguf_header(path)
    plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    meta = {}
    for tensor in header.tensors:
        if tensor.ggml_type in plain:
            meta[tensor.name] = torch.empty(tensor.shape, dtype=plain[tensor.ggml_type], device="meta")
            continue
        qtype = getattr(gguf.GGMLQuantizationType, tensor.ggml_type, None)
        if qtype is None or qtype not in _supported_quant_types():
            raise SourceError(f"{shown(path.name)}: tensor '{shown(tensor.name)}' has ggml type {tensor.ggml_type}, which "
                              "diffusers' GGUF loader does not support.")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        *rows, inner = tensor.shape
        data = torch.empty((*rows, inner // block * type_size), dtype=torch.uint8, device="meta")
        meta[tensor.name] = GGUFParameter(data, quant_type=qtype)
    return meta


def _supported_quant_types():
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return SUPPORTED_GGUF_QUANT_TYPES


def _stored(tensor) -> StoredTensor:
    quant_type = getattr(tensor, "quant_type", None)
    if quant_type is None:
        return StoredTensor(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    import gguf

    qtype = gguf.GGMLQuantizationType(quant_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *rows, row_bytes = tensor.shape
    nbytes = row_bytes
    for dim in rows:
        nbytes *= dim
    return StoredTensor((*rows, row_bytes // type_size * block), qtype.name, nbytes)


def check_against(weights: SingleFileWeights, skeleton, component: str) -> None:
    """The converted tensors are exactly the ones the config builds, shape for shape (else one sentence)."""
    built = {t.name: t.shape for t in skeleton.tensors if t.kind != "buffer_np"}
    missing = sorted(set(built) - set(weights.tensors))
    extra = sorted(set(weights.tensors) - set(built))
    wrong = [n for n in sorted(set(built) & set(weights.tensors)) if tuple(built[n]) != weights.tensors[n].shape]
    if not (missing or extra or wrong):
        return
    what = (f"{len(missing)} tensor(s) the config has are missing (first: {missing[0]})" if missing else
            f"tensor {wrong[0]} is {list(weights.tensors[wrong[0]].shape)}, the config builds {list(built[wrong[0]])}"
            if wrong else f"{len(extra)} tensor(s) are not in the model (first: {extra[0]})")
    raise SourceError(f"{shown(weights.path.name)} does not match the pipeline's {component} ({skeleton.cls}): "
                      f"{shown(what, 200)}.")


def attach_single_file(file_spec: str, source):
    """The pipeline `source` with the component that `file_spec` holds taken from that file: the first component,
    in the pipeline's order, that diffusers can load from a single file and whose tensors the file matches (for
    Wan 2.2, whose experts share a class, the first: `transformer`). One sentence when none does."""
    from dataclasses import replace

    from dm_cli.model.skeleton import load_skeleton

    path = Path(file_spec).expanduser()
    if source.kind != "pipeline":
        raise SourceError(f"--pipeline must name a pipeline (a preset or a folder with model_index.json); "
                          f"{shown(source.spec)} is a {source.kind}.")
    problems = []
    for position, comp in enumerate(source.components):
        if comp.config is None or mapping_function(comp.cls) is None:
            continue
        try:
            weights = read_single_file(path, comp.cls, comp.config)
            check_against(weights, load_skeleton(comp.name, comp.library, comp.cls, comp.config), comp.name)
        except SourceError as error:
            problems.append(str(error))
            continue
        components = list(source.components)
        components[position] = replace(comp, weights=None, legacy_weights=[], single_file=weights)
        return replace(source, spec=file_spec, components=components,
                       notes=[*source.notes, f"'{comp.name}' from {shown(path.name)} ({weights.format})."])
    if problems:
        raise SourceError(problems[0])
    raise SourceError(f"No component of {shown(source.spec)} can be loaded from a single file by diffusers.")


def resolve_with_pipeline(spec: str, pipeline: str | None):
    """SOURCE as `plan` and `run` take it: `resolve_source(spec)`, or with `--pipeline` the single file `spec` in the
    pipeline `pipeline` names (a preset or a folder)."""
    from dm_cli.errors import UsageError
    from dm_cli.model.demo import resolve

    if pipeline is None:
        return resolve(spec)
    if not is_single_file(spec):
        raise UsageError(f"--pipeline goes with a single-file SOURCE (a .safetensors or .gguf file); {shown(spec)} "
                         "is not one: give the pipeline itself as SOURCE.")
    return attach_single_file(spec, resolve(pipeline))


def without_weights(source) -> str | None:
    """What `dmap run` says when a single file's pipeline gives configs only (a preset): every other component
    needs weights too."""
    if not any(c.single_file is not None for c in source.components):
        return None
    bare = [c.name for c in source.components if c.single_file is None and c.weights is None and not c.legacy_weights]
    if not bare:
        return None
    return (f"--pipeline {shown(source.preset or str(source.root))} has no weights for {', '.join(bare)}: dmap run takes "
            "them from a pipeline folder with weights (a preset gives configs only, which dmap plan needs).")

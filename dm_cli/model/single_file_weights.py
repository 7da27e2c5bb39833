"""A single-file checkpoint (original layout safetensors, or GGUF) standing in for one component of a pipeline:
`dmap plan FILE --pipeline PRESET|FOLDER` and `dmap run FILE --pipeline FOLDER`, and more files for named components
(`--component-file transformer_2=LOW.gguf`: Wan 2.2's second expert).

What the file holds is read from its header alone (`read_safetensors_header`, `read_gguf_header`: the hostile-file
rules of both readers apply), then renamed and reshaped the way diffusers' `from_single_file` does it: the same
`checkpoint_mapping_fn` of `SINGLE_FILE_LOADABLE_CLASSES`, run on meta tensors (GGUF's quantized ones as
diffusers' own `GGUFParameter`, so row splits keep their quantization type). The result names every tensor as the
diffusers model names it, with the bytes it keeps once loaded: quantized tensors stay quantized (diffusers
dequantizes one layer at a time while it runs), the others are cast to the run dtype as `from_single_file` casts them.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from dm_cli.errors import SourceError, UsageError
from dm_cli.io.checkpoint import read_safetensors_header
from dm_cli.model.demo import resolve
from dm_cli.model.formats.gguf_files import read_gguf_header, shown
from dm_cli.model.formats.single_file_layout import match_file
from dm_cli.model.models import component_class
from dm_cli.model.skeleton import load_skeleton

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
    named: bool = False  # True: given by --component-file NAME=FILE (else SOURCE, for the first matching component)

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
    # diffusers: imported on use, so start-up stays free of torch
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
    # torch: imported on use, so start-up stays free of torch
    import torch

    header = read_safetensors_header(path)
    meta = {}
    for name, entry in header.tensors.items():
        meta[name] = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")
    return meta


def _meta_gguf(path: Path) -> dict:
    """GGUF tensors on meta: plain types as their torch dtype, quantized ones as diffusers' GGUFParameter over
    their stored bytes (rows x bytes per row), exactly what `load_gguf_checkpoint` hands the mapping function."""
    # torch and diffusers: imported on use, so start-up stays free of torch
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    header = read_gguf_header(path)
    meta = {}
    for tensor in header.tensors:
        dtype, shape, qtype = _gguf_storage(path, tensor)
        data = torch.empty(shape, dtype=dtype, device="meta")
        meta[tensor.name] = data if qtype is None else GGUFParameter(data, quant_type=qtype)
    return meta


def _supported_quant_types():
    # diffusers: imported on use, so start-up stays free of torch
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return SUPPORTED_GGUF_QUANT_TYPES


def _stored(tensor) -> StoredTensor:
    quant_type = getattr(tensor, "quant_type", None)
    if quant_type is None:
        return StoredTensor(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    # gguf (numpy): imported on use, only for GGUF files
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


def _single_file_for(path: Path, comp) -> SingleFileWeights:
    """The file read as `comp` stores it and checked against its config (one sentence when it is not that)."""
    weights = read_single_file(path, comp.cls, comp.config)
    check_against(weights, load_skeleton(comp.name, comp.library, comp.cls, comp.config), comp.name)
    return weights


def attach_single_file(file_spec: str, source, skip=()):
    """The pipeline `source` with the component that `file_spec` holds taken from that file: the first component,
    in the pipeline's order, that diffusers can load from a single file and whose tensors the file matches (for
    Wan 2.2, whose experts share a class, the first: `transformer`), leaving out the components in `skip` (those
    --component-file names). One sentence when none does."""
    path = Path(file_spec).expanduser()
    _check_pipeline(source, "--pipeline")
    problems = []
    for position, comp in enumerate(source.components):
        if comp.name in skip or comp.config is None or mapping_function(comp.cls) is None:
            continue
        try:
            weights = _single_file_for(path, comp)
        except SourceError as error:
            problems.append(str(error))
            continue
        components = list(source.components)
        components[position] = replace(comp, weights=None, legacy_weights=[], single_file=weights)
        return replace(source, spec=file_spec, components=components,
                       notes=[*source.notes, f"'{comp.name}' from {shown(path.name)} ({weights.format})."])
    for comp in source.components:  # the file is one that --component-file gives already
        if comp.name in skip and comp.config is not None and mapping_function(comp.cls) is not None:
            try:
                _single_file_for(path, comp)
            except SourceError:
                continue
            raise UsageError(f"{shown(path.name)} holds the pipeline's {comp.name}, which --component-file gives "
                             f"(with {', '.join(skip)}): SOURCE's file needs a component of its own, drop one.")
    if problems:
        raise SourceError(problems[0])
    raise SourceError(f"No component of {shown(source.spec)} can be loaded from a single file by diffusers.")


def _check_pipeline(source, option: str) -> None:
    if source.kind != "pipeline":
        raise SourceError(f"{option} must name a pipeline (a preset or a folder with model_index.json); "
                          f"{shown(str(source.spec))} is a {source.kind}.")


# --- --component-file NAME=FILE ------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_named_file(value: str, option: str) -> tuple[str, str]:
    """`NAME=FILE` as --component-file spells it: split at the first '=', NAME a component name (letters, digits,
    underscores), FILE anything after it ('=' included)."""
    name, sep, file = str(value).partition("=")
    if not sep or not _NAME.fullmatch(name.strip()) or not file.strip():
        raise UsageError(f"{option} {shown(str(value))}: give COMPONENT=FILE, e.g. transformer_2=low_noise.gguf.")
    return name.strip(), file.strip()


def parse_component_files(values) -> dict[str, str]:
    """--component-file values (["transformer_2=LOW.gguf", ...]) or the API's {"transformer_2": "LOW.gguf"} as
    {component: file}; a component named twice, or a file that is not a .safetensors or .gguf file: one sentence."""
    if not values:
        return {}
    if isinstance(values, dict):
        pairs = [(str(k), v) for k, v in values.items()]
    elif isinstance(values, (str, os.PathLike)):
        pairs = [parse_named_file(os.fspath(values), "--component-file")]
    else:
        pairs = [parse_named_file(v, "--component-file") for v in values]
    files: dict[str, str] = {}
    for name, file in pairs:
        if not isinstance(file, (str, os.PathLike)):
            raise UsageError(f"component_files['{shown(name)}'] must be a path, not a {type(file).__name__}.")
        file = os.fspath(file)
        if name in files:
            raise UsageError(f"--component-file names '{shown(name)}' twice: give one file per component.")
        if not os.path.lexists(os.path.expanduser(file)):
            raise UsageError(f"--component-file {shown(name)}={shown(file)}: no such file.")
        if not is_single_file(file):
            raise UsageError(f"--component-file {shown(name)}={shown(file)}: not a .safetensors or .gguf file "
                             "(a single file holding that component).")
        files[name] = file
    return files


def attach_component_files(source, files: dict[str, str]):
    """The pipeline `source` with each named component taken from its file (checked against that component's
    config, as SOURCE's file is)."""
    _check_pipeline(source, "--component-file")
    names = [c.name for c in source.components]
    components = list(source.components)
    notes = list(source.notes)
    for name, file in files.items():
        if name not in names:
            raise UsageError(f"--component-file names '{shown(name)}', which {shown(str(source.spec))} has no weighted "
                             f"component of: its components are {', '.join(names)}.")
        position = names.index(name)
        comp = components[position]
        if comp.config is None or mapping_function(comp.cls) is None:
            raise SourceError(f"--component-file {shown(name)}: diffusers cannot load a {comp.cls} from a single file; "
                              "give a pipeline folder with that component's weights instead.")
        weights = replace(_single_file_for(Path(file).expanduser(), comp), named=True)
        components[position] = replace(comp, weights=None, legacy_weights=[], single_file=weights)
        notes.append(f"'{name}' from {shown(Path(file).name)} ({weights.format}, --component-file).")
    return replace(source, components=components, notes=notes)


def named_component_files(source) -> dict[str, str]:
    """{component: file} of the components --component-file gave (what a plan made again from `source` needs)."""
    return {c.name: str(c.single_file.path) for c in source.components
            if c.single_file is not None and c.single_file.named}


def resolve_with_pipeline(spec: str, pipeline: str | None, component_files=None):
    """SOURCE as `plan` and `run` take it: `resolve_source(spec)`, or with `--pipeline` the single file `spec` in the
    pipeline `pipeline` names (a preset or a folder); with `component_files` (--component-file, as
    `parse_component_files` takes them) those components from their files too (the SOURCE file then goes to the first
    matching component they do not name)."""
    files = parse_component_files(component_files)
    if pipeline is None:
        source = resolve(spec)
        if files and source.kind != "pipeline":
            raise UsageError(f"--component-file replaces components of a pipeline, and {shown(spec)} is a {source.kind}: "
                             "give the pipeline as SOURCE, or a single-file SOURCE with --pipeline.")
        return attach_component_files(source, files) if files else source
    if not is_single_file(spec):
        raise UsageError(f"--pipeline goes with a single-file SOURCE (a .safetensors or .gguf file); {shown(spec)} "
                         "is not one: give the pipeline itself as SOURCE.")
    base = resolve(pipeline)
    if files:
        _check_pipeline(base, "--pipeline")
        base = attach_component_files(base, files)
    return attach_single_file(spec, base, skip=tuple(files))


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, streamed (a run's metadata names each single file by it); remembered per process
    for a file whose size and modification time have not changed."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple, str] = {}


def component_files_metadata(source) -> str | None:
    """The run metadata's `component_files`: each component a single file gives (SOURCE's and --component-file's)
    as `name=file-name:sha256`, so that a queue resumed with another file redoes its items."""
    rows = [f"{c.name}={c.single_file.path.name}:{file_digest(c.single_file.path)}"
            for c in source.components if c.single_file is not None]
    return ",".join(rows) if rows else None


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


# --- a single file's tensors, converted, for `dmap shard FILE --to-diffusers` ---------------------------------


@dataclass
class ConvertedFile:
    """A single file converted by diffusers' own `checkpoint_mapping_fn` into the names of `comp` (a
    sources.ComponentSource), without reading the file: every tensor is a view of a read-only memory map,
    so renames and row splits stay views (byte ranges of the file) and only what the mapping computes (a
    concatenation, a swap of halves) or GGUF dequantization touches the data, one tensor at a time."""

    path: Path
    format: str
    comp: object
    tensors: dict  # diffusers name -> torch tensor (GGUF quantized: diffusers' GGUFParameter)
    base: int  # address of the map: a tensor whose data lies in [base, base + size) is a byte range of the file
    size: int
    keep_in_fp32: tuple[str, ...]  # the model's _keep_in_fp32_modules

    def file_range(self, tensor) -> tuple[int, int] | None:
        """(begin, end) in the file of a tensor that is a contiguous view of it, else None."""
        if not tensor.is_contiguous():
            return None
        nbytes = tensor.numel() * tensor.element_size()
        begin = tensor.data_ptr() - self.base
        return (begin, begin + nbytes) if nbytes and 0 <= begin and begin + nbytes <= self.size else None

    def kept_in_fp32(self, name: str) -> bool:
        """diffusers' rule (`_keep_in_fp32_modules`): a module name among the tensor's dotted parts."""
        parts = name.split(".")
        return any(module in parts for module in self.keep_in_fp32)


def component_for_file(path: Path, pipeline: str | None):
    """(component, where its config comes from) for the component the file holds: with `pipeline` (a preset or a
    folder) its first component the file matches, as `--pipeline` picks; without, the bundled preset that `dmap
    inspect` recognizes the file as. A file already in diffusers' layout, or in a layout neither knows: one sentence."""
    if pipeline is not None:
        source = resolve(pipeline)
        _check_pipeline(source, "--pipeline")
        candidates = [c for c in source.components if c.config is not None and mapping_function(c.cls) is not None]
        where = f"--pipeline {shown(pipeline)}"
    else:
        comp, where = _recognized_component(path)
        candidates = [comp]
    _refuse_diffusers_layout(path, candidates)
    problems = []
    for comp in candidates:
        try:
            _single_file_for(path, comp)
            return comp, where
        except SourceError as error:
            problems.append(str(error))
    raise SourceError(problems[0] if problems else f"No component of {shown(str(pipeline))} can be loaded from a "
                      "single file by diffusers.")


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if path.name.lower().endswith(".gguf"):
        return {t.name: t.shape for t in read_gguf_header(path).tensors}
    return {name: tuple(e.shape) for name, e in read_safetensors_header(path).tensors.items()}


def _recognized_component(path: Path):
    found = match_file(_file_shapes(path))
    if found is None:
        raise SourceError(f"{shown(path.name)} is in no original layout that diffusers' single-file loader knows (a "
                          "diffusers-layout file needs no conversion: put it beside its config.json, or give "
                          "--pipeline P if it is one component of P).")
    model, component, source = found
    if source is None:
        raise SourceError(f"{shown(path.name)} is {model}, for which dmap bundles no config: give --pipeline with a "
                          "folder that has its config.")
    return source.component(component), f"preset {source.preset or source.spec}"


def _refuse_diffusers_layout(path: Path, candidates) -> None:
    """A file whose names and shapes are already a candidate's own (diffusers' layout): nothing to convert."""
    shapes = _file_shapes(path)
    for comp in candidates:
        built = {t.name: tuple(t.shape) for t in load_skeleton(comp.name, comp.library, comp.cls, comp.config).tensors
                 if t.kind != "buffer_np"}
        if built == shapes:
            hint = "" if path.name.lower().endswith(".gguf") else "; `dmap shard` reshards it beside its config.json"
            raise UsageError(f"{shown(path.name)} is already in diffusers' layout (the {comp.name}'s own names and "
                             f"shapes): nothing to convert{hint}.")


def convert_file(path: Path, comp) -> ConvertedFile:
    """`path` converted into `comp`'s names by diffusers' mapping function, on views of a memory map."""
    # numpy: imported on use, only when tensor data is read
    import numpy as np

    fmt = GGUF if path.name.lower().endswith(".gguf") else SAFETENSORS
    try:  # read-only and shared: a copy-on-write map of a 28 GB file would be charged 28 GB of commit
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise SourceError(f"Cannot map {shown(path.name)}: {error}.") from None
    with warnings.catch_warnings():  # torch warns that the views are read-only: diffusers' mappings never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state = _gguf_views(path, mapped) if fmt == GGUF else _safetensors_views(path, mapped)
    try:
        converted = mapping_function(comp.cls)(state, config=comp.config)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as error:
        raise SourceError(f"{shown(path.name)} does not hold a {comp.cls} in a layout diffusers' single-file loader "
                          f"knows ({type(error).__name__}: {shown(str(error), 120)}).") from None
    keep = tuple(getattr(component_class(comp.library, comp.cls), "_keep_in_fp32_modules", None) or ())
    return ConvertedFile(path, fmt, comp, converted, mapped.ctypes.data, mapped.size, keep)


def _view(mapped, begin: int, end: int, dtype, shape):
    """The bytes [begin, end) of the map as a tensor; a copy only where the dtype's alignment forbids a view."""
    # torch: imported on use, so start-up stays free of torch
    import torch

    raw = torch.from_numpy(mapped[begin:end])
    if begin == end:
        return torch.empty(shape, dtype=dtype)
    try:
        return raw.view(dtype).reshape(shape)
    except RuntimeError:  # an offset that is not a multiple of the element size
        return raw.clone().view(dtype).reshape(shape)


def _safetensors_views(path: Path, mapped) -> dict:
    # torch: imported on use, so start-up stays free of torch
    import torch

    header = read_safetensors_header(path)
    if mapped.size != max((e.end for e in header.tensors.values()), default=mapped.size):
        raise SourceError(f"{shown(path.name)} changed while dmap read it: its size no longer fits its header.")
    return {name: _view(mapped, e.begin, e.end, getattr(torch, e.dtype), e.shape) for name, e in header.tensors.items()}


def _gguf_views(path: Path, mapped) -> dict:
    """As diffusers' `load_gguf_checkpoint` gives them (F32, F16 plain; quantized as GGUFParameter over their
    blocks), but BF16 plain too (the same values) and never copied."""
    # diffusers: imported on use, so start-up stays free of torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    header = read_gguf_header(path)
    if header.byte_order != "little":
        raise SourceError(f"{shown(path.name)} is a big-endian GGUF file, which diffusers' GGUF loader does not read.")
    if mapped.size != header.file_size:
        raise SourceError(f"{shown(path.name)} changed while dmap read it: its size no longer fits its header.")
    views = {}
    for tensor in header.tensors:
        dtype, shape, qtype = _gguf_storage(path, tensor)
        data = _view(mapped, tensor.offset, tensor.offset + tensor.nbytes, dtype, shape)
        views[tensor.name] = data if qtype is None else GGUFParameter(data, quant_type=qtype)
    return views


def _gguf_storage(path, tensor):
    """(torch dtype, shape, quant type or None) a GGUF tensor is held in as diffusers' GGUF loader holds it: plain
    types as themselves, quantized ones as uint8 rows of blocks; a type that loader cannot read: one sentence."""
    # torch and gguf: imported on use, so start-up stays free of torch
    import gguf
    import torch

    plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if tensor.ggml_type in plain:
        return plain[tensor.ggml_type], tensor.shape, None
    qtype = getattr(gguf.GGMLQuantizationType, tensor.ggml_type, None)
    if qtype is None or qtype not in _supported_quant_types():
        raise SourceError(f"{shown(path.name)}: tensor '{shown(tensor.name)}' has ggml type {tensor.ggml_type}, which "
                          "diffusers' GGUF loader does not support.")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *rows, inner = tensor.shape
    return torch.uint8, (*rows, inner // block * type_size), qtype

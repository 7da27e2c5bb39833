"""`dmap shard`: rewrite weights as loader-friendly safetensors shards without loading the model.

Why streaming: the usual recipe (load, `save_pretrained(max_shard_size=...)`) needs the whole model
in RAM. A safetensors tensor is a byte range, so when the dtype does not change each tensor is
copied range to range (in the kernel where the OS allows, else through one small buffer); with
`--dtype` tensors are converted one at a time. Headers and index files are written by us,
deterministically, so the same input always gives byte-identical output.

Safety: everything is written into a hidden temporary folder beside the output, fsynced, re-read
and compared tensor by tensor with the source, and only then renamed into place. The source is
never modified unless `in_place`, and then only after that verification. Byte copies are read back
and compared piece by piece as they are written, while the piece is in the CPU's cache
(`_copy_verified`); fsyncs, and the hashing back of converted tensors, run on background threads
while the next tensors are written (see `_ShardFinisher`), so they cost little extra wall time.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _encode_json_string
from pathlib import Path

from dm_cli.errors import CheckpointError, DmapError, SourceError, UsageError
from dm_cli.io.atomic import refuse_existing
from dm_cli.io.checkpoint import (
    LEGACY_SUFFIXES,
    WEIGHT_STEMS,
    find_component_weights,
    legacy_files_loaded,
    load_legacy_weights,
    open_checkpoint,
    read_safetensors_header,
)
from dm_cli.io.swap import (
    MARKS,
    TEMP_MARK,
    SwapFolder,
    finish_swaps,
    fsync_dir,
    hidden_name,
    publish,
    recover,
    swap_in_place,
)
from dm_cli.model.formats.weight_formats import FP8_NAMES, KEPT_BY_DEFAULT, STORAGE_DTYPES
from dm_cli.model.sources import is_inside
from dm_cli.units import DTYPE_BYTES, TORCH_TO_SAFETENSORS, format_size, numel, parse_dtype, parse_size

MIN_SHARD_SIZE = 10**6  # below 1 MB a "shard" is a mistake, not a choice
COPY_CHUNK = 64 << 20  # bytes per copy_file_range call: keeps the progress bar moving
BUFFER_BYTES = 8 << 20  # the one bounded buffer used when bytes must pass through Python
VERIFY_WINDOW = 256 << 10  # bytes copied and compared at once when verifying: buffers that stay in the CPU's cache
HASH_CHUNK = 1 << 20  # read size when hashing converted tensors back
VERIFY_THREADS = 2  # threads hashing converted tensors back beside the writing thread (sha256 releases the GIL)
VERIFY_BATCH_BYTES = 16 << 20  # tensors per verification job: a few MB, or
VERIFY_BATCH_RUNS = 4096  # this many separate ranges (a million tiny tensors: a few hundred jobs)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".onnx", ".onnx_data")
CONVERTIBLE = {"float64", "float32", "float16", "bfloat16"}  # fp8 and integer tensors keep their dtype


# --- plan -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class SourceTensor:
    """Where one tensor's bytes come from: a byte range of a safetensors file, or a legacy file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int = 0
    end: int = 0
    legacy: bool = False

    @property
    def numel(self) -> int:
        return numel(self.shape)


@dataclass(slots=True)
class PlannedTensor:
    source: SourceTensor
    dtype: str  # written dtype
    offset: int = 0  # relative to the end of the header, as in the file
    nbytes: int = field(init=False)  # computed once: planning and writing ask for it many times

    def __post_init__(self) -> None:
        self.nbytes = self.source.numel * DTYPE_BYTES[self.dtype]

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def byte_copy(self) -> bool:
        """True when the output bytes are the source bytes (no conversion, no unpickling)."""
        return not self.source.legacy and self.dtype == self.source.dtype


@dataclass
class ShardFile:
    name: str
    tensors: list[PlannedTensor]  # in data order
    header: bytes  # the 8-byte length and the JSON header, exactly as written
    oversized: bool = False  # one tensor alone exceeds the limit

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass
class ComponentPlan:
    """One component's new layout; `folder` is relative to the output ("" for the output itself)."""

    name: str
    library: str | None
    cls: str
    source_folder: Path
    source_files: list[Path]  # the weight files read (and replaced by --in-place)
    folder: str
    stem: str
    variant: str | None
    shards: list[ShardFile]
    index_name: str | None
    metadata: dict[str, str]  # carried from the source + dropped shared names
    dropped: dict[str, str]  # dropped name -> kept name (tied/shared tensors)
    converted: int = 0
    legacy: bool = False

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [t for shard in self.shards for t in shard.tensors]

    @property
    def total_size(self) -> int:
        return sum(shard.data_bytes for shard in self.shards)

    @property
    def total_parameters(self) -> int:
        return sum(t.source.numel for t in self.tensors)

    @property
    def oversized(self) -> list[tuple[str, str, int]]:
        return [(s.name, s.tensors[0].name, s.tensors[0].nbytes) for s in self.shards if s.oversized]

    def index_bytes(self) -> bytes | None:
        if self.index_name is None:
            return None
        metadata: dict = dict(self.metadata.items())
        metadata["total_size"] = self.total_size
        metadata["total_parameters"] = self.total_parameters
        weight_map = {t.name: shard.name for shard in self.shards for t in shard.tensors}
        text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        return text.encode("utf-8")

    def output_files(self) -> list[str]:
        names = [s.name for s in self.shards]
        return names + ([self.index_name] if self.index_name else [])

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "class": self.cls,
            "folder": self.folder,
            "source_files": [str(p) for p in self.source_files],
            "index": self.index_name,
            "total_size": self.total_size,
            "total_parameters": self.total_parameters,
            "tensors": len(self.tensors),
            "converted_tensors": self.converted,
            "dropped_shared": dict(sorted(self.dropped.items())),
            "files": [
                {"name": s.name, "bytes": s.file_bytes, "tensor_bytes": s.data_bytes, "tensors": len(s.tensors),
                 "oversized": s.oversized}
                for s in self.shards
            ],
            "oversized_tensors": [{"file": f, "tensor": t, "bytes": b} for f, t, b in self.oversized],
        }


@dataclass
class ShardResult:
    source: str
    kind: str
    output: Path
    max_shard_size: int
    dtype: str | None
    variant: str | None
    dry_run: bool
    in_place: bool
    components: list[ComponentPlan]
    copied_files: list[str] = field(default_factory=list)  # relative paths copied unchanged
    skipped_files: list[str] = field(default_factory=list)  # weight files not carried over
    bytes_written: int = 0
    seconds: float = 0.0
    verified: bool = False
    removed_stale: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # --to-diffusers: where config.json came from, what was dequantized

    @property
    def total_size(self) -> int:
        return sum(c.total_size for c in self.components)

    @property
    def file_count(self) -> int:
        return sum(len(c.shards) for c in self.components)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "kind": self.kind,
            "output": str(self.output),
            "max_shard_size": self.max_shard_size,
            "dtype": self.dtype,
            "variant": self.variant,
            "dry_run": self.dry_run,
            "in_place": self.in_place,
            "verified": self.verified,
            "total_size": self.total_size,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "components": [c.to_json() for c in self.components],
            "copied_files": self.copied_files,
            "skipped_files": self.skipped_files,
            "removed_stale": self.removed_stale,
            **({"notes": self.notes} if self.notes else {}),
        }


class Progress:
    """What the core reports while it works; the renderer draws it. The default draws nothing."""

    def phase(self, name: str, total_bytes: int) -> None:
        pass

    def advance(self, num_bytes: int) -> None:
        pass


# --- naming ---------------------------------------------------------------------------------------


_DIGIT_RUNS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """`blocks.2` before `blocks.10`: shards then hold whole blocks in model order.

    Text and digit runs alternate (text first, maybe empty), so keys compare position by position
    as str with str and int with int; only runs `\\d` matched are read as numbers ("²" is text).
    A run longer than Python converts (`sys.get_int_max_str_digits()`, 4300 by default; in a hostile
    header) is ordered by its start."""
    parts = _DIGIT_RUNS.split(name)
    try:
        parts[1::2] = map(int, parts[1::2])
    except ValueError:
        longest = sys.get_int_max_str_digits() or 4300  # 0: no limit, so no run was too long; keep a bound anyway
        parts[1::2] = [int(run[:longest]) for run in parts[1::2]]
    return tuple(parts)


def shard_file_names(stem: str, variant: str | None, count: int) -> tuple[list[str], str | None]:
    """Names exactly as diffusers/transformers write them (variant before the shard counter)."""
    base = f"{stem}.{variant}" if variant else stem
    if count <= 1:
        return [f"{base}.safetensors"], None
    index = f"{stem}.safetensors.index.{variant}.json" if variant else f"{stem}.safetensors.index.json"
    return [f"{base}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)], index


_SHARD_NAME_RE = re.compile(r"^(?P<stem>.+?)(?:\.(?P<variant>\w+))?-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def _stem_of(path: Path) -> tuple[str, str | None]:
    """(stem, variant) of an existing weight file or index name."""
    name = path.name
    match = _SHARD_NAME_RE.match(name)
    if match:
        return match["stem"], match["variant"]
    match = re.match(r"^(?P<stem>.+?)\.(?:safetensors|bin)\.index(?:\.(?P<variant>\w+))?\.json$", name)
    if match:
        return match["stem"], match["variant"]
    for suffix in (".safetensors", *LEGACY_SUFFIXES):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            for known in (*WEIGHT_STEMS, "pytorch_model"):
                if base.startswith(known + ".") and "." not in base[len(known) + 1:]:
                    return known, base[len(known) + 1:]
            return base, None
    return path.stem, None


def _output_stem(source_stem: str, library: str | None) -> str:
    if source_stem in WEIGHT_STEMS:
        return source_stem
    if source_stem == "pytorch_model" or library == "transformers":
        return "model"
    if library == "diffusers":
        return "diffusion_pytorch_model"
    return source_stem


# --- reading the source ---------------------------------------------------------------------------


@dataclass
class _Weights:
    """What one component's weights are: files, tensors, carried metadata, legacy state dicts."""

    files: list[Path]
    tensors: list[SourceTensor]
    metadata: dict[str, str]
    dropped: dict[str, str]
    legacy: dict[Path, dict] = field(default_factory=dict)


def _read_safetensors(weights: Path) -> _Weights:
    checkpoint = open_checkpoint(weights, strict=True)
    files = {name: weights.parent / name for name in set(checkpoint.tensor_files.values())}
    tensors = [SourceTensor(name, e.dtype, e.shape, files[checkpoint.tensor_files[name]], e.begin, e.end)
               for name, e in checkpoint.tensors.items()]
    metadata: dict[str, str] = {}
    if checkpoint.index is not None:
        for key, value in checkpoint.index.metadata.items():
            if key not in ("total_size", "total_parameters") and isinstance(value, str):
                metadata[key] = value
    else:
        for key, value in next(iter(checkpoint.headers.values())).metadata.items():
            if key != "format":
                metadata[str(key)] = str(value)
    files = list(checkpoint.files) + ([checkpoint.index.path] if checkpoint.index is not None else [])
    return _Weights(files, tensors, metadata, {})




def _read_legacy(files: list[Path]) -> _Weights:
    """Legacy `.bin`/`.pt` files: tensors sharing storage are written once (huggingface_hub's rule)."""
    legacy: dict[Path, dict] = {}
    tensors: list[SourceTensor] = []
    seen: dict[str, Path] = {}
    groups: dict[tuple, list[str]] = {}
    for path in files:
        state = load_legacy_weights(path)
        legacy[path] = state
        for key, value in state.items():
            if key in seen:
                raise CheckpointError(f"Tensor '{key}' is stored in both {seen[key].name} and {path.name}.")
            seen[key] = path
            if value.numel() > 0:
                identity = (path, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                            tuple(value.stride()), value.dtype)
                groups.setdefault(identity, []).append(key)
    dropped: dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:
            kept, *others = sorted(names)
            for other in others:
                dropped[other] = kept
    for path, state in legacy.items():
        for key, value in state.items():
            if key not in dropped:
                tensors.append(SourceTensor(key, str(value.dtype).removeprefix("torch."), tuple(value.shape), path, legacy=True))
    metadata = dict(dropped)
    return _Weights(list(files), tensors, metadata, dropped, legacy)


def _component_weights(comp, variant: str | None) -> tuple[_Weights, Path]:
    """Read a component's weights (safetensors preferred, as the loaders do); returns (weights, naming file)."""
    weights = comp.weights
    if comp.folder is not None and comp.folder.is_dir() and (variant or weights is None):
        weights = (find_component_weights(comp.folder, variant) if variant else None) or weights
    if weights is not None and weights.suffix in LEGACY_SUFFIXES:
        return _read_legacy([weights]), weights
    if weights is not None:
        return _read_safetensors(weights), weights
    if comp.folder is not None:
        files = legacy_files_loaded(comp.folder, variant, list(comp.legacy_weights)) or (
            legacy_files_loaded(comp.folder, None, list(comp.legacy_weights)) if variant else None
        )
        if files:
            shards = [f for f in files if not f.name.endswith(".json")]
            loaded = _read_legacy(shards)
            loaded.files = files
            return loaded, files[-1] if files[-1].name.endswith(".json") else files[0]
    where = comp.folder if comp.folder is not None else comp.name
    raise SourceError(f"Component '{comp.name}' ({where}) has no weights to shard (no .safetensors or .bin file).")


# --- planning -------------------------------------------------------------------------------------


def _entry_json(t: PlannedTensor, begin: int, end: int) -> str:
    """What json.dumps(..., separators=(",", ":")) writes, built directly: it runs once per tensor."""
    shape = ",".join(map(str, t.shape))
    return f'{{"dtype":"{TORCH_TO_SAFETENSORS[t.dtype]}","shape":[{shape}],"data_offsets":[{begin},{end}]}}'


def _name_json(name: str) -> str:
    return _encode_json_string(name)  # json.dumps(name, ensure_ascii=False), without its Python wrapper


def _entry_bound(t: PlannedTensor, limit: int) -> int:
    """Header bytes this tensor can add at most: offsets inside a shard never exceed the limit."""
    return len(_name_json(t.name).encode("utf-8")) + 2 + len(_entry_json(t, limit, limit))


def _metadata_bound(metadata: dict[str, str]) -> int:
    return len(json.dumps({"__metadata__": metadata}, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def build_header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> tuple[bytes, list[PlannedTensor]]:
    """Deterministic header: largest alignment first, then natural name order; padded to 8 bytes.

    Placing 8-byte dtypes first keeps every tensor aligned to its element size, as safetensors' own
    writer does, so memory-mapped loads never see a misaligned tensor. `tensors` come in natural
    name order (plan_shards sorts them once), which the stable sort keeps within each alignment.
    """
    ordered = sorted(tensors, key=lambda t: -DTYPE_BYTES[t.dtype])
    parts = [json.dumps("__metadata__") + ":" + json.dumps(dict(sorted(metadata.items())), ensure_ascii=False,
                                                                 separators=(",", ":"))]
    offset = 0
    for t in ordered:
        t.offset = offset
        parts.append(_name_json(t.name) + ":" + _entry_json(t, offset, offset + t.nbytes))
        offset += t.nbytes
    raw = ("{" + ",".join(parts) + "}").encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


def plan_shards(tensors: list[PlannedTensor], limit: int, stem: str, variant: str | None,
                metadata: dict[str, str]) -> tuple[list[ShardFile], str | None]:
    """Greedy packing in natural name order, by real file size (header included).

    One file without an index when the limit is 0 or the whole model fits, as the Hub libraries do;
    a tensor larger than the limit gets a shard of its own.
    """
    ordered = sorted(tensors, key=lambda t: natural_key(t.name))
    file_metadata = {"format": "pt"}
    costs = [] if limit == 0 else [_entry_bound(t, limit) + t.nbytes for t in ordered]  # header entry + data, at most
    # a bound on the one file's size: 8 + header (+ padding to 8) + data
    if limit == 0 or 8 + _metadata_bound({**metadata, **file_metadata}) + 8 + sum(costs) <= limit:
        names, _ = shard_file_names(stem, variant, 1)
        header, data_order = build_header(ordered, {**metadata, **file_metadata})
        return [ShardFile(names[0], data_order, header)], None
    base = _metadata_bound(file_metadata)
    groups: list[tuple[list[PlannedTensor], bool]] = []
    current: list[PlannedTensor] = []
    current_bound = 8 + base + 8
    for t, cost in zip(ordered, costs):
        if 8 + base + 8 + cost > limit:
            if current:
                groups.append((current, False))
                current, current_bound = [], 8 + base + 8
            groups.append(([t], True))
            continue
        if current and current_bound + cost > limit:
            groups.append((current, False))
            current, current_bound = [], 8 + base + 8
        current.append(t)
        current_bound += cost
    if current:
        groups.append((current, False))
    if len(groups) == 1:
        # Only the source's metadata (dropped shared names) kept the whole model over the limit. A single
        # file must carry that metadata in its own header, so split it in two and let the index carry it.
        group, _ = groups[0]
        if len(group) == 1:
            names, _ = shard_file_names(stem, variant, 1)
            header, data_order = build_header(group, {**metadata, **file_metadata})
            return [ShardFile(names[0], data_order, header, True)], None
        groups = [(group[:-1], False), (group[-1:], False)]
    names, index_name = shard_file_names(stem, variant, len(groups))
    shards = []
    for name, (group, oversized) in zip(names, groups):
        header, data_order = build_header(group, file_metadata)
        shards.append(ShardFile(name, data_order, header, oversized))
    return shards, index_name


# --- the command ----------------------------------------------------------------------------------


def _resolve(spec: str):
    """A Source for SOURCE; legacy `.bin`/`.pt` files are accepted here too."""
    from dm_cli.model.sources import ComponentSource, Source, read_json

    path = Path(spec).expanduser()
    if path.is_file() and path.suffix in LEGACY_SUFFIXES:
        config_path = path.parent / "config.json"
        library, cls, config = None, "?", None
        if config_path.is_file():
            config = read_json(config_path, "config.json")
            library = "diffusers" if "_class_name" in config else ("transformers" if config.get("architectures") else None)
            cls = str(config.get("_class_name") or (config.get("architectures") or ["?"])[0])
        comp = ComponentSource(_stem_of(path)[0], library, cls, config, path.parent, path)
        return Source(spec, "weights", path.parent, components=[comp])
    from dm_cli.model.demo import resolve

    return resolve(spec)


def _default_output(source) -> Path:
    root = source.root
    if source.kind == "weights":
        weights = source.components[0].weights
        return weights.parent / f"{_stem_of(weights)[0]}-sharded"
    return root.parent / f"{root.name}-sharded"


def _checked_options(max_shard_size: int | str, dtype: str | None, variant: str | None, in_place: bool,
                     output, min_shard_size: int) -> tuple[int, bool, object]:
    """The options alone, checked before the source is read or anything beside it is touched."""
    limit = parse_size(max_shard_size)
    if 0 < limit < min_shard_size:
        raise UsageError(
            f"--max-shard-size {max_shard_size} is below the {format_size(min_shard_size)} minimum: use 0 for one file, "
            f"or a size such as 500MB or 5GB."
        )
    fp8 = dtype is not None and dtype.strip().lower() in FP8_NAMES
    target_dtype = STORAGE_DTYPES["fp8"] if fp8 else parse_dtype(dtype) if dtype is not None else None
    if variant is not None and not re.fullmatch(r"\w+", variant):
        raise UsageError(f"--variant '{variant}' must be a plain word such as fp16.")
    if in_place and output is not None:
        raise UsageError("Give either --output or --in-place, not both.")
    return limit, fp8, target_dtype


def plan_shard(source_spec: str, max_shard_size: int | str, output: str | os.PathLike | None = None,
               dtype: str | None = None, variant: str | None = None, in_place: bool = False,
               overwrite: bool = False, min_shard_size: int = MIN_SHARD_SIZE) -> tuple[ShardResult, object, dict]:
    """Validate everything and plan the layout; writes nothing. Returns (result, source, legacy dicts)."""
    limit, fp8, target_dtype = _checked_options(max_shard_size, dtype, variant, in_place, output, min_shard_size)
    source = _resolve(source_spec)
    if source.root is None or not Path(source_spec).expanduser().exists() and source.preset:
        raise SourceError(f"'{source_spec}' is a preset without weights: give a folder or file with weights to shard.")
    if in_place and not Path(source_spec).expanduser().exists():
        raise UsageError(f"--in-place needs a local path; '{source_spec}' was resolved from a cache, which dmap will not modify.")

    components: list[ComponentPlan] = []
    legacy: dict[Path, dict] = {}
    for comp in source.components:
        weights, naming_file = _component_weights(comp, variant)
        legacy.update(weights.legacy)
        source_stem, source_variant = _stem_of(naming_file)
        out_variant = variant if variant is not None else source_variant
        if source.kind == "weights":
            stem = _output_stem(source_stem, None) if source_stem == "pytorch_model" else source_stem
            folder = ""
        else:
            stem = _output_stem(source_stem, comp.library)
            folder = "" if source.kind == "component" else comp.name
        planned = []
        converted = 0
        cast = None
        if fp8:  # as --weights fp8: a pipeline's VAE keeps its dtype
            cast = set() if source.kind == "pipeline" and comp.name in KEPT_BY_DEFAULT else _fp8_tensors(comp)
        for st in weights.tensors:
            out = target_dtype if (target_dtype and st.dtype in CONVERTIBLE and (cast is None or st.name in cast)) else st.dtype
            converted += out != st.dtype
            planned.append(PlannedTensor(st, out))
        shards, index_name = plan_shards(planned, limit, stem, out_variant, weights.metadata)
        components.append(ComponentPlan(
            comp.name, comp.library, comp.cls, comp.folder or source.root, weights.files, folder, stem, out_variant,
            shards, index_name, weights.metadata, weights.dropped, converted, bool(weights.legacy),
        ))

    source_path = Path(source_spec).expanduser().resolve() if Path(source_spec).expanduser().exists() else source.root
    if in_place:
        out_path = source.root.resolve()
        _check_in_place(components)
    else:
        if output is None and source.hub_snapshot is not None:
            raise UsageError(f"'{source_spec}' was read from the Hugging Face cache, which dmap never writes into: "
                             "give --output.")
        out_path = Path(output).expanduser().resolve() if output is not None else _default_output(source).resolve()
        _check_output_parent(out_path)
        root = source.root.resolve()
        if out_path == root or (source.kind != "weights" and is_inside(out_path, root)):
            raise UsageError(f"The output {out_path} is the source or inside it: choose another --output, or use --in-place.")
        if is_inside(root, out_path) or (source.kind == "weights" and is_inside(source_path, out_path)):
            raise UsageError(f"The output {out_path} contains the source: choose another --output.")
        refuse_existing([out_path], overwrite)
        if out_path.exists() and not out_path.is_dir():
            raise UsageError(f"The output {out_path} exists and is not a folder.")
    result = ShardResult(source_spec, source.kind, out_path, limit, target_dtype, variant, False, in_place, components)
    return result, source, legacy


def _fp8_tensors(comp) -> set[str]:
    """Names (tied aliases included) that layerwise casting stores in fp8: the rest keeps its dtype."""
    from dm_cli.model.skeleton import load_skeleton

    if comp.config is None:
        raise UsageError(f"--dtype fp8 needs the config of '{comp.name}' to know which layers stay in high precision: "
                         "shard its folder with config.json.")
    skeleton = load_skeleton(comp.name, comp.library, comp.cls, comp.config)  # the config decides; headers read once
    cast = {t.name for t in skeleton.tensors if "fp8" in t.low_precision}
    return cast | {alias for group in skeleton.tie_groups if group[0] in cast for alias in group[1:]}


def _check_output_parent(out_path: Path) -> None:
    """The output's folder exists, is writable and is not the Hugging Face cache."""
    from dm_cli.model.sources import hub_cache_root

    parent = out_path.parent
    if not parent.is_dir():
        raise UsageError(f"The folder of the output, {parent}, does not exist: create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"Cannot write into {parent}: permission denied.")
    cache = hub_cache_root()
    if cache.is_dir() and is_inside(out_path, cache.resolve()):
        raise UsageError(f"The output {out_path} is inside the Hugging Face cache ({cache}), which dmap never "
                         "writes into: choose another --output.")


def _check_in_place(components: list[ComponentPlan]) -> None:
    """New file names must not hit files that are not being replaced; every old file is in its folder."""
    for comp in components:
        folder = comp.source_folder.resolve()
        old = {p.name for p in comp.source_files}
        for path in comp.source_files:
            if path.parent.resolve() != folder:
                raise UsageError(f"--in-place: {path} is not in {folder}; write the result elsewhere with --output.")
        for name in comp.output_files():
            if name not in old and (folder / name).exists():
                raise UsageError(f"--in-place would write {folder / name}, which exists and is not one of the files "
                                 "being replaced; move it away or use --output.")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--in-place: cannot write into {folder}: permission denied.")


def _copy_plan(source, result: ShardResult) -> list[tuple[Path, str]]:
    """Files carried over unchanged (configs, tokenizer, scheduler...): (source path, relative path)."""
    if source.kind == "weights" or result.in_place:
        return []
    root = source.root
    weighted = {c.source_folder.resolve() for c in result.components}
    read = {f.resolve() for c in result.components for f in c.source_files}
    copies: list[tuple[Path, str]] = []
    for folder, dirs, files in os.walk(root, onerror=_unreadable):
        dirs[:] = sorted(d for d in dirs if not any(m in d for m in MARKS) and d not in (".git", ".cache"))
        here = Path(folder)
        for name in sorted(files):
            path = here / name
            rel = path.relative_to(root).as_posix()
            in_weighted = here.resolve() in weighted
            is_weight = name.endswith(WEIGHT_SUFFIXES) or re.search(r"\.index(\.\w+)?\.json$", name)
            if in_weighted and is_weight:
                if path.resolve() not in read:
                    result.skipped_files.append(rel)
            else:
                _check_copyable(path)
                copies.append((path, rel))
    return copies


def _unreadable(error: OSError) -> None:
    raise SourceError(f"Cannot read {error.filename}: {error.strerror or error}; nothing was written.")


def _check_copyable(path: Path) -> None:
    if path.is_symlink() and not path.exists():
        raise SourceError(f"{path} is a dangling symbolic link: fix or remove it, then shard again.")
    if not path.is_file():
        raise SourceError(f"{path} is not a regular file (a FIFO or a device?): remove it, then shard again.")
    if not os.access(path, os.R_OK):
        raise SourceError(f"{path} cannot be read: permission denied.")


def shard(source_spec: str, max_shard_size: int | str, output: str | os.PathLike | None = None,
          dtype: str | None = None, variant: str | None = None, dry_run: bool = False, overwrite: bool = False,
          in_place: bool = False, verify: bool = True, progress: Progress | None = None,
          min_shard_size: int = MIN_SHARD_SIZE) -> ShardResult:
    """Plan, write into a temporary folder, verify, then move into place (or replace the source)."""
    started = time.perf_counter()
    progress = progress or Progress()
    _checked_options(max_shard_size, dtype, variant, in_place, output, min_shard_size)
    finished = _finish_interrupted_swaps(source_spec) if in_place and not dry_run else []
    result, source, legacy = plan_shard(source_spec, max_shard_size, output, dtype, variant, in_place, overwrite,
                                        min_shard_size)
    result.removed_stale = finished
    copies = _copy_plan(source, result)
    result.copied_files = [rel for _, rel in copies]
    if dry_run:
        result.dry_run = True
        result.seconds = time.perf_counter() - started
        return result

    _write_result(result, copies, legacy, {}, progress, verify, overwrite)
    result.seconds = time.perf_counter() - started
    return result


# --- --to-diffusers: one single file as a diffusers component folder ------------------------------------------


@dataclass(frozen=True)
class _QuantizedRange:
    """A GGUF quantized tensor as a byte range of its file (read when the writer gets to it, never mapped)."""

    path: Path
    begin: int
    end: int
    shape: tuple[int, ...]  # rows x bytes of blocks, as diffusers' GGUFParameter holds it
    quant_type: int


class _Dequantized(dict):
    """The writer's in-memory tensors (what `_tensor_bytes` reads by name) for --to-diffusers: a GGUF quantized
    tensor is read (one bounded read) and dequantized with diffusers' own `dequantize_gguf_tensor` only when the
    writer asks for it."""

    def __getitem__(self, name):
        tensor = super().__getitem__(name)
        if isinstance(tensor, _QuantizedRange):
            import torch
            from diffusers.quantizers.gguf.utils import GGUFParameter

            with open(tensor.path, "rb") as handle:
                handle.seek(tensor.begin)
                raw = bytearray(handle.read(tensor.end - tensor.begin))
            if len(raw) != tensor.end - tensor.begin:
                raise CheckpointError(f"{tensor.path.name} ended before tensor '{name}': it changed while dmap read it.")
            data = torch.frombuffer(raw, dtype=torch.uint8).reshape(tensor.shape)
            tensor = GGUFParameter(data, quant_type=tensor.quant_type)
        if getattr(tensor, "quant_type", None) is None:
            return tensor
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        return dequantize_gguf_tensor(tensor)


def shard_to_diffusers(file_spec: str, max_shard_size: int | str = "5GB", output: str | os.PathLike | None = None,
                       dtype: str | None = None, pipeline: str | None = None, dry_run: bool = False,
                       overwrite: bool = False, verify: bool = True, progress: Progress | None = None,
                       min_shard_size: int = MIN_SHARD_SIZE) -> ShardResult:
    """A single file (original-layout .safetensors or GGUF) as the diffusers component folder `from_pretrained`
    loads: config.json from the bundled preset (or --pipeline's) config and diffusers-named shards, renamed by
    diffusers' own `checkpoint_mapping_fn` and written by the shard writer (streamed, verified, renamed into place
    when complete).

    dtypes: a safetensors file's tensors keep their dtype unless `dtype`; GGUF quantized tensors are dequantized
    (diffusers' `dequantize_gguf_tensor`) to `dtype`, bf16 by default, and its other floating tensors converted to it;
    either way the tensors of the model's `_keep_in_fp32_modules` stay float32 (dequantized to it), as both
    of diffusers' loaders keep them."""
    from dm_cli.model.single_file_weights import GGUF, component_for_file, convert_file, is_single_file

    started = time.perf_counter()
    progress = progress or Progress()
    limit = parse_size(max_shard_size)
    if 0 < limit < min_shard_size:
        raise UsageError(f"--max-shard-size {max_shard_size} is below the {format_size(min_shard_size)} minimum: use 0 "
                         "for one file, or a size such as 500MB or 5GB.")
    if dtype is not None and dtype.strip().lower() in FP8_NAMES:
        raise UsageError("--to-diffusers writes bf16, fp16 or fp32 weights; fp8 storage is dmap shard --dtype fp8 of "
                         "the folder it writes.")
    target = parse_dtype(dtype) if dtype is not None else None
    path = Path(file_spec).expanduser()
    if not path.exists():
        raise UsageError(f"{file_spec} does not exist: --to-diffusers converts one single file (.safetensors or .gguf).")
    if not is_single_file(file_spec):
        raise UsageError(f"--to-diffusers converts one single file (an original-layout .safetensors or a .gguf); "
                         f"{file_spec} is not one.")
    comp, where = component_for_file(path, pipeline)  # the file's header checked against the component's config
    out_path = Path(output).expanduser().resolve() if output is not None else path.resolve().parent / (
        f"{path.name.rsplit('.', 1)[0]}-diffusers")
    _check_output_parent(out_path)
    if out_path == path.resolve() or is_inside(path.resolve(), out_path):
        raise UsageError(f"The output {out_path} is the source file or holds it: choose another --output.")
    refuse_existing([out_path], overwrite)
    if out_path.exists() and not out_path.is_dir():
        raise UsageError(f"The output {out_path} exists and is not a folder.")

    converted = convert_file(path, comp)
    if converted.format == GGUF and target is None:
        target = "bfloat16"
    planned, in_memory, changed = _converted_tensors(converted, target)
    _check_converted(converted, planned)
    stem = "diffusion_pytorch_model"
    shards, index_name = plan_shards(planned, limit, stem, None, {})
    plan = ComponentPlan(comp.name, "diffusers", comp.cls, path.parent, [path], "", stem, None, shards, index_name, {},
                         {}, changed)
    result = ShardResult(file_spec, "to-diffusers", out_path, limit, target, None, dry_run, False, [plan])
    result.notes = _to_diffusers_notes(converted, planned, comp, where, target)
    if not dry_run:
        config = json.dumps(dict(sorted(comp.config.items())), indent=2) + "\n"
        _write_result(result, [], {path: in_memory}, {"config.json": config.encode("utf-8")}, progress, verify,
                      overwrite)
    result.seconds = time.perf_counter() - started
    return result


def _converted_tensors(converted, target: str | None) -> tuple[list[PlannedTensor], dict, int]:
    """(the writer's tensors, those it reads from memory by name, how many change dtype or are dequantized): a
    contiguous view of the file is a byte range (copied, or converted after a bounded read), a quantized tensor a
    range read and dequantized when written, what the mapping computed (a concatenation) a tensor in memory."""
    path = converted.path
    in_memory = _Dequantized()
    planned: list[PlannedTensor] = []
    changed = 0
    for name, tensor in converted.tensors.items():
        quantized = getattr(tensor, "quant_type", None) is not None
        stored = "float32" if quantized else str(tensor.dtype).removeprefix("torch.")
        shape = _logical_shape(tensor) if quantized else tuple(tensor.shape)
        span = converted.file_range(tensor.as_tensor() if quantized else tensor)
        if span is not None and not quantized:
            source = SourceTensor(name, stored, shape, path, span[0], span[1])
        else:  # quantized, or computed by the mapping (a concatenation): one tensor at a time, in memory
            in_memory[name] = tensor if span is None else _QuantizedRange(path, *span, tuple(tensor.shape),
                                                                          int(tensor.quant_type))
            source = SourceTensor(name, stored, shape, path, legacy=True)
        out = stored
        if converted.kept_in_fp32(name) and (quantized or stored in CONVERTIBLE):
            out = "float32" if quantized else stored
        elif target is not None and (quantized or stored in CONVERTIBLE):
            out = target
        changed += quantized or out != stored
        planned.append(PlannedTensor(source, out))
    return planned, in_memory, changed


def _to_diffusers_notes(converted, planned: list[PlannedTensor], comp, where: str, target: str | None) -> list[str]:
    notes = [f"config.json: the {comp.cls} config of '{comp.name}' from {where}."]
    quantized = sum(getattr(t, "quant_type", None) is not None for t in converted.tensors.values())
    kept = sum(converted.kept_in_fp32(t.name) for t in planned)
    if quantized:
        notes.append(f"{quantized} GGUF tensor(s) dequantized (diffusers' dequantize_gguf_tensor) to {target}"
                     + (f"; {kept} tensor(s) of _keep_in_fp32_modules in float32 (or as stored)." if kept else "."))
    elif kept and target not in (None, "float32"):
        notes.append(f"{kept} tensor(s) of _keep_in_fp32_modules keep their dtype.")
    return notes


def _logical_shape(tensor) -> tuple[int, ...]:
    """A GGUFParameter's weight shape (its data is rows x bytes of blocks)."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.quant_type)]
    *rows, row_bytes = tensor.shape
    return (*rows, row_bytes // type_size * block)


def _check_converted(converted, planned: list[PlannedTensor]) -> None:
    """What the mapping gave from the data is what it gave from the header (names and shapes the config builds)."""
    from dm_cli.model.skeleton import load_skeleton

    comp = converted.comp
    built = {t.name: tuple(t.shape) for t in load_skeleton(comp.name, comp.library, comp.cls, comp.config).tensors
             if t.kind != "buffer_np"}
    got = {t.name: tuple(t.shape) for t in planned}
    if got != built:
        wrong = sorted(set(got) ^ set(built)) or sorted(n for n in got if got[n] != built[n])
        raise SourceError(f"{converted.path.name} converts to tensors its config does not build (first: {wrong[0]}).")


def _write_result(result: ShardResult, copies: list[tuple[Path, str]], legacy: dict, small: dict[str, bytes],
                  progress: Progress, verify: bool, overwrite: bool) -> None:
    """Write every planned shard (and the copies, and `small` files: relative path -> bytes) into a hidden temporary
    folder, verify it, then rename it into place or swap it in (`--in-place`)."""
    out_path = result.output
    parent = out_path.parent
    result.removed_stale += recover(out_path, overwrite or result.in_place)
    copy_bytes = sum(p.stat().st_size for p, _ in copies)
    copy_bytes += sum(len(data) for data in small.values())
    needed = sum(s.file_bytes for c in result.components for s in c.shards) + copy_bytes
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise DmapError(f"Not enough disk space in {parent}: the new files need {format_size(needed)} and "
                        f"{format_size(free)} is free.")

    temp = hidden_name(out_path, TEMP_MARK)
    temp.mkdir()
    try:
        progress.phase("write", needed)
        _copy_files(copies, temp, progress)
        for rel, data in small.items():  # files written here, not copied (--to-diffusers: config.json)
            _write_small(temp / rel, data)
            progress.advance(len(data))
        finisher = _ShardFinisher(verify, progress)
        try:
            for comp in result.components:
                folder = temp / comp.folder
                folder.mkdir(parents=True, exist_ok=True)
                for shard_file in comp.shards:
                    _write_shard(folder / shard_file.name, shard_file, legacy, progress, finisher)
                index = comp.index_bytes()
                if index is not None:
                    _write_small(folder / comp.index_name, index)
                    if verify:
                        verify_index(folder, comp)
                result.bytes_written += sum(s.file_bytes for s in comp.shards) + len(index or b"")
            if verify:  # what the compare threads have not caught up with yet
                finisher.report_rest_as("verify", result.total_size)
        except BaseException:
            finisher.wait(raise_errors=False)
            raise
        finisher.wait()
        result.bytes_written += copy_bytes
        _fsync_tree(temp)
        result.verified = verify
        if result.in_place:
            swap_in_place(temp, out_path, _swap_folders(temp, result))
        else:
            publish(temp, out_path, overwrite)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)  # gone already once the swap is committed
        if isinstance(error, OSError):
            raise _os_error(error, out_path) from error
        raise


def _finish_interrupted_swaps(source_spec: str) -> list[str]:
    """`--in-place` of the source a killed `--in-place` run left mid-swap finishes that swap first."""
    path = Path(source_spec).expanduser()
    if not path.exists():
        return []
    return finish_swaps(path.resolve() if path.is_dir() else path.resolve().parent)


def _os_error(error: OSError, out_path: Path) -> DmapError:
    if error.errno == errno.ENOSPC:
        return DmapError(f"The disk filled up while writing {out_path}; nothing was left there and the source is unchanged.")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DmapError(f"Cannot write {out_path}: {error.strerror}; nothing was left there.")
    return DmapError(f"Writing {out_path} failed ({error.strerror or error}); nothing was left there and the source is unchanged.")


# --- writing --------------------------------------------------------------------------------------


def _copy_files(copies: list[tuple[Path, str]], temp: Path, progress: Progress) -> None:
    for path, rel in copies:
        target = temp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        shutil.copymode(path, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        progress.advance(target.stat().st_size)


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


_kernel_copy = hasattr(os, "copy_file_range")


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int, buffer: memoryview | None,
                progress: Progress, verify_at: int | None = None) -> int | None:
    """Copy `count` bytes at `offset` to the current end of dst: in the kernel when possible, else through
    `buffer` (made here, as small as this copy allows, when None: the kernel copy needs none).

    With `verify_at` (where the copy lands in dst), each piece is read back and compared with the
    source as it is written (`_copy_verified`); returns where in the range a difference is, if any."""
    if verify_at is not None:
        return _copy_verified(src_fd, dst_fd, offset, count, verify_at, progress)
    global _kernel_copy
    done = 0
    while done < count:
        want = min(COPY_CHUNK, count - done)
        got = None
        if _kernel_copy:
            try:
                got = os.copy_file_range(src_fd, dst_fd, want, offset + done)
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                    raise
                _kernel_copy = False
        if got is None:
            got = 0
            if buffer is None:
                buffer = memoryview(bytearray(min(BUFFER_BYTES, count)))
            while got < want:
                n = os.preadv(src_fd, [buffer[: min(len(buffer), want - got)]], offset + done + got)
                if n == 0:
                    break
                _write_all(dst_fd, buffer[:n])
                got += n
                progress.advance(n)
            if got == 0:
                raise CheckpointError("A source file ended before its header says it should: it changed while dmap read it.")
            done += got
            continue
        if got == 0:
            raise CheckpointError("A source file ended before its header says it should: it changed while dmap read it.")
        done += got
        progress.advance(got)


_verify_buffers = threading.local()  # one set per writing thread, reused


def _read_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill `view` from `offset` of `fd`; False when the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            return False
        got += n
    return True


def _copy_verified(src_fd: int, dst_fd: int, offset: int, count: int, dst_at: int, progress: Progress) -> int | None:
    """Copy `count` bytes at `offset` of src to the end of dst (at `dst_at`), `VERIFY_WINDOW` bytes at a time,
    each piece read back from dst and compared with the source read again; where in the range the first
    difference is, else None.

    The pieces stay in the CPU's cache from the read to the compare, so copying and verifying this way
    costs ~0.4 s of CPU per GB here, against ~0.5 s for the kernel's copy plus a compare of the two files
    afterwards (which reads both back from memory), and one thread does it all: on a busy machine the
    CPU, not the disk, is what a verified reshard waits for (issue 31). The compare is with a second read
    of the source, not with the buffer that was written, so the file is checked against the source itself.
    """
    buffers = getattr(_verify_buffers, "buffers", None)
    if buffers is None or len(buffers[0]) != VERIFY_WINDOW:
        buffers = _verify_buffers.buffers = (bytearray(VERIFY_WINDOW), bytearray(VERIFY_WINDOW), bytearray(VERIFY_WINDOW))
    data, written, source = (memoryview(b) for b in buffers)
    done = 0
    while done < count:
        n = min(VERIFY_WINDOW, count - done)
        if not _read_into(src_fd, data[:n], offset + done):
            raise CheckpointError("A source file ended before its header says it should: it changed while dmap read it.")
        _write_all(dst_fd, data[:n])
        if not _read_into(dst_fd, written[:n], dst_at + done) or not _read_into(src_fd, source[:n], offset + done):
            return done
        if (buffers[1] != buffers[2]) if n == VERIFY_WINDOW else (buffers[1][:n] != source[:n]):  # one memcmp
            return done
        progress.advance(n)
        done += n
    return None


def _tensor_bytes(t: PlannedTensor, legacy: dict[Path, dict]):
    """The output bytes of a tensor that is converted or comes from a legacy file (one tensor in RAM)."""
    import torch

    if t.source.legacy:
        tensor = legacy[t.source.file][t.name]
    else:
        with open(t.source.file, "rb") as handle:
            handle.seek(t.source.begin)
            raw = bytearray(handle.read(t.source.end - t.source.begin))
        if len(raw) != t.source.end - t.source.begin:
            raise CheckpointError(f"{t.source.file} ended before tensor '{t.name}': it changed while dmap read it.")
        tensor = torch.frombuffer(raw, dtype=getattr(torch, t.source.dtype)) if raw else torch.empty(
            0, dtype=getattr(torch, t.source.dtype))
        tensor = tensor.reshape(t.shape)
    tensor = tensor.to(getattr(torch, t.dtype)).contiguous()
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().data


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ShardFinisher:
    """Fsyncs and verifies in the background while the main thread copies the next tensors.

    One thread fsyncs each finished shard, so disk flushes overlap copying. Byte copies are verified
    by the writer itself as they are written (`_copy_verified`); with verification, `VERIFY_THREADS`
    threads hash each converted tensor back as soon as it is written, while it is still in the page
    cache (file reads and sha256 release the GIL, so they run beside the writing). The first failure
    stops the writing (`raise_if_failed`).
    """

    def __init__(self, verify: bool, progress: Progress):
        self.verify = verify
        self.expected: dict[tuple[Path, str], bytes] = {}  # sha256 of converted tensors, as written
        self._progress = progress
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmap-fsync")
        self._checker = ThreadPoolExecutor(max_workers=VERIFY_THREADS, thread_name_prefix="dmap-verify") if verify else None
        self._futures = []  # fsync jobs (one per shard)
        self._checks = []  # verification jobs still running
        self._batch: list[tuple[Path, int, list[PlannedTensor]]] = []
        self._batch_bytes = 0
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._checked = 0  # bytes verified so far
        self._reporting = False  # whether verified bytes go to the progress bar yet

    def verified(self, nbytes: int) -> None:
        """Bytes the writer verified itself (byte copies, compared as they are written)."""
        with self._lock:
            self._checked += nbytes

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def check_run(self, path: Path, begin: int, run: list[PlannedTensor]) -> None:
        """Queue the comparison of tensors just written back to back at `begin` in `path`.

        Runs are batched (`VERIFY_BATCH_BYTES`, `VERIFY_BATCH_RUNS`) so that a million tiny tensors
        make a few hundred jobs, not a million futures."""
        self.raise_if_failed()
        if self._checker is None:
            return
        self._batch.append((path, begin, run))
        self._batch_bytes += sum(t.nbytes for t in run)
        if self._batch_bytes >= VERIFY_BATCH_BYTES or len(self._batch) >= VERIFY_BATCH_RUNS:
            self.flush()

    def flush(self) -> None:
        """Submit the pending batch (at the end of each shard, and when it is full)."""
        if self._checker is None or not self._batch:
            return
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._checks = [f for f in self._checks if not f.done()]  # failures are kept in `_failure`
        self._checks.append(self._checker.submit(self._check, batch))

    def _check(self, batch: list[tuple[Path, int, list[PlannedTensor]]]) -> None:
        for path, begin, run in batch:
            if self._failure is not None:
                return
            try:
                _check_run(path, begin, run, self.expected)
            except BaseException as error:
                self._failure = self._failure or error
                raise
            nbytes = sum(t.nbytes for t in run)
            with self._lock:
                self._checked += nbytes
                reporting = self._reporting
            if reporting:
                self._progress.advance(nbytes)

    def shard_written(self, fd: int, path: Path, shard_file: ShardFile) -> None:
        """Check the header that was written (cheap, here), then fsync and close `fd` in the background."""
        self.flush()
        try:
            if self.verify:
                _check_header(path, shard_file)
        except BaseException:
            os.close(fd)
            raise
        self._futures.append(self._syncer.submit(_fsync_and_close, fd))

    def report_rest_as(self, phase: str, total_bytes: int) -> None:
        """Writing is done: show the verification still running as its own progress phase."""
        with self._lock:
            if total_bytes > self._checked:  # byte copies were verified while written: often nothing is left
                self._progress.phase(phase, total_bytes - self._checked)
            self._reporting = True

    def wait(self, raise_errors: bool = True) -> None:
        """Every file is durable and verified (or the first error raised) when this returns."""
        if self._checker is not None:
            if raise_errors:
                self.flush()
            self._checker.shutdown(cancel_futures=not raise_errors)
        self._syncer.shutdown()  # never cancelled: each fsync job also closes its file
        jobs = self._futures + self._checks
        errors = [f.exception() for f in jobs if not f.cancelled() and f.exception() is not None]
        self._futures.clear()
        self._checks.clear()
        if raise_errors:
            self.raise_if_failed()
            if errors:
                raise errors[0]


def _runs(tensors: list[PlannedTensor]) -> list[list[PlannedTensor]]:
    """Consecutive byte copies that are also consecutive in the same source file: one copy and one
    comparison each, instead of one system call and one job per (possibly tiny) tensor."""
    runs: list[list[PlannedTensor]] = []
    for t in tensors:
        last = runs[-1][-1] if runs else None
        if (last is not None and t.byte_copy and last.byte_copy and t.source.file == last.source.file
                and t.source.begin == last.source.end):
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def _write_shard(path: Path, shard_file: ShardFile, legacy: dict[Path, dict], progress: Progress,
                 finisher: _ShardFinisher) -> None:
    buffer = None  # only copies that cannot stay in the kernel need one (8 MB of RSS and page faults)
    sources: dict[Path, int] = {}
    # verified byte copies are read back as they are written: the file is opened for reading too
    fd = os.open(path, (os.O_RDWR if finisher.verify else os.O_WRONLY) | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, shard_file.header)
        at = len(shard_file.header)
        for run in _runs(shard_file.tensors):
            finisher.raise_if_failed()
            first = run[0]
            count = sum(t.nbytes for t in run)
            if first.byte_copy:
                src = sources.get(first.source.file)
                if src is None:
                    src = sources[first.source.file] = os.open(first.source.file, os.O_RDONLY)
                if finisher.verify:
                    wrong = _copy_range(src, fd, first.source.begin, count, None, progress, verify_at=at)
                    if wrong is not None:
                        raise CheckpointError(f"Verification failed: tensor '{_tensor_at(run, wrong).name}' in "
                                              f"{path.name} differs from the source.")
                    finisher.verified(count)
                else:
                    if buffer is None and not _kernel_copy:
                        buffer = memoryview(bytearray(BUFFER_BYTES))
                    _copy_range(src, fd, first.source.begin, count, buffer, progress)
            else:
                data = _tensor_bytes(first, legacy)
                if len(data) != first.nbytes:
                    raise CheckpointError(f"Tensor '{first.name}' converted to {len(data)} bytes, expected {first.nbytes}.")
                if finisher.verify:
                    finisher.expected[(path, first.name)] = hashlib.sha256(data).digest()
                _write_all(fd, data)
                progress.advance(first.nbytes)
                finisher.check_run(path, at, run)
            at += count
    except BaseException:
        os.close(fd)
        raise
    finally:
        for src in sources.values():
            os.close(src)
    finisher.shard_written(fd, path, shard_file)


def _tensor_at(run: list[PlannedTensor], offset: int) -> PlannedTensor:
    """The tensor of a run (tensors back to back) that holds byte `offset` of it."""
    for t in run:
        if offset < t.nbytes:
            return t
        offset -= t.nbytes
    return run[-1]


def _fsync_tree(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fsync_dir(Path(folder))


def _swap_folders(temp: Path, result: ShardResult) -> list[SwapFolder]:
    """What `--in-place` replaces: per component folder, the old weight files and the new ones."""
    return [SwapFolder(comp.source_folder.resolve(), comp.folder, [p.name for p in comp.source_files],
                       comp.output_files()) for comp in result.components]


# --- verification ---------------------------------------------------------------------------------


def _hash_range(path: Path, begin: int, count: int) -> bytes:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(min(HASH_CHUNK, max(count, 1))))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < count:
            n = os.preadv(fd, [buffer[: min(len(buffer), count - done)]], begin + done)
            if n == 0:
                raise CheckpointError(f"{path} ended before its header says it should while verifying.")
            digest.update(buffer[:n])
            done += n
    finally:
        os.close(fd)
    return digest.digest()


def _check_run(path: Path, begin: int, run: list[PlannedTensor], expected: dict) -> None:
    """Compare a converted tensor, read back from `path`, with the sha256 of the bytes written (byte copies
    are compared with their source while they are written: `_copy_verified`)."""
    t = run[0]
    if _hash_range(path, begin, t.nbytes) != expected[(path, t.name)]:
        raise CheckpointError(f"Verification failed: tensor '{t.name}' in {path.name} differs from the source.")


def _check_header(path: Path, shard_file: ShardFile) -> None:
    """The shard's header, parsed back, names the planned tensors with their dtype, shape and place."""
    header = read_safetensors_header(path)
    if set(header.tensors) != {t.name for t in shard_file.tensors}:
        raise CheckpointError(f"Verification failed: {shard_file.name} does not hold the planned tensors.")
    for t in shard_file.tensors:
        entry = header.tensors[t.name]
        if (entry.dtype != t.dtype or entry.shape != t.shape or entry.nbytes != t.nbytes
                or entry.begin != len(shard_file.header) + t.offset):
            raise CheckpointError(f"Verification failed: tensor '{t.name}' in {shard_file.name} has the wrong dtype or shape.")


def verify_index(folder: Path, comp: ComponentPlan) -> None:
    """The index written maps exactly the tensors written to their shards."""
    written_index = json.loads((folder / comp.index_name).read_text(encoding="utf-8"))
    want = {t.name: s.name for s in comp.shards for t in s.tensors}
    if written_index.get("weight_map") != want:
        raise CheckpointError(f"Verification failed: {comp.index_name} does not list the tensors written.")

"""The layout `dmap shard` writes: which tensors go into which shard file, under which names, with which header.

Pure: no file is read or written here. Names follow diffusers/transformers (`shard_file_names`), tensors are
packed greedily in natural name order (`plan_shards`), and headers are built byte for byte by us
(`build_header`), so the same input always gives the same bytes.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _encode_json_string
from pathlib import Path

from dm_cli.units import DTYPE_BYTES, TORCH_TO_SAFETENSORS, numel

CONVERTIBLE = {"float64", "float32", "float16", "bfloat16"}  # fp8 and integer tensors keep their dtype


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

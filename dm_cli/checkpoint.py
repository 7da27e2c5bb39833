"""Safetensors headers and index files, read without touching tensor data.

We parse the header ourselves (8-byte length + JSON, see the safetensors spec) rather than
through `safe_open` because we must *validate* it — offsets past the end, overlaps, gaps — and
name the broken file and tensor, and because this path must not import torch.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointError
from .units import DTYPE_BYTES, SAFETENSORS_DTYPES, numel

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_LISTED_PROBLEMS = 20  # in one error sentence; `dmap inspect` lists every problem


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it; offsets are absolute in the file."""

    name: str
    dtype: str  # torch spelling, e.g. "bfloat16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class SafetensorsHeader:
    path: Path
    header_size: int  # JSON bytes, excluding the 8-byte length
    tensors: dict[str, TensorEntry]  # in file (offset) order
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_safetensors_header(path: str | os.PathLike, validate: bool = True) -> SafetensorsHeader:
    """Read and check one file's header; reads 8 + header bytes and nothing else."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: file is truncated: shorter than a safetensors header ({len(prefix)} bytes).")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES or header_size + 8 > file_size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header: it claims {header_size} header bytes "
                    f"but the file has {file_size}."
                )
            raw = handle.read(header_size)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}.") from error
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path}: corrupt safetensors header: its JSON cannot be parsed ({error}).") from error
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_size
    tensors: list[TensorEntry] = []
    for name, info in header.items():
        try:
            dtype_code = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'.") from error
        dtype = SAFETENSORS_DTYPES.get(dtype_code)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype '{dtype_code}'.")
        tensors.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    if validate:
        problems = layout_problems(tensors, data_start, file_size)
        if problems:
            tensor, message = problems[0]
            more = f" (and {len(problems) - 1} more problem(s) in this file)" if len(problems) > 1 else ""
            raise CheckpointError(f"{path}: tensor '{tensor}' {message}{more}.")
    return SafetensorsHeader(path, header_size, {t.name: t for t in tensors}, dict(metadata))


def layout_problems(tensors: list[TensorEntry], data_start: int, file_size: int) -> list[tuple[str, str]]:
    """Every (tensor, problem) of a header's layout: bad offsets, past the end, overlaps, wrong byte counts."""
    problems: list[tuple[str, str]] = []
    previous_end = data_start
    previous_name = None
    for tensor in tensors:
        if tensor.begin < data_start or tensor.end < tensor.begin:
            problems.append((tensor.name, "has invalid data offsets"))
            continue
        if tensor.end > file_size:
            problems.append((tensor.name, f"ends at byte {tensor.end} but the file has {file_size}: truncated or corrupt"))
        if tensor.begin < previous_end:
            problems.append((tensor.name, f"overlaps tensor '{previous_name}'"))
        expected = tensor.numel * DTYPE_BYTES[tensor.dtype]
        if tensor.nbytes != expected:
            problems.append((tensor.name, f"holds {tensor.nbytes} bytes but {tensor.dtype}{list(tensor.shape)} needs {expected}"))
        if tensor.end > previous_end:
            previous_end, previous_name = tensor.end, tensor.name
    return problems


# --- index files -------------------------------------------------------------------------------


@dataclass
class ShardIndex:
    path: Path
    total_size: int | None
    weight_map: dict[str, str]  # tensor name -> shard basename
    metadata: dict

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def read_index(path: str | os.PathLike) -> ShardIndex:
    """Parse an `*.index.json`; refuses shard names that are paths (the loaders do too)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}.") from error
    except ValueError as error:
        raise CheckpointError(f"{path}: malformed index JSON ({error}).") from error
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{path}: not a shard index: it has no 'weight_map'.")
    for name, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not is_plain_file_name(shard):
            raise CheckpointError(f"{path}: tensor '{name}' names shard '{shard}', which is a path, not a file name in the folder.")
    metadata = data.get("metadata") or {}
    total = metadata.get("total_size")
    return ShardIndex(path, int(total) if total is not None else None, dict(data["weight_map"]), metadata)


def is_plain_file_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and ".." not in name.split("/")


@dataclass
class CheckpointProblem:
    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}" + (f" [{self.tensor}]" if self.tensor else "")
        return f"{where}: {self.message}"


@dataclass
class Checkpoint:
    """A component's weights: one file, or shards plus an index. Tensors are not loaded."""

    files: list[Path]
    index: ShardIndex | None
    headers: dict[str, SafetensorsHeader]  # shard basename -> header
    tensors: dict[str, TensorEntry]  # tensor name -> entry (first occurrence)
    tensor_files: dict[str, str]  # tensor name -> shard basename
    problems: list[CheckpointProblem]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def open_checkpoint(path: str | os.PathLike, strict: bool = True) -> Checkpoint:
    """Read every header of a `.safetensors` file or an index's shards, and cross-check them.

    Every problem is collected (missing or unreadable shards, truncated or overlapping tensors,
    index/shard disagreements); with strict=True any problem raises, listing them all. A single
    file whose header cannot be read, or an unreadable index, raises: there is nothing to inspect.
    """
    path = Path(path)
    problems: list[CheckpointProblem] = []
    if path.name.endswith(".index.json") or (path.suffix == ".json" and "index" in path.name):
        index = read_index(path)
        folder = path.parent
        headers: dict[str, SafetensorsHeader] = {}
        for shard in index.shard_names:
            shard_path = folder / shard
            if not shard_path.is_file():
                listed = sum(1 for s in index.weight_map.values() if s == shard)
                problems.append(CheckpointProblem(shard, None, f"does not exist, and the index lists {listed} tensor(s) in it"))
                continue
            try:
                header = read_safetensors_header(shard_path, validate=False)
            except CheckpointError as error:
                problems.append(CheckpointProblem(shard, None, str(error).replace(f"{shard_path}: ", "", 1).rstrip(".")))
                continue
            headers[shard] = header
            file_size = shard_path.stat().st_size
            problems += [CheckpointProblem(shard, tensor, message)
                         for tensor, message in layout_problems(list(header.tensors.values()), header.data_start, file_size)]
        tensors: dict[str, TensorEntry] = {}
        tensor_files: dict[str, str] = {}
        for name, shard in index.weight_map.items():
            if shard not in headers:
                continue  # the shard's own problem is listed once
            entry = headers[shard].tensors.get(name)
            if entry is None:
                problems.append(CheckpointProblem(shard, name, "listed in the index but missing from the shard"))
                continue
            tensors[name] = entry
            tensor_files[name] = shard
        for shard, header in headers.items():
            for name in header.tensors:
                owner = index.weight_map.get(name)
                if owner is None:
                    problems.append(CheckpointProblem(shard, name, "in the shard but not listed in the index"))
                elif owner != shard:
                    problems.append(CheckpointProblem(shard, name, f"also stored in this shard; the index says {owner}"))
        if index.total_size is not None and len(headers) == len(index.shard_names):
            actual = sum(t.nbytes for t in tensors.values())
            if actual != index.total_size:
                problems.append(
                    CheckpointProblem(path.name, None, f"metadata.total_size is {index.total_size} but the shards hold {actual} tensor bytes")
                )
        files = [folder / s for s in index.shard_names if s in headers]
    else:
        header = read_safetensors_header(path, validate=False)
        problems += [CheckpointProblem(path.name, tensor, message)
                     for tensor, message in layout_problems(list(header.tensors.values()), header.data_start,
                                                            path.stat().st_size)]
        index = None
        headers = {path.name: header}
        tensors = dict(header.tensors)
        tensor_files = {name: path.name for name in tensors}
        files = [path]
    if strict and problems:
        listed = "; ".join(str(p) for p in problems[:MAX_LISTED_PROBLEMS])
        more = f"; and {len(problems) - MAX_LISTED_PROBLEMS} more" if len(problems) > MAX_LISTED_PROBLEMS else ""
        raise CheckpointError(f"{len(problems)} checkpoint problem(s) in {path}: {listed}{more}. "
                              f"dmap inspect {path.parent} lists them all.")
    return Checkpoint(files, index, headers, tensors, tensor_files, problems)


# --- finding weights in a component folder ------------------------------------------------------

WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
_SHARD_RE = re.compile(r"^(?P<stem>.+?)(?:\.(?P<variant>[\w]+))?-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")


def find_component_weights(folder: Path, variant: str | None = None) -> Path | None:
    """The index JSON or single `.safetensors` file a loader would pick in `folder`, or None."""
    for stem in WEIGHT_STEMS:
        if variant:
            candidates = [folder / f"{stem}.safetensors.index.{variant}.json", folder / f"{stem}.{variant}.safetensors"]
        else:
            candidates = [folder / f"{stem}.safetensors.index.json", folder / f"{stem}.safetensors"]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
    return None


def legacy_weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt") and p.is_file())

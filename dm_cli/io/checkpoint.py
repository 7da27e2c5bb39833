"""Safetensors headers and index files, read without touching tensor data; and legacy `.bin` weights.

We parse the header ourselves (8-byte length + JSON, see the safetensors spec) rather than
through `safe_open` because we must *validate* it — offsets past the end, overlaps, gaps — and
name the broken file and tensor, and because this path must not import torch. Only the legacy
readers at the end (`load_legacy_weights`) import torch, when they are called.
"""

from __future__ import annotations

import json
import math
import operator
import os
import pickle
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dm_cli.errors import CheckpointError, SourceError
from dm_cli.units import (
    DTYPE_BYTES,
    MAX_SIZE_BYTES,
    MAX_SIZE_TEXT,
    SAFETENSORS_DTYPES,
    SUBBYTE_DTYPES,
    TORCH_TO_SAFETENSORS,
    numel,
    shorten,
)

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_JSON_DEPTH = 127  # serde_json's recursion limit, as safetensors meets it (root object = 1)
U64_MAX = 2**64 - 1
MAX_INDEX_BYTES = 100_000_000  # an index JSON larger than a safetensors header is not an index
MAX_CONFIG_BYTES = 64 << 20  # configs, model_index.json, plans, journals: a few KB to a few MB
_BITS = {code: DTYPE_BYTES[name] * 8 for code, name in SAFETENSORS_DTYPES.items()} | SUBBYTE_DTYPES
_FIELDS = ("dtype", "shape", "data_offsets")
_DTYPE_NAMES = {**SAFETENSORS_DTYPES, **{code: code for code in SUBBYTE_DTYPES}}  # header code -> dmap's name
_NAME_BITS = {_DTYPE_NAMES[code]: bits for code, bits in _BITS.items()}
_MINUS_ZERO = re.compile(r"-0(?![0-9.eE])")  # `-0` parses as 0 in Python but is a float to serde_json
LEGACY_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # PyTorch pickles: read with weights_only
MAX_LISTED_PROBLEMS = 20  # in one error sentence; `dmap inspect` lists every problem


class TensorEntry(NamedTuple):
    """One tensor as a safetensors header describes it; offsets are absolute in the file.

    A named tuple, not a dataclass: a header may hold a million of them."""

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


def open_regular(path: Path, what: str, limit: int | None = None):
    """Open a file dmap reads as input: a regular file (never a FIFO or a device), at most `limit` bytes."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path}: {what} is not a regular file.")
        if limit is not None and info.st_size > limit:
            raise CheckpointError(f"{path}: {what} is {info.st_size} bytes, more than the {limit} a {what} may have.")
        return open(path, "rb"), info.st_size
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}.") from error


class _Negative(int):
    """A JSON integer written with a minus sign: never a usize for safetensors, not even `-0`."""


def _parse_int(text: str) -> int:
    return _Negative(int(text)) if text[0] == "-" else int(text)


def no_json_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def read_json_object(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> dict:
    """A JSON object dmap reads from a file it did not write (or that may be damaged): a regular file of at
    most `limit` bytes, strict JSON (no NaN), no nesting deep enough to exhaust Python's recursion.
    Anything else is a CheckpointError naming the file; callers turn it into their own error."""
    handle, _ = open_regular(path, what, limit)  # never a FIFO, /dev/zero or a huge file
    try:
        with handle:
            raw = handle.read(limit + 1)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}.") from error
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=no_json_constant)
    except RecursionError:
        raise CheckpointError(f"{path}: {what} is malformed JSON (nested too deeply).") from None
    except ValueError as error:  # UnicodeDecodeError included
        raise CheckpointError(f"{path}: {what} is malformed JSON ({error}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, found {type(data).__name__}.")
    return data


class _Info(tuple):
    """A tensor entry that passed the type checks: (dtype code, shape, begin, end)."""


class _Object(list):
    """Any other JSON object, as its (key, value) pairs (duplicates kept, for the checks)."""


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX  # bool and _Negative are not `int` exactly


_INT_ONLY = {int}


def _object_hook(pairs):
    """Called for every JSON object, innermost first: tensor entries in the usual field order become
    compact tuples at once (a million-tensor header never holds a million dicts); anything else is
    kept as pairs for the slow path. Only C-level calls on the fast path: it runs once per tensor."""
    if len(pairs) == 3:
        (k1, dtype), (k2, shape), (k3, offsets) = pairs
        if k1 == "dtype" and k2 == "shape" and k3 == "data_offsets" and type(dtype) is str and dtype in _BITS \
                and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            begin, end = offsets
            if type(begin) is int and type(end) is int and 0 <= begin <= U64_MAX and 0 <= end <= U64_MAX and (
                    not shape or (set(map(type, shape)) <= _INT_ONLY and min(shape) >= 0 and max(shape) <= U64_MAX)):
                return _Info((_DTYPE_NAMES[dtype], tuple(shape), begin, end))
    return _Object(pairs)


def _depth(value) -> int:
    """JSON nesting depth of a parsed value (scalars 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, tuple)) and not isinstance(item, _Info):
            level += 1
            deepest = max(deepest, level)
            children = [v for _, v in item] if isinstance(item, _Object) else item
            stack.extend((child, level) for child in children)
    return deepest


def _encodable(text: str) -> bool:
    """No lone surrogate (`"\\ud800"` parses in Python, never in serde_json)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _entry_problem(pairs) -> str:
    """Why a tensor entry that missed the fast path is not one safetensors accepts ("" if it is:
    fields in another order, or extra fields, which safetensors ignores within serde_json's depth)."""
    if not isinstance(pairs, _Object):
        return f"is {'null' if pairs is None else type(pairs).__name__}, not an object with dtype, shape and data_offsets"
    values: dict = {}
    for key, value in pairs:
        if key in _FIELDS and key in values:
            return f"has the field '{key}' twice"
        values[key] = value
    for key in _FIELDS:
        if key not in values:
            return f"has no '{key}'"
    extra = [v for k, v in pairs if k not in _FIELDS]
    if any(_depth(v) + 2 > MAX_JSON_DEPTH for v in extra):
        return f"nests JSON deeper than {MAX_JSON_DEPTH} levels"
    dtype, shape, offsets = values["dtype"], values["shape"], values["data_offsets"]
    if type(dtype) is not str or dtype not in _BITS:
        return f"has unknown dtype {dtype!r}"
    if type(shape) is not list or not all(_is_u64(d) for d in shape):
        return f"has shape {_show(shape)}: it must be a list of integers from 0 to 2^64-1"
    if type(offsets) is not list or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        return f"has data_offsets {_show(offsets)}: they must be two integers from 0 to 2^64-1"
    return ""


def _show(value) -> str:
    if isinstance(value, _Object):
        return "an object"
    text = json.dumps(value) if not isinstance(value, float) or value == value else "NaN"
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_bytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor as safetensors computes them (u64 arithmetic): None on overflow or a
    sub-byte tensor that does not end on a byte boundary."""
    count = 1
    for dim in shape:
        count *= dim
        if count > U64_MAX:
            return None
    bits = count * _NAME_BITS[dtype]
    if bits > U64_MAX or bits % 8:
        return None
    return bits // 8


def read_safetensors_header(path: str | os.PathLike, validate: bool = True) -> SafetensorsHeader:
    """Read and check one file's header exactly as strictly as the safetensors library does.

    Reads 8 + header bytes and nothing else. Everything `safetensors.safe_open` refuses is refused
    here with one sentence naming the file and tensor: bad JSON (NaN, floats, negative or huge
    integers, duplicate fields, lone surrogates, nesting deeper than serde_json allows), unknown
    dtypes, offsets that leave gaps, overlap or run past the end, a shape whose byte size
    overflows 64 bits or disagrees with its offsets, trailing bytes after the last tensor.
    With validate=False the layout is not checked here: `layout_problems` lists every problem.
    """
    path = Path(path)
    handle, file_size = open_regular(path, "safetensors file")
    try:
        with handle:
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
    if len(raw) != header_size:
        raise CheckpointError(f"{path}: the file changed while dmap read its header.")
    try:
        text = raw.decode("utf-8")
        del raw
        # A Python hook per integer is slow on a million tensors: only when `-0` may be there
        root = json.loads(text, object_pairs_hook=_object_hook, parse_constant=no_json_constant,
                          parse_int=_parse_int if _MINUS_ZERO.search(text) else None)
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: corrupt safetensors header: it is not UTF-8 ({error.reason}).") from error
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt safetensors header: its JSON nests deeper than "
                              f"{MAX_JSON_DEPTH} levels.") from None
    except ValueError as error:
        raise CheckpointError(f"{path}: corrupt safetensors header: its JSON cannot be parsed ({error}).") from error
    del text
    if not isinstance(root, _Object):
        raise CheckpointError(f"{path}: corrupt safetensors header: it is not a JSON object.")
    data_start = 8 + header_size
    metadata: dict[str, str] = {}
    seen_metadata = False
    entries: dict[str, _Info] = {}  # a repeated tensor name: the last entry wins, as in safetensors
    for name, value in root:
        if not _encodable(name):
            raise CheckpointError(f"{path}: corrupt safetensors header: a name holds a lone UTF-16 surrogate.")
        if name == "__metadata__":
            if seen_metadata:
                raise CheckpointError(f"{path}: corrupt safetensors header: '__metadata__' appears twice.")
            seen_metadata = True
            metadata = _read_metadata(path, value)
            continue
        if not isinstance(value, _Info):  # other field order, extra fields, or broken: the slow path decides
            problem = _entry_problem(value)
            if problem:
                raise CheckpointError(f"{path}: tensor '{name}' {problem}.")
            fields = dict(value)
            value = _Info((_DTYPE_NAMES[fields["dtype"]], tuple(fields["shape"]), *fields["data_offsets"]))
        entries[name] = value
    del root
    tensors = sorted((TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
                      for name, (dtype, shape, begin, end) in entries.items()), key=_by_offsets)
    del entries
    if validate:
        problems = layout_problems(tensors, data_start, file_size)
        if problems:
            tensor, message = problems[0]
            more = f" (and {len(problems) - 1} more problem(s) in this file)" if len(problems) > 1 else ""
            raise CheckpointError(f"{path}: " + (f"tensor '{tensor}' " if tensor else "") + f"{message}{more}.")
    subbyte = next((t for t in tensors if t.dtype in SUBBYTE_DTYPES), None)
    if subbyte is not None:
        raise CheckpointError(f"{path}: tensor '{subbyte.name}' has dtype {subbyte.dtype} ({SUBBYTE_DTYPES[subbyte.dtype]} "
                              "bits per element), which dmap cannot size or shard yet.")
    return SafetensorsHeader(path, header_size, {t.name: t for t in tensors}, metadata)


_by_offsets = operator.itemgetter(3, 4)


def _read_metadata(path: Path, value) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, _Object) or not all(type(k) is str and type(v) is str and _encodable(k) and _encodable(v)
                                                 for k, v in value):
        raise CheckpointError(f"{path}: corrupt safetensors header: '__metadata__' must map strings to strings.")
    return dict(value)


def layout_problems(tensors: list[TensorEntry], data_start: int, file_size: int) -> list[tuple[str | None, str]]:
    """Every (tensor, problem) of a header's layout, by safetensors' rules on offsets in data bytes:
    contiguous from 0 (no gap, no overlap), each the exact size of its dtype and shape (u64
    arithmetic, whole bytes), the last one ending at the end of the file (no trailing bytes)."""
    problems: list[tuple[str | None, str]] = []
    data_bytes = file_size - data_start
    start = 0
    for tensor in tensors:
        begin, end = tensor.begin - data_start, tensor.end - data_start
        if end < begin:
            problems.append((tensor.name, "has data_offsets that end before they begin"))
            continue
        if begin > start:
            problems.append((tensor.name, f"leaves a gap: it starts at data byte {begin} but the tensor before it "
                                          f"ends at {start}"))
        elif begin < start:
            problems.append((tensor.name, f"overlaps the tensor before it (it starts at data byte {begin}, before {start})"))
        start = max(start, end)
        if end > data_bytes:
            problems.append((tensor.name, f"ends at data byte {end} but the file holds {data_bytes} data bytes: "
                                          "truncated or corrupt"))
        count = math.prod(tensor.shape)
        if 0 < count <= U64_MAX and count * _NAME_BITS[tensor.dtype] <= U64_MAX:  # no zero dim: no partial overflow
            bits = count * _NAME_BITS[tensor.dtype]
            expected = None if bits % 8 else bits // 8
        else:
            expected = _checked_bytes(tensor.dtype, tensor.shape)
        if expected is None:
            problems.append((tensor.name, f"has shape {list(tensor.shape)} whose size in {tensor.dtype} overflows "
                                          "64 bits or is not a whole number of bytes"))
        elif end - begin != expected:
            problems.append((tensor.name, f"holds {end - begin} bytes but {tensor.dtype}{list(tensor.shape)} needs {expected}"))
    if start < data_bytes:
        problems.append((None, f"the tensors cover {start} data bytes but the file holds {data_bytes}: it has trailing bytes"))
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
    data = read_json_object(path, "index file", MAX_INDEX_BYTES)
    if not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{path}: not a shard index: it has no 'weight_map' object.")
    for name, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not is_plain_file_name(shard):
            raise CheckpointError(f"{path}: tensor '{name}' names shard {shard!r}, which is a path, not a file name in the folder.")
    metadata = data.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: 'metadata' must be an object, found {type(metadata).__name__}.")
    total = metadata.get("total_size")
    if total is not None and not _byte_count(total):  # 1e400 parses as inf: int() of it is an OverflowError
        shown = shorten(total, quote=True)
        raise CheckpointError(f"{path}: metadata.total_size must be a whole number of bytes from 0 to "
                              f"{MAX_SIZE_TEXT}, found {shown}.")
    return ShardIndex(path, int(total) if total is not None else None, dict(data["weight_map"]), metadata)


def _byte_count(value) -> bool:
    """A finite, whole, non-negative number of bytes no larger than units.MAX_SIZE_BYTES."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and 0 <= value <= MAX_SIZE_BYTES and value == int(value)


def is_plain_file_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "/\\\0") and name not in (".", "..")


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
        tensor_files = dict.fromkeys(tensors, path.name)
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
    return sorted(p for p in folder.glob("*") if p.suffix in LEGACY_SUFFIXES and p.is_file())


# --- legacy (.bin/.pt) weights -------------------------------------------------------------------


def legacy_files_loaded(folder: Path, variant: str | None, candidates: list[Path]) -> list[Path] | None:
    """The legacy weight files a loader would read in `folder` (index + shards, or one file)."""
    for stem in ("diffusion_pytorch_model", "pytorch_model", "model"):
        index = folder / (f"{stem}.bin.index.{variant}.json" if variant else f"{stem}.bin.index.json")
        if index.is_file():
            shard_index = read_index(index)
            files = []
            for shard in shard_index.shard_names:
                if not (folder / shard).is_file():
                    raise CheckpointError(f"{index}: names shard '{shard}', which does not exist in {folder}.")
                files.append(folder / shard)
            return files + [index]
        single = folder / (f"{stem}.{variant}.bin" if variant else f"{stem}.bin")
        if single.is_file():
            return [single]
    plain = [p for p in candidates if p.suffix in LEGACY_SUFFIXES]
    if len(plain) == 1:
        return plain
    if len(plain) > 1:
        names = ", ".join(p.name for p in plain)
        raise SourceError(f"{folder} holds several legacy weight files ({names}): give the one to shard as SOURCE.")
    return None


def load_legacy_weights(path: Path) -> dict:
    """`torch.load(weights_only=True)` only: a file that needs full unpickling is refused."""
    # torch: imported on use, so start-up stays free of torch
    import torch

    def load(mmap: bool):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            obj = load(True)  # memory-mapped: pages come from the file, not from RAM
        except pickle.UnpicklingError:
            raise
        except Exception:  # old (non-zip) files cannot be memory-mapped
            obj = load(False)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path} stores Python objects besides tensors and would need full unpickling, which can run arbitrary "
            f"code, so dmap refuses it ({first[:160]}); convert it to safetensors in a trusted environment."
        ) from None
    except Exception as error:  # noqa: BLE001 - a corrupt file is one sentence, not a traceback
        raise CheckpointError(f"{path} cannot be read as PyTorch weights ({type(error).__name__}: {error}).") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict of tensors.")
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry '{key}' is a {type(value).__name__}, not a tensor; dmap shards tensors only.")
        name = str(value.dtype).removeprefix("torch.")
        if name not in TORCH_TO_SAFETENSORS:
            raise CheckpointError(f"{path}: tensor '{key}' has dtype {name}, which safetensors cannot store.")
    return obj

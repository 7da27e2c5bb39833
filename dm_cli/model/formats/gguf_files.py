"""GGUF files (llama.cpp's format, in which many quantized community checkpoints come): the header, read as
hostile input, and never a byte of tensor data.

A GGUF file is a magic (`GGUF`), a version, a tensor count and a metadata count, the metadata key/values
(scalars, strings, arrays, arrays of arrays), one info per tensor (name, dimensions innermost first, ggml
type, offset into the data section), padding to the alignment (`general.alignment`, else 32), then the data.

What this reader accepts is exactly what `gguf.GGUFReader` (the gguf package's own reader) accepts, with
two changes, each a check the reader leaves out and llama.cpp makes:

- every part of the header lies inside the file (the reader returns a short array for a string, array or
  count that runs past the end, and so accepts a file truncated in its last metadata value);
- the tensors follow one another in header order from offset 0, each starting where the one before ends,
  padded to the alignment (llama.cpp's `gguf_init_from_file`: "tensor has offset X, expected Y"): so they
  are aligned, never overlap, leave no gaps, and every tensor's bytes (its shape's elements over the ggml
  block size, times the block's bytes: `gguf.GGML_QUANT_SIZES`) end inside the file. Bytes after the last
  tensor are allowed, as llama.cpp allows them.

The reader's own refusals are kept one for one (version 2 or 3, byte order from the version, unknown value
or ggml types, keys and tensor names that are not UTF-8, repeated keys, the reader's reserved keys, repeated
tensor names, an alignment that is not a power-of-two uint32, a quantized row that is not a whole number of
blocks, a shape whose size numpy cannot hold). Two limits no real file meets are dmap's own: a key or tensor
name over 1 MiB, and arrays nested more than 64 deep (the reader's limit there is Python's recursion limit).
Every refusal is one CheckpointError sentence naming the file (exit 2). Counts and lengths are checked
against the bytes left in the file before anything is read or looped over, so a header claiming 2^60
entries is refused at once, and reads go through a bounded buffer (never a memory map: a file truncated
while dmap reads it is an error, not a SIGBUS).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dm_cli.errors import CheckpointError
from dm_cli.io.checkpoint import open_regular

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # gguf.gguf_reader.READER_SUPPORTED_VERSIONS
DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT
RESERVED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the reader's own fields: a repeat to it
MAX_NAME_BYTES = 1 << 20
MAX_NESTING = 64
SHOWN_STRING_BYTES = 256  # metadata strings are kept to this many bytes (the rest is skipped, not read)
INT64_MAX = 2**63 - 1
U64 = 2**64
_CHUNK = 1 << 20
# ggml types gguf's reader gives a numpy dtype (their shape is the element shape); the others are byte blocks
BASIC_TYPES = ("F32", "F16", "F64", "I8", "I16", "I32", "I64")
# value type code (gguf.GGUFValueType) -> name, struct format (None: string or array)
VALUE_TYPES = {0: ("UINT8", "B"), 1: ("INT8", "b"), 2: ("UINT16", "H"), 3: ("INT16", "h"), 4: ("UINT32", "I"),
               5: ("INT32", "i"), 6: ("FLOAT32", "f"), 7: ("BOOL", "B"), 8: ("STRING", None), 9: ("ARRAY", None),
               10: ("UINT64", "Q"), 11: ("INT64", "q"), 12: ("FLOAT64", "d")}
_STRING, _ARRAY, _BOOL, _UINT32 = 8, 9, 7, 4
MAIN_KEYS = ("general.architecture", "general.name", "general.quantization_version", "general.file_type",
             "general.alignment")
# C0/C1 controls, DEL, bidi overrides, and newlines/tabs too: a name in a one-line message stays one line
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text: str, limit: int = 60) -> str:
    """A name read from the file, for a one-line message: control characters as `\\xNN`, cut to `limit`."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}" if ord(m.group(0)) < 0x100
                        else f"\\u{ord(m.group(0)):04x}", text)
    return text if len(text) <= limit else text[: limit - 12] + "..." + text[-9:]


def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type code -> (name, block size in elements, bytes per block), from the gguf package."""
    # gguf (numpy): imported on use, only for GGUF files
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


class GGUFTensor(NamedTuple):
    name: str
    ggml_type: str  # Q4_K, Q8_0, F16, ...
    dims: tuple[int, ...]  # ggml's ne: innermost first, as stored
    offset: int  # absolute in the file
    nbytes: int  # as stored (quantized blocks)

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as numpy and PyTorch see it."""
        return tuple(reversed(self.dims))

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return count


@dataclass
class GGUFHeader:
    path: Path
    version: int
    byte_order: str  # "little" or "big"
    alignment: int
    data_start: int  # absolute offset of the data section
    file_size: int
    tensors: list[GGUFTensor]
    metadata: dict[str, object] = field(default_factory=dict)  # scalars, strings (cut), arrays as {"array": T, "length": N}

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class _Truncated(Exception):
    pass


class _Cursor:
    """Reads a file from the start through a bounded buffer; every read is checked against the file size first."""

    def __init__(self, handle, size: int):
        self.handle, self.size, self.pos = handle, size, 0
        self.order = "<"
        self._buf, self._at = b"", 0

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise _Truncated(what)
        lo = self.pos - self._at
        if lo + n > len(self._buf):
            self.handle.seek(self.pos)
            self._buf, self._at, lo = self.handle.read(max(n, _CHUNK)), self.pos, 0
            if len(self._buf) < n:
                raise _Truncated(what)  # the file shrank while dmap read it
        self.pos += n
        return self._buf[lo:lo + n]

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _Truncated(what)
        self.pos += n

    def unpack(self, fmt: str, what: str):
        form = struct.Struct(self.order + fmt)
        return form.unpack(self.take(form.size, what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        """A GGUF string (u64 length, bytes): all of it, or with `limit` its first `limit` bytes (the rest skipped)."""
        length = self.unpack("Q", what)
        if limit is None:
            return self.take(length, what)
        head = self.take(min(length, limit), what)
        self.skip(length - len(head), what)
        return head + (b"\xe2\x80\xa6" if length > limit else b"")  # "…"


def read_gguf_header(path) -> GGUFHeader:
    """The header of a GGUF file, checked as the module docstring says; no tensor data is read."""
    path = Path(path)
    handle, size = open_regular(path, "GGUF file")
    try:
        with handle:
            cursor = _Cursor(handle, size)
            return _read(path, cursor)
    except _Truncated as where:
        raise CheckpointError(f"{path}: corrupt or truncated GGUF header: {where} runs past the end of the file "
                              f"({size} bytes).") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}.") from error


def _refuse(path: Path, message: str):
    raise CheckpointError(f"{path}: corrupt GGUF header: {message}.")


def _read(path: Path, cursor: _Cursor) -> GGUFHeader:
    magic = cursor.take(4, "the magic")
    if magic != GGUF_MAGIC:
        _refuse(path, f"it does not start with the GGUF magic (found {shown(repr(magic))}): not a GGUF file")
    raw_version = cursor.take(4, "the version")
    version = struct.unpack("<I", raw_version)[0]
    if version & 0xFFFF == 0:  # gguf's reader: written on a machine of the other byte order
        cursor.order, version = ">", struct.unpack(">I", raw_version)[0]
    if version not in SUPPORTED_VERSIONS:
        _refuse(path, f"version {version} is not one dmap (and gguf's reader) can read: {SUPPORTED_VERSIONS}")
    tensor_count = cursor.unpack("Q", "the tensor count")
    kv_count = cursor.unpack("Q", "the metadata count")
    if kv_count * 13 > cursor.left():  # a key/value takes at least 8 + 4 + 1 bytes
        _refuse(path, f"it claims {kv_count} metadata entries, more than the file's {cursor.size} bytes can hold")
    metadata, codes = _read_metadata(path, cursor, kv_count)
    if tensor_count * 24 > cursor.left():  # a tensor info takes at least 8 + 4 + 4 + 8 bytes
        _refuse(path, f"it claims {tensor_count} tensors, more than the file's {cursor.size} bytes can hold")
    infos = [_read_tensor_info(path, cursor, i, tensor_count) for i in range(tensor_count)]
    alignment = _alignment(path, codes.get("general.alignment"), metadata.get("general.alignment"))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = _layout(path, infos, alignment, data_start, cursor.size)
    return GGUFHeader(path, version, "big" if cursor.order == ">" else "little", alignment, data_start, cursor.size,
                      tensors, metadata)


def _name(path: Path, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        _refuse(path, f"{what} {shown(repr(raw))} is not UTF-8")


def _read_metadata(path: Path, cursor: _Cursor, count: int) -> tuple[dict[str, object], dict[str, int]]:
    """key -> value (strings cut, arrays summarised), and key -> value type code."""
    metadata: dict[str, object] = {}
    codes: dict[str, int] = {}
    for index in range(count):
        what = f"metadata entry {index + 1} of {count}"
        length = cursor.unpack("Q", what)
        if length > MAX_NAME_BYTES and length <= cursor.left():
            _refuse(path, f"{what} has a key of {length} bytes, more than the {MAX_NAME_BYTES} dmap reads")
        key = _name(path, cursor.take(length, what), f"the key of {what}")
        code = cursor.unpack("I", what)
        if key in metadata or key in RESERVED_KEYS:
            _refuse(path, f"the metadata key '{shown(key)}' appears twice" if key in metadata else
                    f"the metadata key '{shown(key)}' is one gguf's reader reserves")
        metadata[key] = _read_value(path, cursor, code, f"the value of '{shown(key)}'", 0)
        codes[key] = code
    return metadata, codes


def _read_value(path: Path, cursor: _Cursor, code: int, what: str, depth: int):
    if code not in VALUE_TYPES:
        _refuse(path, f"{what} has unknown value type {code}")
    name, fmt = VALUE_TYPES[code]
    if fmt is not None:
        value = cursor.unpack(fmt, what)
        return bool(value) if code == _BOOL else value
    if code == _STRING:
        return cursor.string(what, SHOWN_STRING_BYTES).decode("utf-8", "replace")
    if depth >= MAX_NESTING:
        _refuse(path, f"{what} nests arrays more than {MAX_NESTING} deep")
    item = cursor.unpack("I", what)
    length = cursor.unpack("Q", what)
    if length == 0:
        return {"array": VALUE_TYPES.get(item, ("?",))[0], "length": 0}  # gguf's reader never looks at its type
    if item not in VALUE_TYPES:
        _refuse(path, f"{what} is an array of unknown value type {item}")
    item_name, item_fmt = VALUE_TYPES[item]
    least = struct.calcsize(item_fmt) if item_fmt else (8 if item == _STRING else 12)
    if length * least > cursor.left():
        raise _Truncated(f"{what} (an array of {length} {item_name})")
    if item_fmt is not None:
        cursor.skip(length * least, what)
    else:
        for _ in range(length):
            if item == _STRING:
                cursor.skip(cursor.unpack("Q", what), what)
            else:
                _read_value(path, cursor, _ARRAY, what, depth + 1)
    return {"array": item_name, "length": length}


def _read_tensor_info(path: Path, cursor: _Cursor, index: int, count: int) -> tuple:
    what = f"tensor info {index + 1} of {count}"
    length = cursor.unpack("Q", what)
    if length > MAX_NAME_BYTES and length <= cursor.left():
        _refuse(path, f"{what} has a name of {length} bytes, more than the {MAX_NAME_BYTES} dmap reads")
    name = _name(path, cursor.take(length, what), f"the name of {what}")
    n_dims = cursor.unpack("I", what)
    if n_dims * 8 > cursor.left():
        raise _Truncated(f"{what} ('{shown(name)}', {n_dims} dimensions)")
    dims = struct.unpack(f"{cursor.order}{n_dims}Q", cursor.take(8 * n_dims, what))
    code = cursor.unpack("I", what)
    offset = cursor.unpack("Q", what)
    return name, dims, code, offset


def _alignment(path: Path, code, value) -> int:
    if value is None:
        return DEFAULT_ALIGNMENT
    if code != _UINT32:
        _refuse(path, "'general.alignment' must be a uint32")
    if value == 0 or value & (value - 1):
        _refuse(path, f"'general.alignment' is {value}: it must be a power of two")
    return value


def tensor_bytes(path: Path, name: str, ggml: tuple[str, int, int], dims: tuple[int, ...]) -> int:
    """Bytes of a tensor as stored, with gguf's reader's rules: a quantized row is whole blocks, and the size
    (computed in uint64 as the reader does, then shaped by numpy) must be one numpy can hold."""
    type_name, block, type_size = ggml
    count = 1
    for dim in dims:
        count *= dim
    wrapped = count % U64  # the reader's np.prod over uint64
    if type_name in BASIC_TYPES:
        shape, item, stored = dims, type_size, wrapped
    else:
        if not dims or dims[0] % block:
            row = dims[0] if dims else "no"
            _refuse(path, f"tensor '{shown(name)}' ({type_name}) has rows of {row} elements, not a whole number of "
                    f"{block}-element blocks")
        shape, item, stored = (*dims[1:], dims[0] // block * type_size), 1, wrapped * type_size // block
    product, nonzero = 1, 1
    for dim in shape:
        product *= dim
        nonzero *= dim or 1
    if product != stored or nonzero * item > INT64_MAX:
        _refuse(path, f"tensor '{shown(name)}' has shape {shown(str(list(reversed(dims))))}, whose size overflows "
                "64 bits")
    return stored * item


def _layout(path: Path, infos: list[tuple], alignment: int, data_start: int, file_size: int) -> list[GGUFTensor]:
    """llama.cpp's rule: in header order, each tensor starts where the one before ended, padded to the alignment."""
    types = ggml_types()
    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    expected = 0
    for name, dims, code, offset in infos:
        if name in seen:
            _refuse(path, f"the tensor name '{shown(name)}' appears twice")
        seen.add(name)
        if code not in types:
            _refuse(path, f"tensor '{shown(name)}' has unknown ggml type {code}")
        nbytes = tensor_bytes(path, name, types[code], dims)
        if offset != expected:
            _refuse(path, f"tensor '{shown(name)}' starts at data offset {offset}, but the tensors before it end at "
                    f"{expected} (padded to {alignment} bytes): tensors must follow each other in header order, "
                    "aligned, without gaps or overlaps")
        if data_start + offset + nbytes > file_size:
            raise CheckpointError(f"{path}: GGUF file is truncated: tensor '{shown(name)}' ({types[code][0]}, "
                                  f"{nbytes} bytes) ends at byte {data_start + offset + nbytes}, past the end of the "
                                  f"file ({file_size} bytes).")
        tensors.append(GGUFTensor(name, types[code][0], tuple(dims), data_start + offset, nbytes))
        expected += -(-nbytes // alignment) * alignment
    return tensors


# --- what inspect shows ---------------------------------------------------------------------------


def type_summary(tensors: list[GGUFTensor]) -> dict[str, dict[str, int]]:
    """ggml type -> tensors, params and bytes as stored, largest first."""
    found: dict[str, dict[str, int]] = {}
    for tensor in tensors:
        row = found.setdefault(tensor.ggml_type, {"tensors": 0, "params": 0, "bytes": 0})
        row["tensors"] += 1
        row["params"] += tensor.numel
        row["bytes"] += tensor.nbytes
    return dict(sorted(found.items(), key=lambda item: (-item[1]["bytes"], item[0])))


def module_rows(tensors: list[GGUFTensor], depth: int) -> list[dict]:
    """Rows of the name tree (dotted prefixes) down to `depth` levels, in file order, each with its subtree's
    params and bytes as stored: what `inspect --depth` shows for a header-only safetensors file."""
    totals: dict[str, list[int]] = {}  # prefix -> [params, bytes], first seen first
    for tensor in tensors:
        parts = tensor.name.split(".")[:-1]
        for level in range(1, min(len(parts), depth) + 1):
            row = totals.setdefault(".".join(parts[:level]), [0, 0])
            row[0] += tensor.numel
            row[1] += tensor.nbytes
    children: dict[str, list[str]] = {}
    for prefix in totals:
        children.setdefault(prefix.rpartition(".")[0] if "." in prefix else "", []).append(prefix)
    rows: list[dict] = []
    stack = [(prefix, 1) for prefix in reversed(children.get("", []))]
    while stack:  # depth first, in file order (no recursion: --depth and the names may be deep)
        prefix, level = stack.pop()
        params, nbytes = totals[prefix]
        rows.append({"name": prefix, "class": "?", "depth": level, "params": params, "bytes": nbytes,
                     "no_split": False})
        stack.extend((child, level + 1) for child in reversed(children.get(prefix, [])))
    return rows


def summary(header: GGUFHeader) -> dict:
    """The `gguf` section of `inspect --json` (and of its table): format facts, main metadata, types, tensors."""
    return {
        "version": header.version,
        "byte_order": header.byte_order,
        "alignment": header.alignment,
        "tensor_count": len(header.tensors),
        "metadata_count": len(header.metadata),
        "data_start": header.data_start,
        "metadata": {key: _json_safe(header.metadata[key]) for key in MAIN_KEYS if key in header.metadata},
        "types": type_summary(header.tensors),
        "tensors": [{"name": t.name, "type": t.ggml_type, "shape": list(t.shape), "offset": t.offset,
                     "bytes": t.nbytes} for t in header.tensors],
    }


def _json_safe(value):
    """NaN and infinities (a float32 where a name should be) are not JSON: shown as text."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value

"""`dmap inspect FILE.gguf`: the header of a GGUF file (llama.cpp's format, in which quantized community
checkpoints come), read as hostile input, never its tensor data.

The reference is the gguf package's own reader. "gguf accepts a file" means, precisely:
`gguf.GGUFReader(path)` returns without raising when every read it makes must lie inside the file
(`StrictReader` below: the stock reader silently returns a short array for a read past the end, and so
accepts a file truncated inside its last metadata value), and its tensors follow llama.cpp's layout rule,
which the reader does not check: in header order, each tensor's offset is where the one before it ended,
padded to the alignment, starting at 0 (aligned, no gap, no overlap), and each one's bytes (`n_bytes`:
its elements over the ggml block size times the block's bytes) end inside the file. dmap must exit 0
exactly there, with the reader's tensor count and byte totals, and exit 2 with one sentence everywhere
else: never 1, never a traceback.
"""

import os
import struct
import tempfile
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_hostile import cli


class StrictReader(gguf.GGUFReader):
    """gguf's reader, except that a read past the end of the file is an error instead of a short array."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if int(offset) + np.dtype(dtype).itemsize * int(count) > len(self.data):
            raise ValueError("read past the end of the file")
        return super()._get(offset, dtype, count, override_order)


def gguf_accepts(path: Path):
    """The reader's tensors when gguf accepts the file (see the module docstring), else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # uint64 wrap-around in the reader's offset sums
            reader = StrictReader(path)
    except Exception:  # noqa: BLE001 - any refusal is a refusal
        return None
    expected = 0
    for tensor in reader.tensors:
        offset = int(tensor.field.parts[5][0])  # the offset as written, before the reader adds the data start
        if offset != expected or reader.data_offset + offset + tensor.n_bytes > len(reader.data):
            return None
        expected += -(-tensor.n_bytes // int(reader.alignment)) * int(reader.alignment)
    return reader


def write(path: Path, tensors: list, metadata: dict | None = None, alignment: int | None = None,
          endianess=gguf.GGUFEndian.LITTLE) -> Path:
    """A GGUF file through gguf's own writer: tensors are (name, ggml type, shape outermost first, values)."""
    writer = gguf.GGUFWriter(str(path), "flux", endianess=endianess)
    writer.add_name("tiny flux")
    writer.add_quantization_version(2)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in (metadata or {}).items():
        writer.add_key_value(key, *value)
    for name, qtype, shape, values in tensors:
        writer.add_tensor(name, values(qtype, shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def raw_values(qtype, shape):
    """Bytes of the right size for any ggml type (inspect reads headers only, so their values do not matter)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    return (np.arange(int(np.prod(byte_shape))) % 251).astype(np.uint8).reshape(byte_shape)


def quantized(qtype, shape):
    rows = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return gguf.quants.quantize(rows, qtype)


def floats(qtype, shape):
    return np.random.default_rng(1).standard_normal(shape).astype({Q.F32: np.float32, Q.F16: np.float16}[qtype])


MIXED = [("double_blocks.0.img_attn.qkv.weight", Q.Q8_0, (6, 64), quantized),
         ("double_blocks.0.img_attn.qkv.bias", Q.F32, (6,), floats),
         ("double_blocks.1.img_mlp.0.weight", Q.Q4_K, (3, 512), raw_values),
         ("double_blocks.1.img_mlp.0.bias", Q.BF16, (3,), raw_values),
         ("final_layer.linear.weight", Q.F16, (5, 7), floats)]


def inspect_json(capsys, path) -> dict:
    import json

    code, out, err = cli(capsys, "inspect", path, "--json")
    assert code == 0, err
    return json.loads(out)


def refused(capsys, path, *words) -> str:
    """inspect exits 2 with one sentence (containing `words`); returns it."""
    code, out, err = cli(capsys, "inspect", path)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), (code, err)
    assert all(word in err for word in words), err
    assert "\x1b" not in err and "\x07" not in err
    return lines[0]


# --- what inspect shows, against gguf's reader ----------------------------------------------------


@pytest.mark.parametrize("alignment", [None, 64])
def test_inspect_gives_the_readers_tensors_types_and_bytes(tmp_path, capsys, alignment):
    path = write(tmp_path / "flux-q4.gguf", MIXED, {"tokens": (["a", "b"], gguf.GGUFValueType.ARRAY)}, alignment)
    reader = gguf_accepts(path)
    assert reader is not None
    report = inspect_json(capsys, path)
    section = report["gguf"]
    assert report["kind"] == "gguf" and section["tensor_count"] == len(reader.tensors) == 5
    assert report["total"]["bytes"] == sum(t.n_bytes for t in reader.tensors) == 6 * 68 + 24 + 3 * 288 + 6 + 70
    assert report["total"]["params"] == sum(t.n_elements for t in reader.tensors)
    assert section["alignment"] == reader.alignment == (alignment or 32)
    assert section["data_start"] == reader.data_offset
    assert [(t["name"], t["type"], tuple(t["shape"]), t["offset"], t["bytes"]) for t in section["tensors"]] == [
        (t.name, t.tensor_type.name, tuple(reversed(t.shape.tolist())), t.data_offset, t.n_bytes) for t in reader.tensors]
    by_type = {}
    for t in reader.tensors:
        row = by_type.setdefault(t.tensor_type.name, {"tensors": 0, "params": 0, "bytes": 0})
        row["tensors"] += 1
        row["params"] += t.n_elements
        row["bytes"] += t.n_bytes
    assert section["types"] == by_type and list(section["types"])[0] == "Q4_K"  # largest first
    assert section["metadata"] == {"general.architecture": "flux", "general.name": "tiny flux",
                                   "general.quantization_version": 2, **({"general.alignment": 64} if alignment else {})}


def test_big_endian_files_and_files_without_tensors_read_as_gguf_reads_them(tmp_path, capsys):
    path = write(tmp_path / "be.gguf", MIXED, endianess=gguf.GGUFEndian.BIG)
    reader = gguf_accepts(path)
    assert reader is not None and reader.byte_order == "S"
    report = inspect_json(capsys, path)
    assert report["gguf"]["byte_order"] == "big" and report["gguf"]["metadata"]["general.quantization_version"] == 2
    assert [(t["name"], t["shape"], t["offset"]) for t in report["gguf"]["tensors"]] == [
        (t.name, list(reversed(t.shape.tolist())), t.data_offset) for t in reader.tensors]
    empty = write(tmp_path / "empty.gguf", [])
    assert gguf_accepts(empty) is not None
    assert inspect_json(capsys, empty)["total"] == {"params": 0, "bytes": 0}


def test_the_table_groups_tensors_and_lists_types(tmp_path, capsys):
    path = write(tmp_path / "flux-q4.gguf", MIXED)
    code, out, err = cli(capsys, "inspect", path, "--depth", "2")
    assert code == 0, err
    assert "Q4_K" in out and "Q8_0" in out and "BF16" in out and "F16" in out and "general.architecture: flux" in out
    assert "double_blocks" in out and "final_layer" in out and "GGUF header checked: 5 tensors" in out
    assert "1,964" in out  # params: 384 + 6 + 1536 + 3 + 35, in the total
    code, out, err = cli(capsys, "inspect", path, "--dtype", "fp16")
    assert code == 2 and "--dtype does not apply to a GGUF file" in err


def test_plan_shard_and_run_refuse_a_gguf_file_in_one_sentence(tmp_path, capsys):
    path = write(tmp_path / "m.gguf", MIXED[:2])
    for command in (["plan", path, "--max-memory", "0=16GB"], ["shard", path, "-s", "0", "-o", tmp_path / "out"]):
        code, out, err = cli(capsys, *command)
        assert code == 2 and "is a GGUF file" in err, (command, err)
    code, out, err = cli(capsys, "inspect", tmp_path / "missing.gguf")
    assert code == 2 and "No such path" in err


# --- hostile headers, written as attacks ----------------------------------------------------------


def header(tensors, kvs=(), version=3, counts=None, magic=b"GGUF", data=None) -> bytes:
    """A GGUF file byte by byte: tensors are (name, dims innermost first, ggml type, offset); kvs (key, type, raw)."""
    def string(text) -> bytes:
        raw = text.encode() if isinstance(text, str) else text
        return struct.pack("<Q", len(raw)) + raw

    n_tensors, n_kvs = counts or (len(tensors), len(kvs))
    blob = magic + struct.pack("<IQQ", version, n_tensors, n_kvs)
    blob += b"".join(string(key) + struct.pack("<I", code) + raw for key, code, raw in kvs)
    for name, dims, qtype, offset in tensors:
        blob += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)
    blob += bytes(-len(blob) % 32)
    return blob + (bytes(64) if data is None else data)


F32_8 = ("w", (8,), 0, 0)  # 32 bytes
NAME = ("general.name", 8, struct.pack("<Q", 4) + b"tiny")

ATTACKS = {
    "bad magic": (header([F32_8], magic=b"GGUG"), ["not a GGUF file"]),
    "version 1": (header([F32_8], version=1), ["version 1"]),
    "truncated in the tensor infos": (header([F32_8, ("v", (8,), 0, 32)])[:85], ["truncated", "runs past the end"]),
    "truncated in the data": (header([F32_8, ("v", (8,), 0, 32)], data=bytes(40)), ["'v'", "past the end"]),
    "2^60 tensors": (header([F32_8], counts=(2**60, 0)), ["claims 1152921504606846976 tensors"]),
    "2^64-1 metadata entries": (header([F32_8], counts=(1, 2**64 - 1)), ["metadata entries"]),
    "a key of 2^63 bytes": (header([F32_8], [("\0" * 3, 8, b"")]).replace(struct.pack("<Q", 3), struct.pack("<Q", 2**63), 1),
                            ["runs past the end"]),
    "a string value of 2^62 bytes": (header([F32_8], [("general.name", 8, struct.pack("<Q", 2**62) + b"tiny")]),
                                     ["general.name", "runs past the end"]),
    "an array of 2^61 strings": (header([F32_8], [("tokens", 9, struct.pack("<IQ", 8, 2**61))]),
                                 ["an array of 2305843009213693952 STRING"]),
    "an offset outside the file": (header([("w", (8,), 0, 2**40)]), ["starts at data offset 1099511627776"]),
    "an offset wrapping around 2^64": (header([("w", (8,), 0, 2**64 - 512)]), ["starts at data offset"]),
    "overlapping tensors": (header([F32_8, ("v", (8,), 0, 16)]), ["'v' starts at data offset 16", "end at 32"]),
    "a misaligned tensor": (header([("u", (3,), 0, 0), ("v", (8,), 0, 12)]), ["'v' starts at data offset 12"]),
    "a gap between tensors": (header([F32_8, ("v", (8,), 0, 64)], data=bytes(128)), ["'v' starts at data offset 64"]),
    "a Q4_K row of 100": (header([("q", (100,), 12, 0)]), ["not a whole number of 256-element blocks"]),
    "an unknown ggml type": (header([("w", (8,), 4, 0)]), ["unknown ggml type 4"]),
    "an unknown value type": (header([F32_8], [("k", 13, b"")]), ["unknown value type 13"]),
    "a repeated key": (header([F32_8], [NAME, NAME]), ["'general.name' appears twice"]),
    "a reserved key": (header([F32_8], [("GGUF.kv_count", 4, bytes(4))]), ["reserves"]),
    "a repeated tensor name": (header([F32_8, ("w", (8,), 0, 32)]), ["'w' appears twice"]),
    "alignment 24": (header([F32_8], [("general.alignment", 4, struct.pack("<I", 24))]), ["power of two"]),
    "alignment as a uint64": (header([F32_8], [("general.alignment", 10, struct.pack("<Q", 32))]), ["uint32"]),
    "a shape of 2^62 x 4 x 0": (header([("z", (0, 4, 2**62), 0, 0)]), ["overflows 64 bits"]),
    "a tensor name not UTF-8": (header([(b"\xff\xfe", (8,), 0, 0)]), ["not UTF-8"]),
    "escapes in a tensor name": (header([F32_8, ("\x1b]0;pwned\x07\nx", (8,), 0, 0)]), ["\\x1b]0;pwned\\x07\\x0ax"]),
    "an empty file": (b"", ["truncated"]),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_hostile_headers_exit_2_in_one_sentence(tmp_path, capsys, attack):
    blob, words = ATTACKS[attack]
    path = tmp_path / "m.gguf"
    path.write_bytes(blob)
    assert gguf_accepts(path) is None, "gguf accepts the attack: it is not one"
    refused(capsys, path, *words)


def test_the_attacks_start_from_a_file_gguf_accepts(tmp_path, capsys):
    """The builder above is right: the file every attack changes is valid, to gguf and to dmap."""
    path = tmp_path / "m.gguf"
    path.write_bytes(header([F32_8, ("v", (8,), 0, 32), ("q", (256,), 12, 64)], [NAME], data=bytes(64 + 144)))
    assert gguf_accepts(path) is not None
    assert inspect_json(capsys, path)["total"]["bytes"] == 32 + 32 + 144


def test_escapes_in_names_and_metadata_are_shown_inert(tmp_path, capsys):
    path = write(tmp_path / "m.gguf", [("blk\x1b[2J.0\u202e.weight", Q.F32, (4,), floats)])
    path.write_bytes(path.read_bytes().replace(b"tiny flux", b"\x1b]0;pw\x07\nx"))  # general.name, same length
    code, out, err = cli(capsys, "inspect", path, "--depth", "1")
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "blk\\x1b[2J" in out and "general.name: \\x1b]0;pw\\x07\\x0ax" in out
    report = inspect_json(capsys, path)
    assert report["gguf"]["tensors"][0]["name"] == "blk\x1b[2J.0\u202e.weight"  # JSON escapes it: \u001b


def test_a_fifo_named_gguf_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "m.gguf")
    refused(capsys, tmp_path / "m.gguf", "not a regular file")


# --- the property: dmap accepts exactly what gguf accepts -----------------------------------------

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q4_0, Q.I8]


@st.composite
def valid_file(draw) -> bytes:
    tensors = []
    for i in range(draw(st.integers(1, 3))):
        qtype = draw(st.sampled_from(TYPES))
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        shape = (draw(st.integers(1, 3)), block * draw(st.integers(1, 2)) if block > 1 else draw(st.integers(1, 5)))
        tensors.append((f"blk.{i}.w", qtype, shape[draw(st.integers(0, 1)):], raw_values))
    metadata = {}
    if draw(st.booleans()):
        metadata["tokens"] = (draw(st.lists(st.sampled_from(["a", "bc", ""]), min_size=1, max_size=3)), gguf.GGUFValueType.ARRAY)
    if draw(st.booleans()):
        metadata["scores"] = ([1, 2], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    with tempfile.TemporaryDirectory() as folder:
        return write(Path(folder) / "m.gguf", tensors, metadata, draw(st.sampled_from([None, 8, 64]))).read_bytes()


def field_starts(blob: bytes) -> tuple[list[int], int]:
    """Where each part of the header begins (counts, lengths, types, offsets): the places worth breaking;
    and where the data starts (a change after it must change nothing)."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "m.gguf").write_bytes(blob)
        reader = gguf.GGUFReader(Path(folder) / "m.gguf")
        starts = [4, 8, 16]
        for item in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
            at = item.offset
            for part in item.parts:
                starts.append(at)
                at += part.nbytes
        data_start = int(reader.data_offset)
        del reader
    return sorted(set(starts)), data_start


VALUES = [0, 1, 2, 7, 8, 31, 32, 255, 256, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated_file(draw) -> bytes:
    blob = draw(valid_file())
    starts, data_start = field_starts(blob)
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["u64", "u32", "byte", "flip", "truncate", "append", "delete", "insert", "data"]))
        if kind == "data" and data_start < len(blob):  # tensor bytes: the file stays valid
            at = draw(st.integers(data_start, len(blob) - 1))
            blob = blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1:]
            continue
        at = draw(st.sampled_from(starts) | st.integers(0, max(len(blob) - 1, 0)))
        if kind in ("u64", "u32"):
            width = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(VALUES + [len(blob), len(blob) - at])) % 2 ** (8 * width)
            value += draw(st.sampled_from([0, 0, 1, -1])) if 0 < value < 2 ** (8 * width) - 1 else 0
            blob = blob[:at] + value.to_bytes(width, "little") + blob[at + width:]
        elif kind == "byte":
            blob = blob[:at] + bytes([draw(st.integers(0, 255))]) + blob[at + 1:]
        elif kind == "flip" and at < len(blob):
            blob = blob[:at] + bytes([blob[at] ^ (1 << draw(st.integers(0, 7)))]) + blob[at + 1:]
        elif kind == "truncate":
            blob = blob[:at]
        elif kind == "append":
            blob += bytes(draw(st.integers(1, 64)))
        elif kind == "delete":
            blob = blob[:at] + blob[at + draw(st.integers(1, 8)):]
        elif kind == "insert":
            blob = blob[:at] + bytes(draw(st.integers(1, 8))) + blob[at:]
    return blob


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(blob=mutated_file())
def test_dmap_accepts_exactly_what_gguf_accepts(blob, capsys):
    import json

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        path.write_bytes(blob)
        reader = gguf_accepts(path)
        event("gguf accepts" if reader is not None else "gguf refuses")
        code, out, err = cli(capsys, "inspect", path, "--json")
        if reader is None:
            assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("Error: "), (code, err, blob)
            return
        assert code == 0, (err, blob)
        report = json.loads(out)
        assert report["gguf"]["tensor_count"] == len(reader.tensors)
        assert report["total"]["bytes"] == sum(t.n_bytes for t in reader.tensors)
        assert [(t["name"], t["type"], t["offset"]) for t in report["gguf"]["tensors"]] == [
            (t.name, t.tensor_type.name, t.data_offset) for t in reader.tensors]
        del reader

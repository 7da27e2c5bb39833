"""Item 4 of the hostile-input review: safetensors headers are checked exactly as strictly as the
safetensors library. Property: a random mutation of a valid file makes `dmap inspect FILE` and
`dmap shard FILE -o OUT` exit 0 only where `safetensors.safe_open` accepts the file, exit 2
otherwise, never 1, never a traceback; and what shard writes, safe_open loads, tensor for tensor.
"""

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from test_hostile import cli

DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64", "F8_E4M3",
          "F8_E5M2", "F8_E8M0", "C64"]
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}


def valid_file(draw) -> tuple[list, bytes]:
    """(entries, data): entries are [name, {dtype, shape, data_offsets}] in file order."""
    count = draw(st.integers(1, 4))
    entries, offset = [], 0
    for i in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = int(np.prod(shape, dtype=np.int64)) * SIZES[dtype]
        entries.append([f"t{i}", {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}])
        offset += size
    return entries, bytes(draw(st.integers(0, 255)) for _ in range(min(offset, 8))) + bytes(max(offset - 8, 0))


BAD_NUMBERS = [-1, 1.0, 1.5, True, None, "2", 2**64, 2**64 - 1, 2**63, 2**32, [1], {"a": 1}]
RAW_NUMBERS = ["-0", "1e0", "1E2", "Infinity", "NaN", "-Infinity", "01", "0x10", "1_0"]


@st.composite
def mutated_file(draw) -> bytes:
    entries, data = valid_file(draw)
    metadata: object = {"format": "pt"}
    raw_edits: list[tuple[str, str]] = []  # (json text, replacement) applied to the serialised header
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from([
            "shape", "offset", "swap_offsets", "dtype", "drop_field", "extra_field", "duplicate_field",
            "duplicate_name", "metadata", "trailing", "truncate", "raw_number", "offset_array", "reorder",
            "header_length", "raw_byte", "null_entry", "nothing",
        ]))
        name, info = entries[draw(st.integers(0, len(entries) - 1))]
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) \
                or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2:
            continue  # this entry was broken already: one structural break per entry is enough
        if kind == "shape":
            if info["shape"]:
                info["shape"][draw(st.integers(0, len(info["shape"]) - 1))] = draw(
                    st.sampled_from(BAD_NUMBERS + [0, 1, 2, 7]))
            else:
                info["shape"] = [draw(st.sampled_from(BAD_NUMBERS + [0, 1]))]
        elif kind == "offset":
            side = draw(st.integers(0, 1))
            current = info["data_offsets"][side]
            near = [current + d for d in (-8, -1, 1, 8)] if type(current) is int else []  # an earlier edit may have broken it
            info["data_offsets"][side] = draw(st.sampled_from(BAD_NUMBERS + near))
        elif kind == "swap_offsets":
            info["data_offsets"].reverse()
        elif kind == "dtype":
            info["dtype"] = draw(st.sampled_from(DTYPES + ["f32", "F8", "X", "", 5, None]))
        elif kind == "drop_field":
            info.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif kind == "extra_field":
            info[draw(st.sampled_from(["extra", "dtype2", "__x"]))] = draw(st.sampled_from(
                [1, 1.5, None, "s", [], {"a": [1, {"b": None}]}, -3]))
        elif kind == "duplicate_field":
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            if field in info:
                text = json.dumps({field: info[field]})[1:-1]
                raw_edits.append((text, text + "," + text))
        elif kind == "duplicate_name":
            other = draw(st.sampled_from(entries))
            raw_edits.append(("}}", "}," + json.dumps(name) + ":" + json.dumps(other[1]) + "}"))
        elif kind == "metadata":
            metadata = draw(st.sampled_from([None, [], 5, "x", {"a": 1}, {"a": None}, {"a": "b"}, {"a": ["b"]}, {}]))
        elif kind == "trailing":
            data += bytes(draw(st.integers(1, 9)))
        elif kind == "truncate" and data:
            data = data[: -draw(st.integers(1, len(data)))]
        elif kind == "raw_number":
            text = json.dumps(info["data_offsets"])
            raw_edits.append((text, "[" + draw(st.sampled_from(RAW_NUMBERS)) + "," + text[1:]))
        elif kind == "offset_array":
            info["data_offsets"] = draw(st.sampled_from([[], [0], [0, 0, 0], {"0": 0}, None, "0,4"]))
        elif kind == "reorder":
            items = list(info.items())
            items.reverse()
            info.clear()
            info.update(items)
        elif kind == "null_entry":
            entries[entries.index([name, info])][1] = None
        elif kind in ("header_length", "raw_byte"):
            raw_edits.append((kind, str(draw(st.integers(-9, 9)))))
    header = {"__metadata__": metadata} if metadata is not None or draw(st.booleans()) else {}
    text = "{" + ",".join([json.dumps("__metadata__") + ":" + json.dumps(metadata)] * bool(header)
                          + [json.dumps(n) + ":" + json.dumps(i) for n, i in entries]) + "}"
    length_delta, byte_edit = 0, None
    for old, new in raw_edits:
        if old == "header_length":
            length_delta = int(new)
        elif old == "raw_byte":
            byte_edit = int(new)
        else:
            text = text.replace(old, new, 1)
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    if byte_edit is not None and raw:
        at = abs(byte_edit * 7919) % len(raw)
        raw = raw[:at] + bytes([raw[at] ^ (1 << (abs(byte_edit) % 8))]) + raw[at + 1:]
    return struct.pack("<Q", max(len(raw) + length_delta, 0)) + raw + data


def safetensors_accepts(path: Path) -> dict | None:
    """The tensors as safe_open reads them, or None when it refuses the file."""
    try:
        with safe_open(str(path), "np") as handle:
            return {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    except Exception:  # noqa: BLE001 - any refusal counts as a refusal
        return None


@st.composite
def unusual_valid_file(draw) -> bytes:
    """Files safetensors accepts that a strict reader could wrongly refuse: fields in another order, extra
    fields (ignored), empty, null or string metadata, zero-size and scalar tensors, spaces in the JSON."""
    entries, data = valid_file(draw)
    parts = []
    for name, info in entries:
        fields = list(info.items())
        if draw(st.booleans()):
            fields = draw(st.permutations(fields))
        if draw(st.booleans()):
            fields.append((draw(st.sampled_from(["extra", "__x"])), draw(st.sampled_from([1, "s", [], {"a": [1]}]))))
        if draw(st.booleans()):
            fields = [(k, [] if k == "shape" else v) for k, v in fields]  # a scalar: one element
            size = SIZES[dict(fields)["dtype"]]
            begin = dict(fields)["data_offsets"][0]
            end = dict(fields)["data_offsets"][1]
            if end - begin != size:
                fields = [(k, v) for k, v in info.items()]  # keep it valid: offsets fixed by the original shape
        spacer = draw(st.sampled_from(["", " ", "\n  "]))
        parts.append(json.dumps(name) + ":" + spacer + "{" + ",".join(json.dumps(k) + ":" + json.dumps(v)
                                                                    for k, v in fields) + "}")
    metadata = draw(st.sampled_from(["absent", {}, {"format": "pt"}, {"a": "b", "c": ""}]))
    if metadata != "absent":
        parts.insert(draw(st.integers(0, len(parts))), json.dumps("__metadata__") + ":" + json.dumps(metadata))
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _agrees_with_safetensors(blob: bytes, capsys) -> bool | None:
    """inspect and shard exit 0 exactly where safe_open accepts (2 otherwise, one sentence), and what shard
    writes loads with the same tensors and bytes. Returns whether safetensors accepted the file."""
    from dm_cli.io.checkpoint import read_safetensors_header

    with tempfile.TemporaryDirectory() as folder:
        path, out = Path(folder) / "model.safetensors", Path(folder) / "out"
        path.write_bytes(blob)
        accepted = safetensors_accepts(path)
        event("safetensors accepts" if accepted is not None else "safetensors refuses")
        for command in (["inspect", path, "--json", "--no-cache"], ["shard", path, "-s", "0", "-o", out]):
            code, _, err = cli(capsys, *command)
            if accepted is None:
                lines = err.splitlines()  # one sentence, or (inspect) a list of every problem found
                assert code == 2 and lines[0].startswith("Error: ") and all(l.startswith("  - ") for l in lines[1:]), \
                    (command, err)
            else:  # (no sub-byte dtypes are drawn: those are valid, and refused by name)
                assert code == 0, (command, err, blob[:300])
        if accepted is not None:  # what shard wrote loads, with the same tensors and bytes
            written = out / "model.safetensors"
            assert safetensors_accepts(written) == accepted
            old, new = read_safetensors_header(path), read_safetensors_header(written)
            old_bytes, new_bytes = path.read_bytes(), written.read_bytes()
            for key, entry in old.tensors.items():
                copy = new.tensors[key]
                assert (copy.dtype, copy.shape) == (entry.dtype, entry.shape)
                assert new_bytes[copy.begin:copy.end] == old_bytes[entry.begin:entry.end], key
    return accepted is not None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(blob=mutated_file())
def test_4_dmap_accepts_exactly_what_safetensors_accepts(blob, capsys):
    _agrees_with_safetensors(blob, capsys)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(blob=unusual_valid_file())
def test_4_valid_but_unusual_files_are_accepted(blob, capsys):
    """The accept side: mutations mostly break a file, so these are valid by construction (safe_open agrees)."""
    assert _agrees_with_safetensors(blob, capsys), "the strategy drew a file safetensors refuses"


def _write(path: Path, header: str, data: bytes = b"") -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


T = '"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


@pytest.mark.parametrize("header, data, words", [
    ('{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8), "integers from 0"),
    ('{"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', bytes(8), "integers from 0"),
    ('{"w":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}}', bytes(8), "integers from 0"),
    ('{"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', bytes(8), "integers from 0"),
    ('{"w":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b"", "overflows 64 bits"),
    ('{"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', bytes(16), "leaves a gap"),
    ("{" + T + "}", bytes(9), "trailing bytes"),
    ('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}',
     bytes(16), "leaves a gap"),  # a repeated name: the last entry wins, as in safetensors, and its offsets are wrong
    ('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,Infinity]}}', bytes(8), "cannot be parsed"),
    ('{"__metadata__":{"format":1},' + T + "}", bytes(8), "must map strings to strings"),
    ('{"__metadata__":["pt"],' + T + "}", bytes(8), "must map strings to strings"),
    ('{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8), "twice"),
    ('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + "[" * 126 + "]" * 126 + "}}", bytes(8), "deeper than 127"),
    ("{" + '"w":' + "[" * 200_000 + "]" * 200_000 + "}", b"", "deeper than 127"),
])
def test_4_named_header_attacks_exit_2(tmp_path, capsys, header, data, words):
    path = _write(tmp_path / "m.safetensors", header, data)
    assert safetensors_accepts(path) is None
    for command in (["inspect", path], ["shard", path, "-s", "0", "-o", tmp_path / "out"]):
        code, out, err = cli(capsys, *command)
        assert code == 2 and words in err, (command, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_4_sub_byte_dtype_is_refused_by_name(tmp_path, capsys):
    """F4 (two values per byte) is valid safetensors; dmap cannot size it yet and says so (exit 2)."""
    path = _write(tmp_path / "m.safetensors", '{"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', bytes(2))
    assert safetensors_accepts(path) is not None
    code, out, err = cli(capsys, "inspect", path)
    assert code == 2 and "F4" in err and "cannot size or shard yet" in err, err


def test_4_index_json_of_the_wrong_shape_is_exit_2(tmp_path, capsys):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "m-00001-of-00001.safetensors"))
    for metadata, words in (([], "'metadata' must be an object"), ({"total_size": "8"}, "total_size"),
                            ({"total_size": -1}, "total_size"), (5, "'metadata' must be an object")):
        (tmp_path / "m.safetensors.index.json").write_text(json.dumps(
            {"metadata": metadata, "weight_map": {"w": "m-00001-of-00001.safetensors"}}))
        code, out, err = cli(capsys, "inspect", tmp_path / "m.safetensors.index.json")
        assert code == 2 and words in err, err
    for document in ("[]", "5", '{"weight_map": []}', "NaN"):
        (tmp_path / "m.safetensors.index.json").write_text(document)
        code, out, err = cli(capsys, "inspect", tmp_path / "m.safetensors.index.json")
        assert code == 2, err


def test_4_names_with_odd_digit_runs_shard_in_natural_order(tmp_path, capsys):
    """Shard orders tensors by their digit runs as numbers: a '²' (a digit to str.isdigit, not to
    int) or a run of 5000 digits (beyond Python's int conversion) is ordered, not a crash."""
    from safetensors.numpy import save_file

    names = ["blocks.10.w", "blocks.2.w", "w.1²", "²", "x." + "1" * 5000, "x.9"]
    save_file({n: np.full(2, i, np.float32) for i, n in enumerate(names)}, str(tmp_path / "m.safetensors"))
    code, out, err = cli(capsys, "shard", tmp_path / "m.safetensors", "-s", "0", "-o", tmp_path / "out")
    assert code == 0, err
    raw = (tmp_path / "out" / "m.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    header.pop("__metadata__", None)
    assert sorted(header, key=lambda n: header[n]["data_offsets"])[:2] == ["blocks.2.w", "blocks.10.w"]
    with safe_open(str(tmp_path / "out" / "m.safetensors"), "np") as f:
        assert {n: float(f.get_tensor(n)[0]) for n in f.keys()} == {n: float(i) for i, n in enumerate(names)}

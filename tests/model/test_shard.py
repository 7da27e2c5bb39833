"""`dmap shard`: round trips through the real loaders, layout rules, bad input, faults, in-place."""

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PRESETS, REPO, run_dmap

from dm_cli.errors import CheckpointError, DmapError, SourceError, UsageError
from dm_cli.io.checkpoint import open_checkpoint
from dm_cli.model.shard import shard
from dm_cli.model.sharding import copying, verification, writing
from dm_cli.model.sharding.layout import Progress

SMALL = {"min_shard_size": 1}  # the tiny models are ~70 KB: let tests cut them below the 1 MB floor


# --- helpers ----------------------------------------------------------------------------------------


def tiny_model(preset: str, component: str, seed: int = 0):
    """A tiny component from the bundled preset config, with random weights."""
    config = json.loads((PRESETS / preset / component / "config.json").read_text())
    torch.manual_seed(seed)
    if "_class_name" in config:
        import diffusers

        cls = getattr(diffusers, config["_class_name"])
        model = cls.from_config(config)
    else:
        import transformers

        cls = getattr(transformers, config["architectures"][0])
        model = cls(transformers.AutoConfig.for_model(**config))
    with torch.no_grad():
        for p in model.parameters():  # not the init values: every tensor different and non-trivial
            p.copy_(torch.randn_like(p))
    return model.eval()


def assert_state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def tree_digest(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_safetensors(path: Path, entries: dict, data: bytes, raw_header: bytes | None = None) -> None:
    """Hand-written safetensors file (for corrupt-input tests)."""
    header = raw_header if raw_header is not None else json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def limit_for(folder: Path, shards: int) -> int:
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return total // shards + 1


# --- round trips through the real loaders -----------------------------------------------------------


@pytest.mark.parametrize("preset, component", [
    ("tiny-sd15", "unet"),
    ("tiny-flux", "transformer"),
    ("tiny-flux", "text_encoder"),
    ("tiny-flux", "text_encoder_2"),
])
def test_round_trip_through_loaders(tmp_path, preset, component):
    from accelerate import load_checkpoint_in_model

    model = tiny_model(preset, component)
    model.save_pretrained(tmp_path / "src")
    before = tree_digest(tmp_path / "src")
    result = shard(str(tmp_path / "src"), limit_for(tmp_path / "src", 4), output=tmp_path / "out", **SMALL)
    comp = result.components[0]
    assert len(comp.shards) >= 3 and result.verified
    from diffusers import ModelMixin

    stem = "diffusion_pytorch_model" if isinstance(model, ModelMixin) else "model"
    assert comp.index_name == f"{stem}.safetensors.index.json"
    n = len(comp.shards)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == [
        f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for s in comp.shards:
        size = (tmp_path / "out" / s.name).stat().st_size
        assert size == s.file_bytes
        assert size <= result.max_shard_size or (s.oversized and len(s.tensors) == 1)

    loaded = type(model).from_pretrained(tmp_path / "out").eval()
    assert_state_equal(model, loaded)

    fresh = tiny_model(preset, component, seed=1)
    load_checkpoint_in_model(fresh, str(tmp_path / "out" / comp.index_name))
    if hasattr(fresh, "tie_weights"):
        fresh.tie_weights()
    assert_state_equal(model, fresh)
    assert tree_digest(tmp_path / "src") == before  # the source is never touched


def tiny_pipeline(root: Path) -> dict:
    """A tiny SD 1.5 pipeline folder: components saved by their libraries, configs as shipped."""
    models = {name: tiny_model("tiny-sd15", name) for name in ("unet", "vae", "text_encoder")}
    for name, model in models.items():
        model.save_pretrained(root / name)
    shutil.copy(PRESETS / "tiny-sd15" / "model_index.json", root / "model_index.json")
    shutil.copytree(PRESETS / "tiny-sd15" / "scheduler", root / "scheduler")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (root / "README.md").write_text("tiny test pipeline\n")
    return models


def test_whole_pipeline_loads_after_resharding(tmp_path):
    from diffusers import DiffusionPipeline

    models = tiny_pipeline(tmp_path / "pipe")
    result = shard(str(tmp_path / "pipe"), 20_000, output=tmp_path / "out", **SMALL)
    assert {c.name for c in result.components} == {"unet", "vae", "text_encoder"}
    assert all(len(c.shards) >= 2 for c in result.components)
    src, out = tree_digest(tmp_path / "pipe"), tree_digest(tmp_path / "out")
    for rel in ("model_index.json", "scheduler/scheduler_config.json", "tokenizer/vocab.json", "README.md",
                "unet/config.json", "vae/config.json", "text_encoder/config.json"):
        assert out[rel] == src[rel], rel
    assert not any(rel.endswith("diffusion_pytorch_model.safetensors") or rel.endswith("/model.safetensors") for rel in out)
    assert (tmp_path / "out" / "text_encoder" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "out" / "unet" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    # Tokenizers are not needed to load the weights; loading them would need real vocab files.
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "out", tokenizer=None)
    for name, model in models.items():
        assert_state_equal(model, getattr(pipe, name))


def test_cli_pipeline_json_and_one_file_per_component(tmp_path):
    tiny_pipeline(tmp_path / "pipe")
    code, out, err = run_dmap("shard", tmp_path / "pipe", "--max-shard-size", "0", "-o", tmp_path / "out", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["verified"] is True and data["dry_run"] is False
    files = {c["name"]: [f["name"] for f in c["files"]] for c in data["components"]}
    assert files == {"unet": ["diffusion_pytorch_model.safetensors"], "vae": ["diffusion_pytorch_model.safetensors"],
                     "text_encoder": ["model.safetensors"]}
    assert not list((tmp_path / "out").rglob("*.index.json"))
    # the whole model fits in 5GB (the default): one file without an index as well
    code, out, err = run_dmap("shard", tmp_path / "pipe", "-o", tmp_path / "out2", "--quiet")
    assert code == 0, err
    assert "Wrote 3 weight file(s)" in out
    assert not list((tmp_path / "out2").rglob("*.index.json"))


def test_same_input_gives_byte_identical_output(tmp_path):
    tiny_model("tiny-flux", "transformer").save_pretrained(tmp_path / "src")
    limit = limit_for(tmp_path / "src", 3)
    shard(str(tmp_path / "src"), limit, output=tmp_path / "a", **SMALL)
    shard(str(tmp_path / "src"), limit, output=tmp_path / "b", **SMALL)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    index = (tmp_path / "a" / "diffusion_pytorch_model.safetensors.index.json").read_text()
    data = json.loads(index)
    assert index == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert data["metadata"]["total_size"] == sum(
        t.nbytes for t in open_checkpoint(tmp_path / "src" / "diffusion_pytorch_model.safetensors").tensors.values())
    assert data["metadata"]["total_parameters"] == 68484
    # resharding the shards again (index JSON as SOURCE) gives the same bytes once more
    shard(str(tmp_path / "a" / "diffusion_pytorch_model.safetensors.index.json"), limit, output=tmp_path / "c", **SMALL)
    assert dict(tree_digest(tmp_path / "c").items()) == {
        k: v for k, v in tree_digest(tmp_path / "a").items() if k != "config.json"}


def test_oversized_tensor_gets_its_own_shard_and_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"a.small": torch.randn(1000), "b.big": torch.randn(400_000), "c.small": torch.randn(1000)}
    save_file(tensors, tmp_path / "w.safetensors")
    code, out, err = run_dmap("shard", tmp_path / "w.safetensors", "-s", "1MB", "-o", tmp_path / "out")
    assert code == 0, err
    assert "b.big" in out and "larger than the limit" in out
    result = json.loads((tmp_path / "out" / "w.safetensors.index.json").read_text())
    shards = sorted(set(result["weight_map"].values()))
    assert shards == [f"w-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert result["weight_map"]["b.big"] == "w-00002-of-00003.safetensors"
    for name in shards:
        part = load_file(tmp_path / "out" / name)
        for key, value in part.items():
            assert torch.equal(value, tensors[key])
        if "b.big" not in part:
            assert (tmp_path / "out" / name).stat().st_size <= 10**6


def test_dtype_conversion_keeps_integers(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {"w": torch.randn(64, 32), "ids": torch.arange(77, dtype=torch.int64), "h": torch.randn(8).half()}
    save_file(tensors, tmp_path / "m.safetensors")
    result = shard(str(tmp_path / "m.safetensors"), 0, output=tmp_path / "out", dtype="bf16")
    assert result.components[0].converted == 2 and result.verified
    got = load_file(tmp_path / "out" / "m.safetensors")
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], tensors["w"].to(torch.bfloat16))
    assert torch.equal(got["h"], tensors["h"].to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], tensors["ids"])


def test_variant_names_load_with_diffusers(tmp_path):
    from diffusers import UNet2DConditionModel

    model = tiny_model("tiny-sd15", "unet")
    model.save_pretrained(tmp_path / "src")
    result = shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", dtype="fp16", variant="fp16", **SMALL)
    n = len(result.components[0].shards)
    assert n >= 3
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    assert (tmp_path / "out" / f"diffusion_pytorch_model.fp16-00001-of-{n:05d}.safetensors").is_file()
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "out", variant="fp16", torch_dtype=torch.float16)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.half()), key


def test_no_torch_import_when_dtype_is_unchanged(tmp_path):
    """The byte-copy path never imports torch: the model's bytes never pass through tensors."""
    from safetensors.torch import save_file

    save_file({"x": torch.randn(200_000), "y": torch.randn(200_000), "z": torch.randn(200_000)}, tmp_path / "m.safetensors")
    code = (
        "import sys; from dm_cli.model.shard import shard; "
        f"r = shard({str(tmp_path / 'm.safetensors')!r}, '1MB', output={str(tmp_path / 'out')!r}); "
        "assert r.verified and len(r.components[0].shards) == 3; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'numpy' not in sys.modules, 'numpy imported'"  # verification compares with memcmp
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


# --- legacy .bin ------------------------------------------------------------------------------------


def test_legacy_bin_with_shared_tensors(tmp_path):
    from safetensors import safe_open

    shared = torch.randn(16, 8)
    state = {"embed.weight": shared, "lm_head.weight": shared, "bias": torch.randn(8), "steps": torch.tensor(3)}
    (tmp_path / "comp").mkdir()
    torch.save(state, tmp_path / "comp" / "pytorch_model.bin")
    result = shard(str(tmp_path / "comp" / "pytorch_model.bin"), 0, output=tmp_path / "out")
    comp = result.components[0]
    assert comp.dropped == {"lm_head.weight": "embed.weight"}
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "lm_head.weight": "embed.weight"}
        assert sorted(f.keys()) == ["bias", "embed.weight", "steps"]
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), state[key])


class NotATensor:
    """Any user class makes a pickle that weights_only=True refuses."""


def test_legacy_bin_needing_full_unpickling_is_refused(tmp_path):
    torch.save({"w": torch.randn(3), "extra": NotATensor()}, tmp_path / "evil.bin")
    code, out, err = run_dmap("shard", tmp_path / "evil.bin", "-o", tmp_path / "out")
    assert code == 2
    assert "unpickling" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --- bad input: one sentence, exit 2, nothing written -----------------------------------------------


def _valid_pair(folder: Path):
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "m-00001-of-00002.safetensors")
    save_file({"b": torch.ones(4)}, folder / "m-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 32}, "weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}}
    (folder / "m.safetensors.index.json").write_text(json.dumps(index))
    return index


def bad_truncated(folder):
    _valid_pair(folder)
    path = folder / "m-00002-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    return folder / "m.safetensors.index.json"


def bad_offsets_past_end(folder):
    folder.mkdir()
    write_safetensors(folder / "m.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 160]}}, bytes(16))
    return folder / "m.safetensors"


def bad_overlap(folder):
    folder.mkdir()
    write_safetensors(folder / "m.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                 "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24))
    return folder / "m.safetensors"


def bad_missing_shard(folder):
    _valid_pair(folder)
    (folder / "m-00002-of-00002.safetensors").unlink()
    return folder / "m.safetensors.index.json"


def bad_path_outside(folder):
    index = _valid_pair(folder)
    index["weight_map"]["b"] = "../m-00002-of-00002.safetensors"
    (folder / "m.safetensors.index.json").write_text(json.dumps(index))
    return folder / "m.safetensors.index.json"


def bad_tensor_in_two_shards(folder):
    from safetensors.torch import save_file

    _valid_pair(folder)
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, folder / "m-00002-of-00002.safetensors")
    return folder / "m.safetensors.index.json"


def bad_not_a_header(folder):
    folder.mkdir()
    write_safetensors(folder / "m.safetensors", {}, b"", raw_header=b"{not json")
    return folder / "m.safetensors"


@pytest.mark.parametrize("make, words", [
    (bad_truncated, "truncated"),
    (bad_offsets_past_end, "truncated or corrupt"),
    (bad_overlap, "overlap"),
    (bad_missing_shard, "does not exist"),
    (bad_path_outside, "is a path"),
    (bad_tensor_in_two_shards, "also stored"),
    (bad_not_a_header, "cannot be parsed"),
])
def test_bad_checkpoints_exit_2_and_write_nothing(tmp_path, make, words):
    source = make(tmp_path / "src")
    before = tree_digest(tmp_path)
    code, out, err = run_dmap("shard", source, "-o", tmp_path / "out")
    assert code == 2, (out, err)
    assert words in err and err.startswith("Error:") and err.count("\n") == 1, err
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("size, words", [("5 elephants", "Unknown unit"), ("abc", "Cannot read size"),
                                         ("999KB", "below the 1.00 MB minimum"), ("-5GB", "negative")])
def test_bad_sizes_exit_2(tmp_path, size, words):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(4)}, tmp_path / "m.safetensors")
    code, out, err = run_dmap("shard", tmp_path / "m.safetensors", "--max-shard-size", size, "-o", tmp_path / "out")
    assert code == 2 and words in err, err
    assert not (tmp_path / "out").exists()


def test_output_rules(tmp_path):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        shard(str(tmp_path / "src"), 0, output=tmp_path / "exists")
    with pytest.raises(UsageError, match="inside it"):
        shard(str(tmp_path / "src"), 0, output=tmp_path / "src" / "sub")
    with pytest.raises(UsageError, match="contains the source"):
        shard(str(tmp_path / "src"), 0, output=tmp_path, overwrite=True)
    with pytest.raises(SourceError, match="without weights"):
        shard("tiny-flux", 0, output=tmp_path / "p")
    # --overwrite replaces an existing folder only once the new one is complete
    # ... and only a folder dmap could have written (a model folder, frames, or empty): not anybody's folder
    (tmp_path / "exists" / "old.txt").write_text("old")
    with pytest.raises(UsageError, match="a folder dmap did not write"):
        shard(str(tmp_path / "src"), 0, output=tmp_path / "exists", overwrite=True)
    (tmp_path / "exists" / "config.json").write_text("{}")
    result = shard(str(tmp_path / "src"), 0, output=tmp_path / "exists", overwrite=True)
    assert result.verified and not (tmp_path / "exists" / "old.txt").exists()
    assert sorted(p.name for p in (tmp_path / "exists").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    # default output: beside the source
    shard(str(tmp_path / "src"), 0)
    assert (tmp_path / "src-sharded" / "diffusion_pytorch_model.safetensors").is_file()


def test_dry_run_prints_layout_and_writes_nothing(tmp_path):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    before = tree_digest(tmp_path)
    result = shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", dry_run=True, **SMALL)
    assert result.dry_run and len(result.components[0].shards) >= 3
    assert tree_digest(tmp_path) == before and not (tmp_path / "out").exists()
    code, out, err = run_dmap("shard", tmp_path / "src", "--dry-run", "-s", "1MB", "-o", tmp_path / "out")
    assert code == 0 and "dry run" in out and "diffusion_pytorch_model.safetensors" in out, err
    assert tree_digest(tmp_path) == before


# --- faults -----------------------------------------------------------------------------------------


def _assert_nothing_left(tmp_path: Path, src_digest: dict):
    assert tree_digest(tmp_path / "src") == src_digest
    assert not (tmp_path / "out").exists()


def test_full_disk_leaves_nothing(tmp_path, monkeypatch):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    before = tree_digest(tmp_path / "src")
    calls = {"n": 0}
    real = writing.copy_range

    def fill_up(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:  # copies are coalesced into runs: a few calls per shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(writing, "copy_range", fill_up)
    with pytest.raises(DmapError, match="disk filled up"):
        shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", **SMALL)
    _assert_nothing_left(tmp_path, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # the temp folder is gone too


KILL_SCRIPT = """
import sys, time
from dm_cli.model.shard import shard
from dm_cli.model.sharding import writing
real = writing.copy_range
def slow(*a, **k):
    real(*a, **k)
    print("writing", flush=True)
    time.sleep(0.2)
writing.copy_range = slow
shard(sys.argv[1], 25_000, output=sys.argv[2], min_shard_size=1)
"""


def test_sigkill_mid_write_leaves_nothing_and_next_run_cleans_up(tmp_path):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    before = tree_digest(tmp_path / "src")
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out")],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    for _ in range(2):  # a few runs of tensors are written, the rest is not
        assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _assert_nothing_left(tmp_path, before)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.dmap-tmp-")]
    assert len(leftovers) == 1  # hidden, beside the output, never at the output's name
    result = shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", **SMALL)
    assert result.removed_stale == [f"Removed a leftover temporary folder of an interrupted run: {leftovers[0]}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def _flip_after_write(monkeypatch, where, flipped: list, offset=None):
    """Make the byte copies' writes (sharding/copying.py) flip one byte of the first data piece written (not a
    header, which starts the file) after writing it, as a bad disk or a bug would: at `where` in the piece, or at
    the file offset `offset` when a write covers it."""
    real = copying.write_all

    def write_then_flip(fd, data):
        start = os.lseek(fd, 0, os.SEEK_CUR)
        real(fd, data)
        n = len(memoryview(data).cast("B"))
        if flipped or start == 0 or n <= 64:
            return
        at = start + {"first": 0, "middle": n // 2 + 3, "last": n - 1}[where] if offset is None else offset
        if start <= at < start + n:
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
            flipped.append(at)

    monkeypatch.setattr(copying, "write_all", write_then_flip)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("dtype", [None, "fp16"])  # byte comparison, and sha256 of converted tensors
def test_verification_catches_one_flipped_byte_and_moves_nothing(tmp_path, monkeypatch, dtype, where):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    before = tree_digest(tmp_path / "src")
    real = verification._check_run
    flipped = []

    def corrupt_then_check(path, begin, run, expected):
        """Flip one byte of the first sizeable tensor checked, as a bad disk or a bug would."""
        for t in run:
            if t.nbytes > 64 and not flipped:
                at = begin + {"first": 0, "middle": t.nbytes // 2 + 3, "last": t.nbytes - 1}[where]
                with open(path, "r+b") as handle:
                    handle.seek(at)
                    byte = handle.read(1)[0]
                    handle.seek(at)
                    handle.write(bytes([byte ^ 0x01]))
                flipped.append(t.name)
            begin += t.nbytes
        return real(path, begin - sum(t.nbytes for t in run), run, expected)

    if dtype is None:  # byte copies are compared as they are written: corrupt the write itself
        _flip_after_write(monkeypatch, where, flipped)
    else:  # converted tensors are hashed back by the finisher
        monkeypatch.setattr(verification, "_check_run", corrupt_then_check)
    with pytest.raises(CheckpointError, match="differs from the source"):
        shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", dtype=dtype, **SMALL)
    assert flipped
    _assert_nothing_left(tmp_path, before)
    flipped.clear()
    with pytest.raises(CheckpointError, match="differs from the source"):
        shard(str(tmp_path / "src"), 25_000, in_place=True, dtype=dtype, **SMALL)
    assert flipped
    assert tree_digest(tmp_path / "src") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_verification_catches_a_wrong_header(tmp_path, monkeypatch):
    tiny_model("tiny-sd15", "unet").save_pretrained(tmp_path / "src")
    real = verification._check_header

    def swap_shape_then_check(path, shard_file):
        """Rewrite one shape in the written header (same length), as a header bug would."""
        data = bytearray(path.read_bytes())
        at = data.index(b'"shape":[') + len(b'"shape":[')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
        path.write_bytes(bytes(data))
        return real(path, shard_file)

    monkeypatch.setattr(verification, "_check_header", swap_shape_then_check)
    with pytest.raises(CheckpointError, match="conv_in.bias"):  # the header reader or the shape check names it
        shard(str(tmp_path / "src"), 25_000, output=tmp_path / "out", **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("window", [256 << 10, 4096 * 3 + 8])  # the real window, and one that cuts the range
def test_copy_verified_finds_any_flipped_byte(tmp_path, monkeypatch, window):
    """The verified copy itself: an intact copy lands byte for byte and reports nothing; one byte flipped
    after it is written, anywhere (window edges, the last byte, unaligned starts), is reported in the window
    that holds it; a source shorter than the range is an error."""
    monkeypatch.setattr(copying, "VERIFY_WINDOW", window)
    data = os.urandom(100_003)
    (tmp_path / "a").write_bytes(b"x" * 5 + data)
    count = len(data)
    src = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        for pad in (1, 3, 8):  # something before the range, as a header is (a write at 0 is never flipped)
            for at in (None, 0, 1, 4095, 4096, window - 1, window, 2 * window + 1, count - 9, count - 1):
                if at is not None and at >= count:
                    continue
                out = tmp_path / f"b{pad}"
                out.unlink(missing_ok=True)
                flipped = []
                if at is not None:
                    _flip_after_write(monkeypatch, "first", flipped, offset=pad + at)
                dst = os.open(out, os.O_RDWR | os.O_CREAT)
                try:
                    os.write(dst, b"y" * pad)
                    wrong = copying._copy_verified(src, dst, 5, count, pad, Progress())
                finally:
                    os.close(dst)
                    monkeypatch.undo()
                    monkeypatch.setattr(copying, "VERIFY_WINDOW", window)
                if at is None:
                    assert wrong is None and out.read_bytes() == b"y" * pad + data
                else:
                    assert flipped and wrong == at - at % window, (pad, at)
        with pytest.raises(CheckpointError, match="source file ended"):
            copying._copy_verified(src, os.open(tmp_path / "c", os.O_RDWR | os.O_CREAT), 5, count + 1, 0,
                                        Progress())
    finally:
        os.close(src)


def _big_tensors_file(path: Path) -> None:
    """A safetensors file whose tensors span many verification windows (and a tail not a multiple of 8)."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"a.weight": rng.standard_normal(40_000, dtype=np.float32),
               "b.weight": rng.standard_normal(30_001, dtype=np.float32),
               "c.bias": rng.integers(0, 255, 13, dtype=np.uint8)}, path)


def test_tensors_larger_than_the_window_are_copied_and_verified_exactly(tmp_path, monkeypatch):
    """Tensors of many compare windows come out byte for byte, and no descriptor is left open."""
    monkeypatch.setattr(copying, "VERIFY_WINDOW", 4096 * 3 + 8)
    _big_tensors_file(tmp_path / "m.safetensors")
    fds = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else None
    result = shard(str(tmp_path / "m.safetensors"), 100_000, output=tmp_path / "out", **SMALL)
    assert result.verified and len(result.components[0].shards) == 3
    from safetensors.numpy import load_file

    want = load_file(tmp_path / "m.safetensors")
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() and got[k].dtype == want[k].dtype for k in want)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("how", ["no kernel copy", "kernel copy refused mid-run"])
def test_copies_through_the_buffer_are_exact(tmp_path, monkeypatch, how):
    """Without verification, where copy_file_range is missing or refuses (EXDEV: another file system on old
    kernels), tensors larger than the buffer go through it piece by piece and come out byte for byte."""
    monkeypatch.setattr(copying, "BUFFER_BYTES", 4096 * 2 + 3)
    monkeypatch.setattr(copying, "VERIFY_WINDOW", 4096 * 3 + 8)
    if how == "no kernel copy":
        monkeypatch.setattr(copying, "_kernel_copy", False)
    else:
        monkeypatch.setattr(copying, "_kernel_copy", True)  # restored after the run flips it

        def refuse(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    _big_tensors_file(tmp_path / "m.safetensors")
    result = shard(str(tmp_path / "m.safetensors"), 200_000, output=tmp_path / "out", verify=False, **SMALL)
    assert not result.verified and not copying._kernel_copy
    from safetensors.numpy import load_file

    want, got = load_file(tmp_path / "m.safetensors"), {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)


@pytest.mark.parametrize("where", [0, 4096 * 3 + 7, 4096 * 3 + 8, 159_999])  # window edges, the last byte
def test_a_corrupted_copy_is_caught_and_nothing_is_moved(tmp_path, monkeypatch, where):
    """One wrong byte landing anywhere in a tensor that spans many windows fails the verification, which names
    that tensor."""
    monkeypatch.setattr(copying, "VERIFY_WINDOW", 4096 * 3 + 8)
    _big_tensors_file(tmp_path / "m.safetensors")
    header = 8 + json.dumps({"__metadata__": {"format": "pt"}, "a.weight": {
        "dtype": "F32", "shape": [40000], "data_offsets": [0, 160000]}}, separators=(",", ":")).__len__()
    flipped = []
    _flip_after_write(monkeypatch, "first", flipped, offset=header + (-header % 8) + where)  # a.weight: shard 1, first
    with pytest.raises(CheckpointError, match="tensor 'a.weight' in .*00001.* differs from the source"):
        shard(str(tmp_path / "m.safetensors"), 200_000, output=tmp_path / "out", **SMALL)
    assert flipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_in_place_replaces_source_after_verification(tmp_path):
    from diffusers import UNet2DConditionModel

    model = tiny_model("tiny-sd15", "unet")
    model.save_pretrained(tmp_path / "src")
    result = shard(str(tmp_path / "src"), 25_000, in_place=True, **SMALL)
    assert result.verified and result.in_place
    names = sorted(p.name for p in (tmp_path / "src").iterdir())
    n = len(result.components[0].shards)
    assert names == sorted(["config.json", "diffusion_pytorch_model.safetensors.index.json"] + [
        f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert_state_equal(model, UNet2DConditionModel.from_pretrained(tmp_path / "src"))
    # and back to one file, in place again
    shard(str(tmp_path / "src"), 0, in_place=True)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert_state_equal(model, UNet2DConditionModel.from_pretrained(tmp_path / "src"))

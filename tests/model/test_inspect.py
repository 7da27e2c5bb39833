"""`dmap inspect`: exact sizes for every preset, other pipeline families, weights, bad input."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PRESETS, REPO, run_dmap

from dm_cli.errors import SourceError
from dm_cli.model.inspection import inspect_source
from dm_cli.model.sources import PRESETS as PRESET_NAMES

SIZES = json.loads((REPO / "tests" / "sizes.json").read_text())
FOLDER_TO_PRESET = {folder: name for name, folder in reversed(list(PRESET_NAMES.items()))}


@pytest.mark.parametrize("folder", sorted(SIZES))
def test_every_preset_matches_reference_sizes(folder):
    report = inspect_source(FOLDER_TO_PRESET[folder])
    got = {c.name: c for c in report.components}
    assert set(got) == set(SIZES[folder])
    for name, expected in SIZES[folder].items():
        assert got[name].cls == expected["class"]
        assert got[name].params == expected["params"], name
        assert got[name].no_split_modules == expected["no_split_modules"], name


def test_flux_json_exact_numbers():
    code, out, err = run_dmap("inspect", "flux", "--json")
    assert code == 0, err
    data = {c["name"]: c for c in json.loads(out)["components"]}
    assert data["transformer"]["params"] == 11_901_408_320
    assert data["text_encoder_2"]["params"] == 4_762_310_656
    assert data["text_encoder"]["params"] == 123_060_480
    assert data["vae"]["params"] == 83_819_683
    assert data["transformer"]["bytes"] == 23_802_816_640
    assert data["text_encoder_2"]["bytes"] == 9_524_621_312
    assert data["text_encoder"]["bytes"] == 246_121_576  # 77 int64 position ids stay int64
    assert data["transformer"]["largest_block"]["class"] == "FluxTransformerBlock"
    assert data["transformer"]["num_blocks"] == 19 + 38


def test_dtype_rules():
    """fp32 doubles floats; integer buffers never cast; T5 keeps `wo` in fp32 at fp16 only."""
    bf16 = {c.name: c for c in inspect_source("flux").components}
    fp32 = {c.name: c for c in inspect_source("flux", dtype="float32").components}
    fp16 = {c.name: c for c in inspect_source("flux", dtype="float16").components}
    assert fp32["transformer"].bytes == 2 * bf16["transformer"].bytes
    assert fp32["text_encoder"].bytes == 123_060_480 * 4 + 77 * 8
    wo_params = 24 * 10240 * 4096  # T5-XXL: 24 blocks, wo: d_ff x d_model
    assert fp16["text_encoder_2"].bytes == bf16["text_encoder_2"].bytes + 2 * wo_params
    sd3 = {c.name: c for c in inspect_source("sd3").components}
    assert sd3["transformer"].bytes == 4_169_902_208  # persistent pos_embed buffer is counted


def test_depth_and_component():
    report = inspect_source("sdxl", component="unet", depth=1)
    assert [c.name for c in report.components] == ["unet"]
    names = [row["name"] for row in report.components[0].tree]
    assert "down_blocks" in names and "mid_block" in names and "up_blocks" in names
    assert sum(r["bytes"] for r in report.components[0].tree) == report.components[0].bytes
    with pytest.raises(SourceError, match="no component 'transformer'"):
        inspect_source("sdxl", component="transformer")


def test_other_pipeline_family_from_config_only(tmp_path):
    """A family dmap has no preset for: a PixArt-style pipeline written by the test."""
    root = tmp_path / "pixart"
    (root / "transformer").mkdir(parents=True)
    (root / "vae").mkdir()
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "PixArtAlphaPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "PixArtTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "DPMSolverMultistepScheduler"], "tokenizer": ["transformers", "T5Tokenizer"],
    }))
    (root / "transformer" / "config.json").write_text(json.dumps({
        "_class_name": "PixArtTransformer2DModel", "num_layers": 2, "num_attention_heads": 2,
        "attention_head_dim": 8, "in_channels": 4, "out_channels": 8, "sample_size": 8,
        "cross_attention_dim": 16, "caption_channels": 32, "norm_type": "ada_norm_single",
    }))
    shutil.copy(PRESETS / "tiny-sd15" / "vae" / "config.json", root / "vae" / "config.json")
    report = inspect_source(str(root))
    assert report.pipeline_class == "PixArtAlphaPipeline"
    comps = {c.name: c for c in report.components}
    assert set(comps) == {"transformer", "vae"}

    import torch
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel.from_config(json.loads((root / "transformer" / "config.json").read_text()))
    assert comps["transformer"].params == sum(p.numel() for p in model.parameters())
    assert comps["transformer"].largest_block.cls == "BasicTransformerBlock"
    expected = sum(p.numel() * 2 for p in model.parameters()) + sum(
        b.numel() * (2 if b.is_floating_point() else b.element_size()) for b in model.buffers())
    assert comps["transformer"].bytes == expected
    del torch


def _save_tiny_unet(folder: Path, shards: bool):
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(PRESETS / "tiny-sd15" / "unet"))
    unet.save_pretrained(folder, max_shard_size="20KB" if shards else "10GB")
    return unet


def test_weights_folder_reads_stored_dtype_and_validates(tmp_path):
    unet = _save_tiny_unet(tmp_path / "unet", shards=True)
    report = inspect_source(str(tmp_path / "unet"))
    comp = report.components[0]
    assert comp.dtype == "float32"  # stored dtype, not bf16
    assert comp.bytes == sum(p.numel() for p in unet.parameters()) * 4
    assert report.problems == []
    code, out, err = run_dmap("inspect", tmp_path / "unet")
    assert code == 0 and "agree" in out


def test_checkpoint_problems_are_reported_by_file_and_tensor(tmp_path):
    _save_tiny_unet(tmp_path / "unet", shards=True)
    index_path = tmp_path / "unet" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"]["ghost.weight"] = index["weight_map"][name]  # listed, not stored
    del index["weight_map"][name]  # stored, not listed
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))
    report = inspect_source(str(tmp_path / "unet"))
    text = "\n".join(report.problems)
    assert "[ghost.weight]: listed in the index but missing from the shard" in text
    assert f"[{name}]: in the shard but not listed in the index" in text
    assert "total_size" in text
    code, out, err = run_dmap("inspect", tmp_path / "unet")
    assert code == 2 and "ghost.weight" in err


def _write_sparse_safetensors(path: Path, size_bytes: int):
    numel = size_bytes // 2
    header = json.dumps({"big.weight": {"dtype": "BF16", "shape": [numel], "data_offsets": [0, numel * 2]},
                         "__metadata__": {"format": "pt"}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + numel * 2)


def test_large_safetensors_reads_only_the_header(tmp_path):
    path = tmp_path / "big.safetensors"
    _write_sparse_safetensors(path, 1_200_000_000)
    code = (
        "import sys, json\n"
        "from dm_cli.model.inspection import inspect_source\n"
        "def io():\n"
        "    return {k: int(v) for k, v in (l.split(': ') for l in open('/proc/self/io'))}\n"
        f"before = io(); report = inspect_source({str(path)!r}); after = io()\n"
        "print(json.dumps({'rchar': after['rchar'] - before['rchar'], 'bytes': report.components[0].bytes}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bytes"] == 1_200_000_000
    assert result["rchar"] < 1_000_000


def test_warm_inspect_does_not_import_torch(tmp_path):
    env = {"DMAP_CACHE_DIR": str(tmp_path / "cache")}
    assert run_dmap("inspect", "sd15", env=env)[0] == 0  # cold: builds and caches skeletons
    code = "import sys; from dm_cli.cli import main\ntry:\n    main(['inspect', 'sd15', '--json'])\nexcept SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert proc.stderr.strip().endswith("NO-TORCH"), proc.stderr
    assert json.loads(proc.stdout)["total"]["params"] > 0


def test_help_does_not_import_torch():
    """Nor any other heavy library (the imports inside functions that stay there keep it so, issue 39)."""
    heavy = ["torch", "numpy", "PIL", "safetensors", "diffusers", "transformers"]
    code = ("import sys; from dm_cli.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', [name for name in {heavy!r} if name in sys.modules], file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stderr.strip().endswith("LOADED []"), proc.stderr
    assert "inspect" in proc.stdout


def _hub_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-flux"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(PRESETS / "tiny-flux", repo / "snapshots" / commit)
    return cache


def test_hub_repo_id_from_local_cache(tmp_path):
    env = {"HF_HUB_CACHE": str(_hub_cache(tmp_path)), "HF_HUB_OFFLINE": "1"}
    code, out, err = run_dmap("inspect", "acme/tiny-flux", "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["total"]["params"] == sum(v["params"] for v in SIZES["tiny-flux"].values())
    code, out, err = run_dmap("inspect", "acme/tiny-flux/transformer", "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["components"][0]["params"] == SIZES["tiny-flux"]["transformer"]["params"]
    code, out, err = run_dmap("inspect", "acme/not-cached", env=env)
    assert code == 2 and "HF_HUB_OFFLINE" in err and "Traceback" not in err


def _pipeline_copy(tmp_path):
    root = tmp_path / "pipe"
    shutil.copytree(PRESETS / "tiny-sd15", root)
    return root


def _truncated(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    return path


def _bad_json_header(tmp_path):
    path = tmp_path / "j.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    return path


def _offsets_past_end(tmp_path):
    path = tmp_path / "o.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    return path


def _index(tmp_path, shard_name):
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / "config.json").write_text((PRESETS / "tiny-sd15" / "unet" / "config.json").read_text())
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 4}, "weight_map": {"w": shard_name}}))
    return index


BAD_INPUTS = {
    "unknown source": (lambda p: "no-such-model", "Unknown SOURCE"),
    "missing component config": (lambda p: (os.remove(_pipeline_copy(p) / "unet" / "config.json"), p / "pipe")[1],
                                 "no config.json"),
    "malformed model_index": (lambda p: ((_pipeline_copy(p) / "model_index.json").write_text("{oops"), p / "pipe")[1],
                              "malformed JSON"),
    "class in neither library": (
        lambda p: ((_pipeline_copy(p) / "unet" / "config.json").write_text('{"_class_name": "NoSuchNet2D"}'),
                   p / "pipe" / "unet")[1],
        "NoSuchNet2D"),
    "truncated header": (_truncated, "truncated"),
    "corrupt header json": (_bad_json_header, "cannot be parsed"),
    "shard path with slash": (lambda p: _index(p, "../evil.safetensors"), "is a path"),
    "shard path with dotdot": (lambda p: _index(p, ".."), "is a path"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_sentence_exit_2(case, tmp_path):
    make, expected = BAD_INPUTS[case]
    target = make(tmp_path)
    code, out, err = run_dmap("inspect", target, "--no-cache")
    assert code == 2, (out, err)
    assert expected in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run_dmap("inspect", target, "--no-cache", "--debug")
    assert code == 2 and "Traceback" in err


CHECKPOINT_PROBLEMS = {  # listed (every one, by file and tensor) rather than raised: exit 2, no traceback
    "offsets past end": (_offsets_past_end, "truncated or corrupt"),
    "index names missing shard": (lambda p: _index(p, "missing.safetensors"), "does not exist"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_PROBLEMS))
def test_checkpoint_problems_are_listed_exit_2(case, tmp_path):
    make, expected = CHECKPOINT_PROBLEMS[case]
    code, out, err = run_dmap("inspect", make(tmp_path), "--no-cache")
    assert code == 2, (out, err)
    assert "1 checkpoint problem(s)" in err and expected in err and "Traceback" not in err


def test_every_checkpoint_problem_is_listed(tmp_path):
    """Two missing shards, a truncated one and index disagreements: all of them, not the first."""
    _save_tiny_unet(tmp_path / "unet", shards=True)
    folder = tmp_path / "unet"
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    (folder / shards[0]).unlink()
    (folder / shards[1]).unlink()
    with open(folder / shards[2], "r+b") as handle:  # cut the last tensor short
        handle.truncate((folder / shards[2]).stat().st_size - 4)
    kept = [n for n, s in index["weight_map"].items() if s == shards[3]][0]
    index["weight_map"]["ghost.weight"] = shards[3]
    del index["weight_map"][kept]
    index_path.write_text(json.dumps(index))
    report = inspect_source(str(folder))
    text = "\n".join(report.problems)
    assert f"{shards[0]}: does not exist" in text and f"{shards[1]}: does not exist" in text
    assert f"{shards[2]} [" in text and "truncated" in text
    assert "[ghost.weight]: listed in the index but missing" in text and f"[{kept}]: in the shard but not listed" in text
    code, out, err = run_dmap("inspect", folder, "--json")
    assert code == 2 and json.loads(out)["problems"] == report.problems
    assert all(problem in err for problem in report.problems)
    code, out, err = run_dmap("plan", folder, "-m", "cpu=1GB", "--height", "0")
    assert code == 2 and f"{len(report.problems)} checkpoint problem(s)" in err and shards[1] in err

"""A queue shared by torchrun ranks (`dmap run --prompts` under torchrun, each rank its own items) with a step cache,
a LoRA and fp8 weights: every file is the one process's queue's, byte for byte (metadata included)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

REPO = Path(__file__).resolve().parents[2]


def test_a_queue_on_two_ranks_with_magcache_a_lora_and_fp8_is_one_process_byte_for_byte(tmp_path):
    from conftest import run_dmap
    from test_lora import make_lora

    from dm_cli.io.outputs import read_metadata
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path / "tiny-flux", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", tmp_path / "lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    queue = tmp_path / "queue.txt"
    queue.write_text("a red fox\na blue owl\n")
    args = ["run", str(folder), "--prompts", str(queue), "--height", "32", "--width", "32", "--steps", "8",
            "--dtype", "float32", "--cache", "magcache", "--lora", f"{lora}:0.7", "--weights", "fp8", "--quiet"]
    code, _, err = run_dmap(*args, "--output", tmp_path / "one")
    assert code == 0, err
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dm_cli", *args, "--output", str(tmp_path / "ranks")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    names = sorted(p.name for p in (tmp_path / "one").glob("*.png"))
    assert len(names) == 2 and names == sorted(p.name for p in (tmp_path / "ranks").glob("*.png"))
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "ranks" / name).read_bytes(), name
    meta = read_metadata(tmp_path / "ranks" / names[0])
    assert meta["step_cache"].startswith("magcache") and "lora" in meta and "lora_fused" not in meta  # fp8: unfused
    records = [json.loads(line) for line in (tmp_path / "ranks" / "manifest.jsonl").read_text().splitlines()]
    assert {record["rank"] for record in records} == {0, 1}  # each rank made one of the two

"""Benchmark: one image on 1 rank against 2 torchrun ranks sharing each step (`dmap run --parallel`).

- CFG-parallel: the mid-size SD 1.5-architecture bench pipeline of scripts/bench_run.py (UNet ~77M parameters,
  fp32, CFG 7.5: every step runs the UNet on a doubled batch, which the two ranks split), 256x256 (--cfg-size).
- Context parallel (Ulysses 2): the UNet has no `_cp_plan`, so a mid-size FLUX.1-architecture twin built here
  (transformer 512 wide, 8 heads, 2 double + 4 single blocks, ~36M parameters; a 4-level VAE, 16 latent channels;
  tiny-flux's text encoders), 512x512 (--context-size, 1024 image + 64 text tokens), max_sequence_length 64.

Every run is a fresh subprocess with one torch thread per rank (OMP_NUM_THREADS=1): `python ENTRY run ... --json`
for 1 rank, `python -m torch.distributed.run --standalone --nproc-per-node 2 ENTRY run ... --parallel X --json`
for 2; kinds alternate, --repeats times each, after one warm-up run of each (dmap's trace cache, the page cache).

Columns (medians): "denoise s" is the denoise stage's run time as rank 0 reports it (what the ranks share);
"in-process s" is every stage's load and run time (encode, denoise, decode: from the first load to the decoded
image, after imports and planning; ENTRY imports the libraries and the model classes first, `ENTRY` below); "process s" is the whole launch on the clock (interpreter, imports, planning,
torchrun's start-up for 2 ranks, exit). Ratios are 1 rank / 2 ranks. The pixels of 2 ranks are compared with 1
rank's (largest difference of 255). The machine's load average is printed before and after: two ranks need two
free cores.

Usage: .venv/bin/python scripts/bench_parallel.py [--repeats N] [--steps N] [--cfg-size 256] [--context-size 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_run import GUIDANCE, PROMPT, SEED, build_pipeline  # noqa: E402 - the same mid-size pipeline

REPO = Path(__file__).resolve().parents[1]
FLUX_TRANSFORMER = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24],
                    "in_channels": 64, "joint_attention_dim": 32, "num_attention_heads": 8, "num_layers": 2,
                    "num_single_layers": 4, "patch_size": 1, "pooled_projection_dim": 32, "guidance_embeds": True}
FLUX_VAE = {"_class_name": "AutoencoderKL", "block_out_channels": [16, 32, 32, 32], "in_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "latent_channels": 16, "layers_per_block": 1, "norm_num_groups": 8, "out_channels": 3,
            "sample_size": 512, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_post_quant_conv": False,
            "use_quant_conv": False}


def build_flux(folder: Path) -> Path:
    """The mid-size FLUX twin with random weights (fixed seed): tiny-flux's configs, a wider transformer and VAE."""
    if (folder / "model_index.json").is_file():
        return folder
    import shutil

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(PRESETS_DIR / "tiny-flux", staging)
    (staging / "transformer" / "config.json").write_text(json.dumps(FLUX_TRANSFORMER, indent=2))
    (staging / "vae" / "config.json").write_text(json.dumps(FLUX_VAE, indent=2))
    write_random_pipeline(staging, staging, seed=0)
    os.replace(staging, folder)
    return folder


# What each launched process imports before dmap's CLI runs: the libraries and the model classes diffusers imports
# lazily (about 1 s on this machine, inside the first load otherwise), so that "in-process" starts after imports
# as it says, the same rule as bench_run.py's shared imports. The process column still counts them.
ENTRY = """import runpy, sys
import torch, diffusers, transformers
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, T5EncoderModel
sys.argv[0] = "dmap"
runpy.run_module("dm_cli", run_name="__main__", alter_sys=False)
"""


def _launch(folder: Path, ranks: int, parallel: str, size: int, steps: int, out: Path, extra: list[str]) -> dict:
    """One image: the run's JSON plus the process wall time."""
    entry = out.parent / "entry.py"
    if not entry.is_file():
        entry.write_text(ENTRY)
    run = [str(entry), "run", str(folder), "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(steps),
           "--height", str(size), "--width", str(size), "--output", str(out), "--overwrite", "--json", *extra]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *run,
                   "--parallel", parallel]
    else:
        command = [sys.executable, *run]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    stages = {s["name"]: s for s in result["stages"]}
    return {"denoise": sum(s["run_s"] for n, s in stages.items() if n == "denoise"),
            "in_process": sum(s["load_s"] + s["run_s"] for s in result["stages"]), "process": wall,
            "notices": result["notices"]}


CEILING = """import sys, time, torch, diffusers
torch.set_num_threads(1)
unet = diffusers.UNet2DConditionModel.from_pretrained(sys.argv[1], subfolder="unet").eval()
side = int(sys.argv[2]) // 8
for batch in (2, 1):
    x, e = torch.randn(batch, 4, side, side), torch.randn(batch, 77, unet.config.cross_attention_dim)
    with torch.no_grad():
        unet(x, 10, e)
        start = time.perf_counter()
        for _ in range(5):
            unet(x, 10, e)
    print((time.perf_counter() - start) / 5)
"""


def _cfg_ceiling(folder: Path, size: int) -> tuple[float, float]:
    """(seconds of one UNet forward at batch 2, at batch 1), one thread: CFG-parallel's two ranks each run batch 1
    where one rank runs batch 2, so their ratio bounds the denoise speed-up, whatever the exchange costs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CEILING, str(folder), str(size)], capture_output=True, text=True,
                          env=env, check=True)
    two, one = (float(line) for line in proc.stdout.split())
    return two, one


def _pixels(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image).astype(int)


def _case(name: str, folder: Path, parallel: str, size: int, steps: int, repeats: int, tmp: Path, extra: list[str]):
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for ranks in (1, 2):  # warm-up: trace cache, page cache
        _launch(folder, ranks, parallel, size, 1, tmp / f"{name}-warm.png", extra)
    for i in range(repeats):
        for ranks in (1, 2):
            runs[ranks].append(_launch(folder, ranks, parallel, size, steps, tmp / f"{name}-{ranks}-{i}.png", extra))
    difference = max(int(abs(_pixels(tmp / f"{name}-1-{i}.png") - _pixels(tmp / f"{name}-2-{i}.png")).max())
                     for i in range(repeats))
    assert any("over 2 torchrun ranks" in n for n in runs[2][0]["notices"]), runs[2][0]["notices"]
    return runs, difference


def _row(title: str, runs: dict, difference: int) -> str:
    cells = []
    for key in ("denoise", "in_process", "process"):
        one, two = (statistics.median(r[key] for r in runs[n]) for n in (1, 2))
        cells.append(f"{one:.2f} / {two:.2f} = {one / two:.2f}x")
    return f"| {title} | " + " | ".join(cells) + f" | {difference} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cfg-size", type=int, default=256)
    parser.add_argument("--context-size", type=int, default=512)
    parser.add_argument("--model-dir", default=None, help="where to build (or find) the bench pipelines")
    options = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    models = Path(options.model_dir or tmp)
    sd15, flux = build_pipeline(models / "sd15-mid"), build_flux(models / "flux-mid")  # outside any timing
    # dm_cli's bytecode, as a wheel install has it (see bench_run.py)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "dm_cli")], check=True, stdout=subprocess.DEVNULL)
    load_before = os.getloadavg()
    cfg = _case("cfg", sd15, "cfg", options.cfg_size, options.steps, options.repeats, tmp,
                ["--guidance-scale", str(GUIDANCE)])
    context = _case("context", flux, "context", options.context_size, options.steps, options.repeats, tmp,
                    ["--max-sequence-length", "64"])
    load_after = os.getloadavg()
    print(f"{options.steps} steps, seed {SEED}, CPU, one torch thread per rank, {os.cpu_count()} cores; medians of "
          f"{options.repeats} runs each (subprocesses, alternating); load average (1, 5, 15 min) "
          f"{', '.join(f'{x:.1f}' for x in load_before)} before, {', '.join(f'{x:.1f}' for x in load_after)} after\n")
    print("| layout | denoise s: 1 rank / 2 ranks | in-process s | process s | largest pixel difference |")
    print("|---|---|---|---|---|")
    print(_row(f"CFG-parallel, SD 1.5-arch UNet ~77M, {options.cfg_size}x{options.cfg_size}", *cfg))
    print(_row(f"context parallel (Ulysses 2), FLUX-arch ~36M, {options.context_size}x{options.context_size}",
               *context))
    two, one = _cfg_ceiling(sd15, options.cfg_size)
    print(f"\nCFG-parallel's ceiling on this machine: one UNet forward at batch 2 takes {two:.3f} s, at batch 1 "
          f"{one:.3f} s, so two ranks can denoise at most {two / one:.2f}x faster than one.")


if __name__ == "__main__":
    main()

"""Benchmark: `dmap run` vs diffusers' own pipeline call vs the hand-written staged recipe.

A mid-size Stable Diffusion 1.5-architecture pipeline with random weights (UNet at 3/10 of SD 1.5's
widths, ~77M parameters, fp32; a 4-layer CLIP text encoder; a small VAE), 128x128, classifier-free
guidance 7.5, seed 0, on the CPU, at 8 and at 50 denoising steps: the denoiser dominates (each step
runs the UNet on a batch of 2). Every run is a fresh subprocess; kinds alternate, REPEATS times each,
all in one invocation; the PNGs are compared pixel for pixel with diffusers' own call.

Rows:
- diffusers' own pipeline call: `StableDiffusionPipeline.from_pretrained(folder)(prompt, ...)`;
- the diffusers "distributed inference" recipe written by hand (encode, free, denoise from embeddings,
  free, decode);
- `dmap run` planning inline (warm cache), what a user types;
- the same with `--track-activations`: the op-by-op activation tracker that plain CPU runs used before
  (it runs during encode, decode and the first 2 denoising steps).

Columns: "in-process" starts after the same imports on every side (torch, diffusers, transformers;
dmap's own modules too for dmap) and ends when the PNG is written: loading, planning, encode, every
denoising step, decode, rendering the summary. "CPU s" is the CPU time (user + system) of that part:
with one torch thread it is the work itself, and it barely moves when other jobs share the machine,
where wall time moves by tens of percent; "wall s" is the same part on the clock; "process s" is
the whole subprocess (interpreter start, imports, exit). Ratios are against diffusers' own call in
the same column and step count; medians over the runs.

torch runs on ONE intra-op thread by default (--threads N to change; 0 = torch's default), so a
neighbour on another core does not turn thread barriers into noise.

Usage: .venv/bin/python scripts/bench_run.py [--repeats N] [--threads N] [--steps 8,50]
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

PROMPT, SEED, SIZE, GUIDANCE = "a red fox in the snow", 0, 128, 7.5
UNET_WIDTHS = [96, 192, 384, 384]
CROSS_DIM = 384

CONFIGS = {
    "model_index": {
        "_class_name": "StableDiffusionPipeline", "feature_extractor": [None, None], "safety_checker": [None, None],
        "image_encoder": [None, None], "requires_safety_checker": False, "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
    },
    "scheduler": {
        "_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
        "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
        "trained_betas": None,
    },
    "text_encoder": {
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "bos_token_id": 0, "eos_token_id": 2,
        "pad_token_id": 1, "hidden_act": "quick_gelu", "hidden_size": CROSS_DIM, "intermediate_size": 4 * CROSS_DIM,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "num_attention_heads": 6, "num_hidden_layers": 4,
        "projection_dim": CROSS_DIM, "vocab_size": 1000,
    },
    "unet": {
        "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8, "block_out_channels": UNET_WIDTHS,
        "center_input_sample": False, "cross_attention_dim": CROSS_DIM,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
        "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 16,
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    },
    "vae": {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [32, 64, 64, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4, "in_channels": 3,
        "out_channels": 3, "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 32, "sample_size": SIZE,
        "scaling_factor": 0.18215,
    },
}

# The same imports on every side before the in-process clock starts.
PRELUDE = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch
if THREADS:
    torch.set_num_threads(THREADS)
import diffusers, transformers
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
diffusers.utils.logging.set_verbosity_error(); diffusers.utils.logging.disable_progress_bar()
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer
"""

DONE = r"""
wall = time.perf_counter() - t
cpu = sum(os.times()[:2]) - cpu0
print(json.dumps({"wall": wall, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

DMAP = r"""
from dm_cli.cli import main  # dmap's own modules: outside the in-process clock, inside the process one
import dm_cli.cli.run, dm_cli.planning.make, dm_cli.render.plan, dm_cli.render.run, dm_cli.run.request
t, cpu0 = time.perf_counter(), sum(os.times()[:2])
try:
    main(ARGS)
except SystemExit as done:
    if done.code:
        sys.exit(done.code)
""" + DONE

DIFFUSERS_CALL = r"""
t, cpu0 = time.perf_counter(), sum(os.times()[:2])
pipe = StableDiffusionPipeline.from_pretrained(FOLDER)
pipe.set_progress_bar_config(disable=True)
image = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
             generator=torch.Generator().manual_seed(SEED)).images[0]
image.save(OUT)
""" + DONE

# diffusers' "distributed inference" recipe, written by hand for this pipeline.
RECIPE = r"""
import gc
t, cpu0 = time.perf_counter(), sum(os.times()[:2])
pipe = StableDiffusionPipeline.from_pretrained(FOLDER, unet=None, vae=None)
with torch.no_grad():
    pe, npe = pipe.encode_prompt(PROMPT, "cpu", 1, GUIDANCE > 1, None)
del pipe; gc.collect()
unet = UNet2DConditionModel.from_pretrained(FOLDER, subfolder="unet")
pipe = StableDiffusionPipeline.from_pretrained(FOLDER, text_encoder=None, tokenizer=None, vae=None, unet=unet)
pipe.vae_scale_factor = 2 ** (len(AutoencoderKL.load_config(FOLDER, subfolder="vae")["block_out_channels"]) - 1)
pipe.set_progress_bar_config(disable=True)
latents = pipe(prompt_embeds=pe, negative_prompt_embeds=npe, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
               height=SIZE, width=SIZE, output_type="latent", generator=torch.Generator().manual_seed(SEED)).images
del pipe, unet; gc.collect()
vae = AutoencoderKL.from_pretrained(FOLDER, subfolder="vae")
with torch.no_grad():
    image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
from diffusers.image_processor import VaeImageProcessor
VaeImageProcessor(vae_scale_factor=8).postprocess(image, output_type="pil", do_denormalize=[True])[0].save(OUT)
""" + DONE

BASE_ROW = "diffusers pipeline call (from_pretrained + __call__)"


def build_pipeline(folder: Path) -> Path:
    """The bench pipeline with random weights (fixed seed), built once."""
    if (folder / "model_index.json").is_file():
        return folder
    from dm_cli.model.demo import write_configs, write_random_pipeline

    staging = folder.with_name(folder.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    write_configs(CONFIGS, staging)
    write_random_pipeline(staging, staging, seed=0)
    os.replace(staging, folder)
    return folder


def _run_args(folder: Path, steps: int, out: str, device_map: str | None) -> list[str]:
    args = ["run", str(folder), "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(steps), "--height", str(SIZE),
            "--width", str(SIZE), "--guidance-scale", str(GUIDANCE), "--output", out, "--overwrite"]
    return args + (["--device-map", device_map] if device_map else [])


def _once(code: str, folder: Path, steps: int, out: str, threads: int, args: list[str] | None = None) -> dict:
    header = (f"PROMPT, SEED, STEPS, SIZE, GUIDANCE, FOLDER, OUT, THREADS, ARGS = {PROMPT!r}, {SEED}, {steps}, "
              f"{SIZE}, {GUIDANCE}, {str(folder)!r}, {out!r}, {threads}, {args!r}\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", header + PRELUDE + code], capture_output=True, text=True, check=False,
                          env={**os.environ, "COLUMNS": "120"})
    process_wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = process_wall
    return result


def _pixels(path: str):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (0: torch default)")
    parser.add_argument("--steps", default="8,50", help="comma-separated step counts")
    parser.add_argument("--model-dir", default=None, help="where to build (or find) the bench pipeline")
    options = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-run-"))
    threads = options.threads
    step_counts = [int(s) for s in options.steps.split(",")]
    folder = build_pipeline(Path(options.model_dir or tmp / "sd15-mid"))  # outside any timing
    kinds = {
        BASE_ROW: lambda steps, out: _once(DIFFUSERS_CALL, folder, steps, out, threads),
        "diffusers staged recipe (hand-written)": lambda steps, out: _once(RECIPE, folder, steps, out, threads),
        "dmap run (plans inline, warm cache)":
            lambda steps, out: _once(DMAP, folder, steps, out, threads, _run_args(folder, steps, out, None)),
        "dmap run --track-activations (per-op tracker, the old CPU default)":
            lambda steps, out: _once(DMAP, folder, steps, out, threads,
                                     _run_args(folder, steps, out, None) + ["--track-activations"]),
    }
    warm = str(tmp / "warm.png")  # warms dmap's cache and the OS page cache
    _once(DMAP, folder, 1, warm, threads, _run_args(folder, 1, warm, None))
    _once(DIFFUSERS_CALL, folder, 1, warm, threads)
    runs = {(steps, k): [] for steps in step_counts for k in kinds}
    outputs: dict[tuple, str] = {}
    for i in range(options.repeats):
        for steps in step_counts:
            for n, (kind, call) in enumerate(kinds.items()):
                out = str(tmp / f"{steps}-{n}-{i}.png")
                runs[(steps, kind)].append(call(steps, out))
                outputs.setdefault((steps, kind), out)
    import numpy as np

    print(f"SD 1.5-architecture pipeline, random weights: UNet widths {UNET_WIDTHS} (fp32), {SIZE}x{SIZE}, CFG "
          f"{GUIDANCE}, seed {SEED}, CPU, torch threads {threads or 'default'}; {options.repeats} runs of each "
          "(subprocesses, alternating)\n")
    print("| steps | runner | in-process CPU s | ratio | in-process wall s | ratio | process wall s | ratio "
          "| peak RSS | same pixels |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for steps in step_counts:
        reference = _pixels(outputs[(steps, BASE_ROW)])
        med = {(k, col): statistics.median(r[col] for r in runs[(steps, k)]) for k in kinds
               for col in ("cpu", "wall", "process")}
        rss = {k: max(r["rss"] for r in runs[(steps, k)]) for k in kinds}
        for k in kinds:
            same = "yes" if np.array_equal(_pixels(outputs[(steps, k)]), reference) else "NO"
            cells = " | ".join(f"{med[(k, col)]:.2f} | {med[(k, col)] / med[(BASE_ROW, col)]:.3f}"
                               for col in ("cpu", "wall", "process"))
            print(f"| {steps} | {k} | {cells} | {rss[k] / 1e6:.0f} MB | {same} |")

if __name__ == "__main__":
    main()

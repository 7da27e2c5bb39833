"""Benchmark: a queue of prompts, staged. dmap's queue vs a loop of `dmap run` vs the diffusers staged recipe
looped per prompt; and the same queue on 2 torchrun ranks vs 1.

The bench writes a mid-size FLUX-architecture pipeline with RANDOM weights (fp32, ~0.7 GB: loading
it is a real part of each prompt's cost, as tens of GB are for a real FLUX) into a temporary folder,
plans it once in staged mode (`dmap plan --mode staged --output plan.json`), then runs, each as a
fresh subprocess with ONE torch thread (OMP_NUM_THREADS=1), in one invocation:

1. the diffusers "distributed inference" recipe written by hand (load the text encoders, encode,
   free; load the transformer, denoise, free; load the VAE, decode), looped over the prompts in one
   process: what a user scripts without dmap;
2. a shell loop of `dmap run --prompt P_i --seed S+i --device-map plan.json`, one process per prompt;
3. `dmap run --prompts queue.txt --device-map plan.json`: one process, stage-major (one chunk);
4. the same queue under `torchrun --standalone --nproc-per-node 1` and `--nproc-per-node 2`
   (`--rank-steps` denoising steps, default more than above: with 2 cores, 2 ranks can only help
   the part of the work that is not loading, see docs/performance.md).

"process s" is the wall time of the whole subprocess(es) (interpreter start, imports, exit: what a
user waits for); "in-process s" starts after the imports (for the recipe: its own clock; for dmap:
the `seconds` the queue reports, which includes planning/reading the plan and loading; "—" for the
`dmap run` loop, whose runs report only their stages, not resolving the source or writing the PNG, so
no like-for-like clock exists). Ratios are speed-ups over the recipe loop
(rows 1-3) or over 1 rank (row 4). Every image is compared pixel for pixel with the recipe's.

`--cold` evicts the weight files from the OS page cache (posix_fadvise DONTNEED) before each prompt of the
recipe, before each `dmap run` of the loop and before each queue run, so every load reads from disk: what
happens when the weights do not fit in RAM (FLUX.2 [dev] is 111 GB in bf16). Without it every load after
the first is a copy from the page cache.

The machine this runs on may be shared: noise only adds time, so rerun when numbers look odd.

Usage: .venv/bin/python scripts/bench_queue.py [--model midsize|large] [--cold] [--part all|queue|ranks]
       [--prompts 8] [--steps 2] [--rank-steps 6] [--size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a mountain lake", "a city at night",
           "an old sailing ship", "a field of sunflowers", "a robot reading a book", "a cat on a windowsill",
           "a desert canyon", "a snowy village", "a forest path"]
SEED, GUIDANCE, MAX_SEQ = 100, 3.5, 64

# The demo's FLUX.1 architecture, wider and deeper: ~170M parameters, ~0.7 GB in fp32.
MIDSIZE = {
    "text_encoder": {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_hidden_layers": 6,
                     "projection_dim": 512},
    "text_encoder_2": {"d_model": 512, "d_ff": 2048, "d_kv": 64, "num_heads": 8, "num_layers": 8},
    "transformer": {"attention_head_dim": 64, "num_attention_heads": 8, "joint_attention_dim": 512,
                    "pooled_projection_dim": 512, "num_layers": 4, "num_single_layers": 12, "axes_dims_rope": [16, 24, 24]},
    "vae": {"block_out_channels": [64, 128, 256, 256]},
}
# FLUX.1's widths (768-d text, 12 heads of 64) at a quarter of its depth: ~0.6B parameters, ~2.4 GB in fp32.
# Loading it from the page cache takes longer than a small, short generation: where a real FLUX on a fast
# GPU sits (tens of GB read per load, seconds per image).
LARGE = {
    "text_encoder": {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
                     "projection_dim": 768},
    "text_encoder_2": {"d_model": 768, "d_ff": 2048, "d_kv": 64, "num_heads": 12, "num_layers": 12},
    "transformer": {"attention_head_dim": 64, "num_attention_heads": 12, "joint_attention_dim": 768,
                    "pooled_projection_dim": 768, "num_layers": 6, "num_single_layers": 18, "axes_dims_rope": [16, 24, 24]},
    "vae": {"block_out_channels": [64, 128, 256, 256]},
}
MODELS = {"midsize": MIDSIZE, "large": LARGE}

RECIPE = r"""
import gc, json, resource, sys, time
import torch
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
folder, out, prompts, seed, steps, size, guidance, max_seq, cold, SCRIPTS = json.loads(sys.argv[1])
sys.path.insert(0, SCRIPTS)
from bench_queue import evict_from_page_cache
t = time.perf_counter()
for i, prompt in enumerate(prompts):
    if cold:  # every load of this prompt reads from disk, as when the weights do not fit in the page cache
        evict_from_page_cache(folder)
    pipe = FluxPipeline.from_pretrained(folder, transformer=None, vae=None)
    with torch.no_grad():
        pe, ppe, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=max_seq)
    del pipe; gc.collect()
    transformer = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", device_map={"": "cpu"})
    vae_config = AutoencoderKL.load_config(folder, subfolder="vae")
    pipe = FluxPipeline.from_pretrained(folder, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                        tokenizer_2=None, vae=None, transformer=transformer)
    pipe.vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe(prompt_embeds=pe, pooled_prompt_embeds=ppe, num_inference_steps=steps, guidance_scale=guidance,
                   height=size, width=size, max_sequence_length=max_seq, output_type="latent",
                   generator=torch.Generator().manual_seed(seed + i)).images
    scale = pipe.vae_scale_factor
    del pipe, transformer; gc.collect()
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    with torch.no_grad():
        latents = FluxPipeline._unpack_latents(latents, size, size, scale)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
    VaeImageProcessor(vae_scale_factor=scale * 2).postprocess(image, output_type="pil")[0].save(f"{out}/{i:05d}.png")
    del vae; gc.collect()
print(json.dumps({"wall": time.perf_counter() - t}))
"""


def evict_from_page_cache(folder) -> None:
    """Drop the folder's weight files from the OS page cache: the next read comes from disk."""
    for path in Path(folder).rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_model(target: Path, changes_by_component: dict) -> Path:
    """The demo's configs, scaled up, with random weights (fixed seed): a FluxPipeline folder."""
    from dm_cli.model.demo import DEMO_CONFIGS, write_configs, write_random_pipeline

    configs = json.loads(json.dumps(DEMO_CONFIGS))
    for name, changes in changes_by_component.items():
        configs[name].update(changes)
    target.mkdir(parents=True, exist_ok=True)
    write_configs(configs, target)
    write_random_pipeline(target, target, seed=0, max_shard_size="200MB")
    return target


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _timed(command: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def _run_args(steps: int, size: int) -> list[str]:
    return ["--steps", str(steps), "--height", str(size), "--width", str(size), "--guidance-scale", str(GUIDANCE),
            "--max-sequence-length", str(MAX_SEQ), "--quiet"]


def _pixels(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image)


def _same(folder: Path, reference: Path, count: int) -> str:
    import numpy as np

    same = all(np.array_equal(_pixels(folder / f"{i:05d}.png"), _pixels(reference / f"{i:05d}.png")) for i in range(count))
    return "yes" if same else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank-steps", type=int, default=6, help="denoising steps for the 1-vs-2-rank rows")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--part", choices=["all", "queue", "ranks"], default="all",
                        help="queue: rows 1-3 only; ranks: the torchrun rows only")
    parser.add_argument("--cold", action="store_true",
                        help="every load reads from disk (weights evicted from the page cache before each prompt of "
                             "the recipe, each `dmap run` and each queue run), as when they do not fit in RAM")
    parser.add_argument("--model", choices=sorted(MODELS), default="midsize",
                        help="midsize: ~0.7 GB, compute weighs more; large: ~2.4 GB, loading weighs more")
    options = parser.parse_args()
    prompts = PROMPTS[:options.prompts]
    tmp = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    os.environ["DMAP_CACHE_DIR"] = str(tmp / "cache")
    folder = write_model(tmp / f"{options.model}-flux", MODELS[options.model])
    weights = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    queue = tmp / "queue.txt"
    queue.write_text("\n".join(prompts) + "\n")
    plan = tmp / "plan.json"
    dmap = [sys.executable, "-m", "dm_cli"]
    _timed(dmap + ["plan", str(folder), "--mode", "staged", "--height", str(options.size), "--guidance-scale",
                   str(GUIDANCE), "--max-sequence-length", str(MAX_SEQ), "--output", str(plan)])
    rows = []

    def recipe(steps: int, out: Path):
        out.mkdir()
        args = json.dumps([str(folder), str(out), prompts, SEED, steps, options.size, GUIDANCE, MAX_SEQ, options.cold,
                           str(Path(__file__).resolve().parent)])
        wall, stdout = _timed([sys.executable, "-c", RECIPE, args])
        return wall, json.loads(stdout.strip().splitlines()[-1])["wall"]

    # warm the OS page cache and dmap's trace cache once, outside every clock
    _timed(dmap + ["run", str(folder), "--prompt", prompts[0], "--device-map", str(plan), "--output",
                   str(tmp / "warm.png"), *_run_args(1, options.size)])

    def dmap_queue(out: Path, steps: int, launcher: list[str] | None = None):
        command = (launcher or dmap) + (["run"] if launcher is None else ["-m", "dm_cli", "run"])
        command += [str(folder), "--prompts", str(queue), "--seed", str(SEED), "--device-map", str(plan), "--output",
                    str(out), "--json", *_run_args(steps, options.size)]
        if options.cold:
            evict_from_page_cache(folder)
        wall, stdout = _timed(command)
        return wall, stdout

    if options.part in ("all", "queue"):
        reference = tmp / "recipe"
        wall, inner = recipe(options.steps, reference)
        rows.append(("diffusers staged recipe, looped per prompt (1 process)", wall, inner, reference))

        loop = tmp / "dmap-loop"
        loop.mkdir()
        wall = 0.0
        for i, prompt in enumerate(prompts):
            if options.cold:
                evict_from_page_cache(folder)
            seconds, stdout = _timed(dmap + ["run", str(folder), "--prompt", prompt, "--seed", str(SEED + i), "--device-map",
                                             str(plan), "--output", str(loop / f"{i:05d}.png"), "--json",
                                             *_run_args(options.steps, options.size)])
            wall += seconds
        rows.append((f"loop of `dmap run` per prompt ({len(prompts)} processes)", wall, None, loop))

        out = tmp / "dmap-queue"
        wall, stdout = dmap_queue(out, options.steps)
        result = json.loads(stdout)
        rows.append((f"dmap run --prompts (1 process, chunk size {result['chunk_size']})", wall, result["seconds"], out))

    rank_rows = []
    if options.part in ("all", "ranks"):
        rank_reference = tmp / "recipe-rank-steps"
        recipe(options.rank_steps, rank_reference)
        for nproc in (1, 2):
            out = tmp / f"torchrun-{nproc}"
            logs = tmp / f"logs-{nproc}"
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        "--log-dir", str(logs), "--redirects", "1"]
            wall, _ = dmap_queue(out, options.rank_steps, launcher)
            per_rank = [json.loads(p.read_text())["seconds"] for p in sorted(logs.rglob("stdout.log"))]
            rank_rows.append((f"torchrun, {nproc} rank(s) x 1 thread", wall, max(per_rank), out))

    print(f"{options.model} FLUX-architecture pipeline, random weights, fp32, {weights / 1e9:.2f} GB of safetensors; "
          f"{len(prompts)} prompts, {options.size}x{options.size}, staged plan, CPU, 1 torch thread per process"
          + ("; every load from disk (--cold)" if options.cold else "; loads from the page cache") + "\n")
    print("| run | process s | speed-up | in-process s | speed-up | same pixels as recipe |")
    print("|---|---:|---:|---:|---:|:---:|")
    if rows:
        base_wall, base_inner = rows[0][1], rows[0][2]
        for name, wall, inner, out in rows:
            inner_cells = f"{inner:.1f} | {base_inner / inner:.2f}x" if inner is not None else "— | —"
            print(f"| {name}, {options.steps} steps | {wall:.1f} | {base_wall / wall:.2f}x | {inner_cells} | "
                  f"{_same(out, reference, len(prompts))} |")
    if rank_rows:
        one_wall, one_inner = rank_rows[0][1], rank_rows[0][2]
        for name, wall, inner, out in rank_rows:
            print(f"| dmap run --prompts under {name}, {options.rank_steps} steps | {wall:.1f} | {one_wall / wall:.2f}x "
                  f"vs 1 rank | {inner:.1f} | {one_inner / inner:.2f}x vs 1 rank | "
                  f"{_same(out, rank_reference, len(prompts))} |")


if __name__ == "__main__":
    main()

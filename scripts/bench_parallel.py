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

Pipeline parallel (`--case pipeline`, issue 32): a queue of --prompts prompts (8) on the mid-size FLUX twin at
--pipeline-size (256) through `dmap run --prompts`. On the CPU a thread stands for a GPU: one process with one thread
running the denoiser block after block is what a 2-GPU split does with one GPU busy at a time (the same blocks, the
same order; minus the hop), and 2 ranks x 1 thread with the plan's 2-way cut (`dmap plan --world-size 2 --parallel
pipeline --max-memory 0=..,1=..`) is the pipeline. Columns: images per minute (whole process, 8 prompts), the
denoise stage's run time, and each process's peak memory above what it held after its imports (VmHWM - RSS after
the ENTRY's imports: what the run itself added, the CPU's stand-in for a GPU's max_memory_allocated), the largest
rank's against the single process's. Pixels compared image by image.

Pipeline parallel with features (`--case pipeline-features --features int8,lora,taylorseer`, issue 40): the same
queue, twin and fastest cut, the plan and the one process both given the features (`--weights int8` computing in
bfloat16 or `--weights fp8` in float32, a LoRA made as tests/run/test_lora.py makes one at scale 0.7, `--cache
taylorseer`, fbc or magcache); each rank loads its slice that way. The same columns, pixels and the step cache's
counts (calls, computed, skipped) of each process.

Usage: .venv/bin/python scripts/bench_parallel.py [--repeats N] [--steps N] [--cfg-size 256] [--context-size 512]
       [--case cfg,context,pipeline,pipeline-cfg,pipeline-features] [--prompts 8] [--pipeline-size 256]
       [--pipeline-steps 28] [--features fp8,lora,taylorseer]
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
from launch_output import json_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLUX_TRANSFORMER = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24],
                    "in_channels": 64, "joint_attention_dim": 32, "num_attention_heads": 8, "num_layers": 2,
                    "num_single_layers": 4, "patch_size": 1, "pooled_projection_dim": 32, "guidance_embeds": True}
FLUX_VAE = {"_class_name": "AutoencoderKL", "block_out_channels": [16, 32, 32, 32], "in_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "latent_channels": 16, "layers_per_block": 1, "norm_num_groups": 8, "out_channels": 3,
            "sample_size": 512, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_post_quant_conv": False,
            "use_quant_conv": False}


# The pipeline case's FLUX twin: FLUX.1's 1:2 of double to single blocks, 5 + 10 of them 768 wide (8 heads of 96;
# ~187M parameters, 760 MB in fp32), so that its weights, not the interpreter and libraries, are what a rank's memory
# holds and a cut can come near half the work (2 + 4 blocks cut at 54% at best); and a T5 encoder in FLUX.1's
# proportion (T5-XXL's 4.76B parameters are 40% of the transformer's 11.9B): 5 layers 1024 wide, ~75M parameters
FLUX_WIDE_TRANSFORMER = {**FLUX_TRANSFORMER, "attention_head_dim": 96, "axes_dims_rope": [16, 40, 40], "num_layers": 5,
                         "num_single_layers": 10, "joint_attention_dim": 1024}
FLUX_WIDE_T5 = {"architectures": ["T5EncoderModel"], "d_ff": 5120, "d_kv": 64, "d_model": 1024, "model_type": "t5",
                "num_decoder_layers": 5, "num_heads": 16, "num_layers": 5, "relative_attention_num_buckets": 8,
                "vocab_size": 1103}


def _build_twin(folder: Path, preset: str, configs: dict[str, dict]) -> Path:
    """A random-weight pipeline (fixed seed) in `folder`: the preset's configs, those of `configs` (subfolder ->
    config.json) in their place; kept when it is already there."""
    if (folder / "model_index.json").is_file():
        return folder
    import shutil

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(PRESETS_DIR / preset, staging)
    for name, config in configs.items():
        (staging / name / "config.json").write_text(json.dumps(config, indent=2))
    write_random_pipeline(staging, staging, seed=0)
    os.replace(staging, folder)
    return folder


def build_flux(folder: Path, transformer: dict = FLUX_TRANSFORMER, t5: dict | None = None) -> Path:
    """The mid-size FLUX twin: tiny-flux's configs, a wider transformer and VAE (and, given `t5`, that text
    encoder)."""
    return _build_twin(folder, "tiny-flux", {"transformer": transformer, "vae": FLUX_VAE,
                                             **({"text_encoder_2": t5} if t5 is not None else {})})


# The pipeline's CFG case: a Qwen-Image twin (tiny-qwenimage's configs, 8 blocks 512 wide), one prompt with a negative
# prompt: true CFG, two denoiser calls per step, which the pipeline sends through the slices as two micro-batches
QWEN_TRANSFORMER_CHANGES = {"num_layers": 8, "attention_head_dim": 64, "num_attention_heads": 8,
                            "axes_dims_rope": [16, 24, 24]}
NEGATIVE = "blurry, low resolution, dark"


def build_qwen(folder: Path) -> Path:
    """The Qwen-Image twin: tiny-qwenimage's configs, its transformer deeper and wider."""
    from dm_cli.model.sources import PRESETS_DIR

    config = json.loads((PRESETS_DIR / "tiny-qwenimage" / "transformer" / "config.json").read_text())
    return _build_twin(folder, "tiny-qwenimage", {"transformer": {**config, **QWEN_TRANSFORMER_CHANGES}})


# What each launched process imports before dmap's CLI runs: the libraries and the model classes diffusers imports
# lazily (about 1 s on this machine, inside the first load otherwise), so that "in-process" starts after imports
# as it says, the same rule as bench_run.py's shared imports. The process column still counts them.
ENTRY = """import runpy, sys
import torch, diffusers, transformers
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, T5EncoderModel
import atexit, os, resource
def _rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
_imported = _rss()
def _report():
    where = os.environ.get("BENCH_MEMORY_DIR")
    if where:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open(os.path.join(where, "rank%s.txt" % os.environ.get("RANK", "0")), "w") as out:
            out.write("%d %d" % (peak, _imported))
atexit.register(_report)
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


def _queue(folder: Path, ranks: int, prompts: Path, out: Path, steps: int, extra: list[str], memory: Path) -> dict:
    """A queue through `dmap run --prompts` on 1 process or `ranks` torchrun ranks: wall time, the denoise stage's
    run time (rank 0), and each rank's peak memory above its imports."""
    import shutil

    entry = out.parent / "entry.py"
    entry.write_text(ENTRY)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(memory, ignore_errors=True)
    memory.mkdir(parents=True)
    run = [str(entry), "run", str(folder), "--prompts", str(prompts), "--steps", str(steps), "--output", str(out),
           "--json", *extra]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *run]
               if ranks > 1 else [sys.executable, *run])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "BENCH_MEMORY_DIR": str(memory)}
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    results = json_results(proc.stdout)  # every rank prints its queue result: rank 0's counts
    result = next(r for r in results if r.get("rank", 0) == 0)
    added = []
    for rank in range(ranks):
        peak, imported = (int(x) for x in (memory / f"rank{rank}.txt").read_text().split())
        added.append(peak - imported)
    by_name = {stage["name"]: stage for stage in result["stages"]}  # a list of objects with a name (JSON version 2)
    return {"process": wall, "denoise": by_name.get("denoise", {}).get("run_s", 0.0), "added": added,
            "notices": result["notices"],
            "cache": [r["step_cache"]["counts"] for r in results if (r.get("step_cache") or {}).get("counts")],
            "stages": {name: stage.get("load_s", 0.0) + stage.get("run_s", 0.0)
                       for name, stage in by_name.items()}}


# The two plans the pipeline case compares: the fastest cut (room to spare), and the cut that fits 1.1 GB per rank
# (FLUX's double blocks hold 2.4x a single block's weights for the same FLOPs: an even split of the weights is slower)
PIPELINE_PLANS = {"fastest cut": "0=4GB,1=4GB", "cut that fits 1.1 GB per rank": "0=1.1GB,1=1.1GB"}


def _pipeline_case(flux: Path, size: int, steps: int, prompts: int, repeats: int, tmp: Path,
                   plans: dict[str, str] = PIPELINE_PLANS, features: tuple[str, ...] = (),
                   run_features: tuple[str, ...] = ()):
    """The queue on one process against the 2-rank pipeline of each plan (plans made once, outside the timing);
    `features` (--weights, --lora, --cache ...) given to the plans and to the one process alike, `run_features` (the
    LoRA files, which a plan names but does not hold) to the ranks' runs of a plan too."""
    queue = tmp / "pipeline-prompts.txt"
    queue.write_text("".join(f"{PROMPT}, picture {i}\n" for i in range(prompts)))
    common = ["--height", str(size), "--width", str(size), "--max-sequence-length", "64", *features]
    kinds, layouts = {"1 process": (1, common)}, {}
    for n, (title, budget) in enumerate(plans.items()):
        plan = tmp / f"pipeline-plan-{n}.json"
        subprocess.run([sys.executable, "-m", "dm_cli", "plan", str(flux), "--max-memory", budget, "--world-size", "2",
                        "--parallel", "pipeline", *common, "-o", str(plan), "--overwrite"], check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        layouts[title] = json.loads(plan.read_text())["parallel"]
        kinds[title] = (2, ["-d", str(plan), *run_features])
    for n, (ranks, extra) in enumerate(kinds.values()):  # warm-up: trace cache, page cache
        _queue(flux, ranks, queue, tmp / f"pipeline-warm-{n}", 1, extra, tmp / "memory")
    runs: dict[str, list[dict]] = {title: [] for title in kinds}
    for i in range(repeats):
        for n, (title, (ranks, extra)) in enumerate(kinds.items()):
            runs[title].append(_queue(flux, ranks, queue, tmp / f"pipeline-{n}-{i}", steps, extra, tmp / "memory"))
    assert all(any("slices" in line for line in runs[t][0]["notices"]) for t in plans), runs
    difference = max(int(abs(_pixels(tmp / f"pipeline-0-{i}" / f"{k:05d}.png")
                             - _pixels(tmp / f"pipeline-{n}-{i}" / f"{k:05d}.png")).max())
                     for i in range(repeats) for k in range(prompts) for n in range(1, len(kinds)))
    return runs, difference, layouts


# --features: what each word adds to the plans and the one process (the plan records the weights and the cache; a run of
# a plan is given the LoRA file again). fp8 keeps fp32 compute (the plain case's dtype; diffusers' layerwise casting
# upcasts each layer's weights per call), int8 computes in bfloat16 (torchao's weight-only int8, as the tests run it).
WEIGHT_FEATURES = {"fp8": ["--weights", "fp8", "--dtype", "float32"], "int8": ["--weights", "int8", "--dtype", "bfloat16"]}
CACHE_FEATURES = ("taylorseer", "fbc", "magcache")


def _feature_args(words: list[str], flux: Path, models: Path) -> tuple[list[str], list[str]]:
    """(plan and one-process arguments, arguments a run of the plan takes too) for `--features`; the LoRA is made as
    tests/run/test_lora.py makes one (rank 4 on the attention projections, random B matrices), kept beside the twin."""
    plan_args: list[str] = []
    run_args: list[str] = []
    for word in words:
        if word in WEIGHT_FEATURES:
            plan_args += WEIGHT_FEATURES[word]
        elif word.partition(":")[0] in CACHE_FEATURES:
            plan_args += ["--cache", word]
        elif word == "lora":
            lora = models / "flux-15-lora.safetensors"
            if not lora.is_file():
                import diffusers

                sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "run")]
                from test_lora import make_lora

                make_lora(diffusers.FluxTransformer2DModel, flux / "transformer", lora, diffusers.FluxPipeline, seed=1)
            plan_args += ["--lora", f"{lora}:0.7"]
            run_args += ["--lora", f"{lora}:0.7"]
        else:
            raise SystemExit(f"Unknown feature '{word}': use fp8 or int8, lora, and taylorseer, fbc or magcache.")
    return plan_args, run_args


def _pipeline_cfg_case(qwen: Path, size: int, steps: int, repeats: int, tmp: Path):
    """One prompt with true CFG on one process against the 2-rank pipeline (the plan made once, outside the timing):
    the step's two calls are the pipeline's two micro-batches."""
    plan = tmp / "pipeline-cfg-plan.json"
    common = ["--height", str(size), "--width", str(size), "--negative-prompt", NEGATIVE]
    subprocess.run([sys.executable, "-m", "dm_cli", "plan", str(qwen), "--max-memory", "0=4GB,1=4GB", "--world-size",
                    "2", "--parallel", "pipeline", *common, "-o", str(plan), "--overwrite"], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    kinds = {1: ["--negative-prompt", NEGATIVE], 2: ["-d", str(plan), "--negative-prompt", NEGATIVE]}
    for ranks, extra in kinds.items():  # warm-up
        _launch(qwen, ranks, "pipeline", size, 1, tmp / "pipeline-cfg-warm.png", extra)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for i in range(repeats):
        for ranks, extra in kinds.items():
            runs[ranks].append(_launch(qwen, ranks, "pipeline", size, steps, tmp / f"pipeline-cfg-{ranks}-{i}.png",
                                       extra))
    assert any("micro-batches" in n for n in runs[2][0]["notices"]), runs[2][0]["notices"]
    difference = max(int(abs(_pixels(tmp / f"pipeline-cfg-1-{i}.png") - _pixels(tmp / f"pipeline-cfg-2-{i}.png")).max())
                     for i in range(repeats))
    return runs, difference


def _pipeline_rows(runs: dict, difference: int, layouts: dict, prompts: int) -> list[str]:
    mb = 1 << 20
    base = runs["1 process"]
    rate0 = statistics.median(60 * prompts / r["process"] for r in base)
    denoise0 = statistics.median(r["denoise"] for r in base)
    added0 = statistics.median(r["added"][0] for r in base)
    rows = ["| run | images per minute (whole process) | denoise stage s (rank 0) | peak memory above imports, MB "
            "(largest rank / 1 process) | predicted |", "|---|---|---|---|---|",
            f"| 1 process, one thread (the split, one GPU busy at a time) | {rate0:.2f} | {denoise0:.2f} | "
            f"{added0 / mb:.0f} | |"]
    for title, layout in layouts.items():
        got = runs[title]
        rate = statistics.median(60 * prompts / r["process"] for r in got)
        denoise = statistics.median(r["denoise"] for r in got)
        ranks = [statistics.median(r["added"][k] for r in got) for k in range(2)]
        rows.append(f"| 2 ranks, pipeline, {title} | {rate:.2f} = **{rate / rate0:.2f}x** | {denoise:.2f} = "
                    f"**{denoise0 / denoise:.2f}x** | rank 0 {ranks[0] / mb:.0f}, rank 1 {ranks[1] / mb:.0f} = "
                    f"**{max(ranks) / added0:.2f}x** | {layout.get('predicted_speedup')}x |")
    rows += ["", f"Largest pixel difference against 1 process, every image: {difference}."]
    for title, got in runs.items():  # where the time goes: rank 0's stages (load + run), the rest is the launch
        stages = {name: statistics.median(r["stages"].get(name, 0.0) for r in got) for name in got[0]["stages"]}
        whole = statistics.median(r["process"] for r in got)
        rows.append(f"Stages, {title} (rank 0, load + run s): " + ", ".join(f"{n} {t:.1f}" for n, t in stages.items())
                    + f"; the rest of the {whole:.1f} s process (launch, imports, planning, exit) "
                      f"{whole - sum(stages.values()):.1f}.")
    for title, got in runs.items():
        if got[0]["cache"]:
            rows.append(f"Step cache, {title}: " + "; ".join(f"rank {k}: {json.dumps(c)}"
                                                             for k, c in enumerate(got[0]["cache"])) + ".")
    for title, layout in layouts.items():
        slices = "; ".join(f"rank {k}: {v[0]} .. {v[-1]}" for k, v in layout["slices"].items())
        rows.append(f"{title}: {slices} ({layout.get('in_flight')} prompts in flight at most).")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cfg-size", type=int, default=256)
    parser.add_argument("--context-size", type=int, default=512)
    parser.add_argument("--model-dir", default=None, help="where to build (or find) the bench pipelines")
    parser.add_argument("--case", default="cfg,context,pipeline,pipeline-cfg", help="which cases, comma-separated")
    parser.add_argument("--prompts", type=int, default=8, help="pipeline: prompts in the queue")
    parser.add_argument("--pipeline-size", type=int, default=256)
    parser.add_argument("--pipeline-steps", type=int, default=28, help="FLUX.1 [dev]'s default")
    parser.add_argument("--features", default="fp8,lora,taylorseer",
                        help="pipeline-features: fp8 or int8, lora, taylorseer (or fbc, magcache), comma-separated")
    options = parser.parse_args()
    cases = set(options.case.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    models = Path(options.model_dir or tmp)
    sd15, flux = build_pipeline(models / "sd15-mid"), build_flux(models / "flux-mid")  # outside any timing
    if cases & {"pipeline", "pipeline-features"}:
        build_flux(models / "flux-15", FLUX_WIDE_TRANSFORMER, FLUX_WIDE_T5)
    # dm_cli's bytecode, as a wheel install has it (see bench_run.py)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "dm_cli")], check=True, stdout=subprocess.DEVNULL)
    load_before = os.getloadavg()
    cfg = context = pipeline = pipeline_cfg = featured = None
    if "pipeline-features" in cases:  # the LoRA made outside any timing too
        wide = build_flux(models / "flux-15", FLUX_WIDE_TRANSFORMER, FLUX_WIDE_T5)
        plan_args, run_args = _feature_args(options.features.split(","), wide, models)
    if "cfg" in cases:
        cfg = _case("cfg", sd15, "cfg", options.cfg_size, options.steps, options.repeats, tmp,
                    ["--guidance-scale", str(GUIDANCE)])
    if "context" in cases:
        context = _case("context", flux, "context", options.context_size, options.steps, options.repeats, tmp,
                        ["--max-sequence-length", "64"])
    if "pipeline" in cases:
        wide = build_flux(models / "flux-15", FLUX_WIDE_TRANSFORMER, FLUX_WIDE_T5)
        pipeline = _pipeline_case(wide, options.pipeline_size, options.pipeline_steps, options.prompts,
                                  options.repeats, tmp)
    if "pipeline-features" in cases:
        featured = _pipeline_case(wide, options.pipeline_size, options.pipeline_steps, options.prompts, options.repeats,
                                  tmp, {"fastest cut": PIPELINE_PLANS["fastest cut"]}, tuple(plan_args),
                                  tuple(run_args))
    if "pipeline-cfg" in cases:
        pipeline_cfg = _pipeline_cfg_case(build_qwen(models / "qwen-mid"), options.pipeline_size, options.steps,
                                          options.repeats, tmp)
    load_after = os.getloadavg()
    print(f"{options.steps} steps ({options.pipeline_steps} for the pipeline's queue), seed {SEED}, CPU, one torch "
          f"thread per rank, {os.cpu_count()} cores; medians of {options.repeats} runs each (subprocesses, "
          f"alternating); load average (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before, "
          f"{', '.join(f'{x:.1f}' for x in load_after)} after\n")
    if cfg or context:
        print("| layout | denoise s: 1 rank / 2 ranks | in-process s | process s | largest pixel difference |")
        print("|---|---|---|---|---|")
    if cfg:
        print(_row(f"CFG-parallel, SD 1.5-arch UNet ~77M, {options.cfg_size}x{options.cfg_size}", *cfg))
    if context:
        print(_row(f"context parallel (Ulysses 2), FLUX-arch ~36M, {options.context_size}x{options.context_size}",
                   *context))
    if pipeline:
        print(f"\nPipeline parallel, FLUX-arch ~187M (5 + 10 blocks 768 wide, T5 ~75M), {options.pipeline_size}x"
              f"{options.pipeline_size}, a queue of "
              f"{options.prompts} prompts:\n")
        print("\n".join(_pipeline_rows(*pipeline, options.prompts)))
    if featured:
        print(f"\nPipeline parallel with {options.features} (`{' '.join(plan_args)}`, the same for the one process "
              f"and the plan), the same twin, {options.pipeline_size}x{options.pipeline_size}, a queue of "
              f"{options.prompts} prompts:\n")
        print("\n".join(_pipeline_rows(*featured, options.prompts)))
    if pipeline_cfg:
        print(f"\nPipeline parallel, one prompt with true CFG (Qwen-Image twin, 8 blocks 512 wide), "
              f"{options.pipeline_size}x{options.pipeline_size}, {options.steps} steps: the step's two calls as two "
              "micro-batches\n")
        print("| layout | denoise s: 1 process / 2 ranks | in-process s | process s | largest pixel difference |")
        print("|---|---|---|---|---|")
        print(_row("pipeline, 2 slices, CFG calls as micro-batches", *pipeline_cfg))
    if not cfg:
        return
    two, one = _cfg_ceiling(sd15, options.cfg_size)
    print(f"\nCFG-parallel's ceiling on this machine: one UNet forward at batch 2 takes {two:.3f} s, at batch 1 "
          f"{one:.3f} s, so two ranks can denoise at most {two / one:.2f}x faster than one.")


if __name__ == "__main__":
    main()

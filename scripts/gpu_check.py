"""GPU check: what only a GPU can show, in one call of a few minutes (NOT run in CI on a GPU; its CPU form is).

Sections (--sections, all six by default):
- memory: a mid-size FLUX-architecture pipeline (transformer ~1.3 GB in bf16) planned for `0=<GPU budget>,cpu=64GB`
  so that the transformer does not fit the GPU whole (part of it streamed through accelerate hooks), run for real;
  prints per stage and device the measured peak (torch.cuda.max_memory_allocated) beside the plan's peak_bytes.
- predict (issue 42): `dmap calibrate` on the device, then for each case `dmap plan --profile` (the calibrated
  profile, and the bundled table's row for this GPU) against the step measured through dmap's API on the device
  (scripts/bench_predict.py's measurement: the median step between `on_step` calls, each waiting for the GPU).
- flux (issue 42): a full-size FLUX.1 [dev] transformer (the bundled preset's config, 12B parameters) with random
  bf16 weights, built on the GPU, with CLIP-L, a 2-layer T5 of T5-XXL's width and FLUX's VAE; `dmap run`'s step
  and image against diffusers' own FluxPipeline call on the same folder at the same size, steps and seed (pixels
  compared), beside dmap's prediction and the published H100 anchors (about 6.7 s an image eager, 4.3 s compiled);
  on a GPU also the GPU record's memory rows (issue 53, docs/gpu-record.md): diffusers' loaded bytes and allocated and
  reserved peaks beside dmap's plan of the folder with CUDA's kernel rules and the published FLUX.1 [dev] figures.
- nf4 (issue 54, scripts/gpu_check_nf4.py): the flux section's folder with the transformer in 4-bit NF4, dmap against
  diffusers' own bitsandbytes loading (seconds per step beside dmap's bf16 run, peaks, pixels); carry the
  bitsandbytes wheel too (its doc says how).
- kernels (issue 53, scripts/gpu_check_kernels.py): the kernel rules of the plan's GPU time model measured beside
  the model's figures for this GPU's table row (elementwise kernels' fixed cost and bandwidth, dispatch, flash
  attention by head dim, matmuls at FLUX's and SD3's shapes), and SD3 Medium's transformer timed at full size.
- fast (issue 55, scripts/gpu_check_fast.py): the flux section's folder run by dmap with --compile and with blocks
  streamed from the cpu (overlapped where the plan predicts it faster), against diffusers' own
  compile_repeated_blocks and enable_group_offload(use_stream=True): warm steps, cold compile, peaks, pixels.
Exit 1 when a measured GPU peak exceeds the planned one or dmap's pixels differ from diffusers'.

`--device cpu --small` runs predict and flux on this CPU at tiny sizes (the demo's configs, a quick calibration,
float32):
the script's own test (tests/e2e/test_gpu_check.py, marked heavy: `scripts/test -m heavy`), so that the GPU call
runs what the tests have run.

On a lent machine (the `device` tool: torch, transformers and accelerate are there, diffusers is not), once here:
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1
then one call carrying `.whl`:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py 2>&1 | tee $OUT/gpu_check.log

Usage: .venv/bin/python scripts/gpu_check.py [--sections memory,predict,flux] [--device cuda:0] [--small]
       [--gpu-budget 1.6GB] [--size 512] [--steps 4] [--flux-size 1024] [--flux-steps 28]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_predict  # scripts/: the folder Python runs this file from
from bench_predict import DMAP, PROMPT, REPO
from gpu_check_fast import fast_check
from gpu_check_kernels import kernels_check
from gpu_check_nf4 import nf4_check

SECTIONS = ("memory", "predict", "flux", "nf4", "kernels", "fast")
ANCHORS = "published, one H100, 1024x1024, 28 steps: about 6.7 s an image eager, 4.3 s compiled"
# predict's cases (bench_predict.CASES' one-process rows that place no simulated GPU), each on the device
GPU_CASES = ("demo-256", "demo-512", "tiny-flux-256", "tiny-sd15-256", "tiny-sd3-64")
SMALL_CASES = ("demo-256",)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--diffusers":
        print(json.dumps(diffusers_measure(json.loads(sys.argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (with --small: the script's own test)")
    parser.add_argument("--small", action="store_true", help="tiny sizes and a quick calibration (seconds)")
    parser.add_argument("--gpu-budget", default="1.6GB", help="memory: the GPU's budget in the plan")
    parser.add_argument("--size", type=int, default=512, help="memory: the image size")
    parser.add_argument("--steps", type=int, default=4, help="memory: the steps")
    parser.add_argument("--flux-size", type=int, default=1024)
    parser.add_argument("--flux-steps", type=int, default=28)
    parser.add_argument("--offload-budget", default="16GB", help="fast: the GPU's budget of the offloaded run")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"Unknown section {unknown[0]!r}: use {', '.join(SECTIONS)}.", file=sys.stderr)
        return 2

    import torch

    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        print("No CUDA GPU here: use --device cpu --small for this script's CPU form.", file=sys.stderr)
        return 2
    if not gpu and "memory" in sections:
        print("The memory section measures CUDA memory: leave it out on a CPU (--sections predict,flux).",
              file=sys.stderr)
        return 2
    os.environ.setdefault("DMAP_CACHE_DIR", tempfile.mkdtemp(prefix="dmap-gpu-check-"))
    work = Path(os.environ["DMAP_CACHE_DIR"])
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep a carried site
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"  # as bench_predict: the calibration's clock is one thread's
    started, failed = time.perf_counter(), False
    if "memory" in sections:
        failed |= memory_check(args, work)
    profiles = {}
    if "predict" in sections or "flux" in sections:
        profiles = device_profiles(args, work, env, torch)
    if "predict" in sections:
        predict_check(args, profiles, work, env)
    if "flux" in sections:
        failed |= flux_check(args, profiles, work, env, torch)
    if "nf4" in sections:
        failed |= nf4_check(args, work, env, torch, flux_folder)
    if "kernels" in sections:
        kernels_check(args, torch, table_row(torch.cuda.get_device_name(torch.device(args.device))) if gpu else None)
    if "fast" in sections:
        failed |= fast_check(args, work, env, torch, flux_folder)
    print(f"gpu_check: {time.perf_counter() - started:.0f} s in all", flush=True)
    return 1 if failed else 0


# --- memory: planned against measured peaks ------------------------------------------------------------

def memory_check(args, work: Path) -> bool:
    """True when a measured GPU peak exceeds the planned one."""
    from dm_cli.model.demo import DEMO_CONFIGS, write_configs, write_random_pipeline
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    configs = copy.deepcopy(DEMO_CONFIGS)
    configs["transformer"].update(num_layers=4, num_single_layers=12, num_attention_heads=12, attention_head_dim=128,
                                  joint_attention_dim=1024, axes_dims_rope=[16, 56, 56])
    configs["text_encoder_2"].update(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_layers=6)
    root = work / "gpu-check-pipeline"
    if not (root / "transformer").is_dir():
        root.mkdir(parents=True, exist_ok=True)  # write_configs writes into an existing folder
        write_configs(configs, root)
        write_random_pipeline(root, root, seed=0, max_shard_size="200MB", dtype="bfloat16")
    request = RunRequest.of(source=str(root), prompt="a red fox in the snow", max_memory=f"0={args.gpu_budget},cpu=64GB",
                            mode="staged", steps=args.steps, height=args.size, width=args.size,
                            output=str(work / "gpu-check.png"), overwrite=True)
    result = run(request, on_plan=lambda plan: print(json.dumps(
        {n: c.device_map for n, c in plan.components.items()}, indent=1)))
    print("| stage | device | measured peak | planned peak_bytes | measured/planned |")
    print("|---|---|---:|---:|---:|")
    worst = 0.0
    for stage in result.stages:
        for dev in sorted(set(stage.measured_peak) | set(stage.planned_peak)):
            m, p = stage.measured_peak.get(dev, 0), stage.planned_peak.get(dev, 0)
            ratio = m / p if p else 0.0
            if dev.isdigit():
                worst = max(worst, ratio)
            print(f"| {stage.name} | {dev} | {m / 1e9:.3f} GB | {p / 1e9:.3f} GB | {ratio:.2f} |")
    print(f"stage wall times: {[(s.name, round(s.wall_s, 2)) for s in result.stages]}", flush=True)
    return worst > 1.0


# --- predict: calibrated and table predictions against the device's steps ---------------------------------

def device_profiles(args, work: Path, env: dict, torch) -> dict[str, str]:
    """{"calibrated": the profile `dmap calibrate` measures on the device now, "table:NAME": the bundled row for
    this GPU (none on a CPU or an unlisted GPU)}."""
    path = work / "profile.json"
    quick = ["--quick"] if args.small else []
    started = time.perf_counter()
    subprocess.run([*DMAP, "calibrate", "--device", args.device, "-o", str(path), "--overwrite", *quick], check=True,
                   env=env, cwd=REPO)
    print(f"calibrated in {time.perf_counter() - started:.0f} s", flush=True)
    found = {"calibrated": str(path)}
    if args.device.startswith("cuda"):
        row = table_row(torch.cuda.get_device_name(torch.device(args.device)))
        if row:
            found[f"table:{row}"] = f"table:{row}"
    return found


def table_row(device_name: str) -> str | None:
    """The bundled table's row for a CUDA device's name ("NVIDIA H100 80GB HBM3" -> h100-sxm), or None."""
    name = device_name.lower().replace(" ", "")
    rows = {"h100": "h100-pcie" if "pcie" in name or "nvl" in name else "h100-sxm",
            "h200": "h200-nvl" if "nvl" in name else "h200-sxm",
            "a100": "a100-40gb" if "40gb" in name else "a100-80gb",
            "l40s": "l40s", "l20": "l20", "l4": "l4", "a10g": "a10g", "4090": "rtx-4090", "5090": "rtx-5090",
            "3090": "rtx-3090"}  # l40s before l4: the first key a name holds
    return next((row for key, row in rows.items() if key in name), None)


def _devices(args, size_gb: int) -> list[str]:
    """The plan's devices: the GPU named (resident), or this CPU (no -m: the plan's default)."""
    if args.device.startswith("cuda"):
        return ["-m", f"{args.device.split(':')[1]}={size_gb}GB,cpu=64GB"]
    return []


def _predicted(source: str, extra: list[str], steps: int, profile: str, env: dict) -> dict:
    return bench_predict.plan(source, extra, profile, steps, env).get("predicted_time") or {}


def predict_check(args, profiles: dict[str, str], work: Path, env: dict) -> None:
    names = SMALL_CASES if args.small else GPU_CASES
    steps = 3 if args.small else 6
    sources = bench_predict.sources_for(list(names), work, env)
    print(f"| case | measured s/step | {' | '.join(f'predicted ({p})' for p in profiles)} |\n"
          f"|---|---:|{'---:|' * len(profiles)}", flush=True)
    errors = {p: [] for p in profiles}
    for name in names:
        source, extra, prompts = bench_predict.CASES[name]
        extra = [*extra, *_devices(args, 40)]
        measured = bench_predict.measure_in_process(sources[source], extra, prompts, steps, env)["wall_step_s"]
        cells = []
        for label, profile in profiles.items():
            step = _predicted(sources[source], extra, steps, profile, env).get("step_s")
            if step:
                errors[label].append(step / measured - 1)
                cells.append(f"{step:.4f} ({step / measured - 1:+.0%})")
            else:
                cells.append("-")
        print(f"| {name} | {measured:.4f} | {' | '.join(cells)} |", flush=True)
    for label, found in errors.items():
        if found:
            print(f"{label}: {len(found)} cases, within 25%: {sum(abs(e) <= 0.25 for e in found)}, median |error| "
                  f"{statistics.median(abs(e) for e in found):.0%}", flush=True)


# --- flux: a full-size FLUX.1 [dev] transformer, dmap against diffusers ----------------------------------------

def flux_folder(args, work: Path, torch) -> Path:
    """A runnable FLUX.1 [dev]-shaped folder with random bf16 weights: the preset's transformer and VAE configs,
    CLIP-L's, T5-XXL's width over 2 layers (the transformer's text input is T5's 4096 wide; 24 layers would add
    9 GB and minutes of writing for an encoder run once). The transformer is built on the device (12B parameters
    initialise there in seconds, on a CPU in minutes). --small: the demo's configs (a FLUX twin)."""
    from dm_cli.model.demo import DEMO_CONFIGS, write_configs, write_random_pipeline
    from dm_cli.model.models import build_model
    from dm_cli.model.sources import PRESETS, PRESETS_DIR

    root = work / ("flux-small" if args.small else "flux-dev-random")
    if (root / "transformer" / "config.json").is_file() and (root / "model_index.json").is_file():
        return root
    staging = work / f"{root.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if args.small:
        write_configs(copy.deepcopy(DEMO_CONFIGS), staging)
    else:
        shutil.copytree(PRESETS_DIR / PRESETS["flux-dev"], staging, dirs_exist_ok=True)
        t5 = json.loads((staging / "text_encoder_2" / "config.json").read_text())
        (staging / "text_encoder_2" / "config.json").write_text(json.dumps({**t5, "num_layers": 2}, indent=2))
    index = json.loads((staging / "model_index.json").read_text())
    # the other components as `dmap demo` writes them (the CPU, fixed seeds); the transformer next, on the device
    (staging / "model_index.json").write_text(json.dumps({**index, "transformer": [None, None]}))
    write_random_pipeline(staging, staging, seed=0, dtype="bfloat16")
    (staging / "model_index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((staging / "transformer" / "config.json").read_text())
    started = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = build_model("diffusers", config["_class_name"], config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(staging / "transformer", max_shard_size="5GB")
    print(f"transformer: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters built and written in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    staging.rename(root)
    return root


def diffusers_measure(spec: dict) -> dict:
    """diffusers' own call on the folder (`--diffusers SPEC`, a fresh process): a 2-step warm-up, then the timed
    call, each step waiting for the device (callback_on_step_end); the image saved for the comparison."""
    import diffusers
    import torch

    device = torch.device(spec["device"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pipe = diffusers.FluxPipeline.from_pretrained(spec["folder"], torch_dtype=getattr(torch, spec["dtype"])).to(device)
    pipe.set_progress_bar_config(disable=True)

    def call(steps: int, callback=None):
        return pipe(PROMPT.format(0), height=spec["size"], width=spec["size"], num_inference_steps=steps,
                    generator=torch.Generator().manual_seed(0), callback_on_step_end=callback).images[0]

    call(2)
    memory = {}
    if device.type == "cuda":  # the record's counters: loaded, then the call's allocated and reserved peaks
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        memory = {"loaded_bytes": torch.cuda.memory_allocated(device)}
    marks: list[float] = []

    def on_step(_pipe, _step, _timestep, kwargs):
        sync()
        marks.append(time.perf_counter())
        return kwargs

    start = time.perf_counter()
    image = call(spec["steps"], on_step)
    sync()
    image_s = time.perf_counter() - start
    image.save(spec["output"])
    if memory:
        memory.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(device))
    return {"wall_step_s": statistics.median(b - a for a, b in zip(marks, marks[1:])), "image_s": image_s, **memory}


def flux_check(args, profiles: dict[str, str], work: Path, env: dict, torch) -> bool:
    """True when dmap's pixels differ from diffusers'."""
    import numpy as np
    from PIL import Image

    size, steps = (64, 3) if args.small else (args.flux_size, args.flux_steps)
    # a CPU's bf16 matmuls run about 10x below its float32 ones (dmap calibrate): the CPU form checks the script
    # itself, in float32; the GPU runs what the record measured, bf16
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    folder = flux_folder(args, work, torch)
    extra = ["--height", str(size), "--width", str(size), "--dtype", dtype, *_devices(args, 70)]
    predicted = {label: _predicted(str(folder), extra, steps, profile, env) for label, profile in profiles.items()}
    dmap_png, diffusers_png = work / "flux-dmap.png", work / "flux-diffusers.png"
    ours = bench_predict.measure_in_process(str(folder), extra, 1, steps, env, output=str(dmap_png))
    spec = {"folder": str(folder), "device": args.device, "size": size, "steps": steps, "output": str(diffusers_png),
            "dtype": dtype}
    proc = subprocess.run([sys.executable, __file__, "--diffusers", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"diffusers' call failed: {proc.stderr.strip()[-800:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    difference = int(np.abs(np.asarray(Image.open(dmap_png), dtype=np.int16)
                            - np.asarray(Image.open(diffusers_png), dtype=np.int16)).max())
    print(f"FLUX.1 [dev]-shaped, {size}x{size}, {steps} steps, {dtype}, on {args.device}\n"
          "| run | s/step | s/image (encode, denoise, decode) |\n|---|---:|---:|", flush=True)
    print(f"| dmap run (API) | {ours['wall_step_s']:.4f} | {ours['image_s']:.2f} |")
    print(f"| diffusers FluxPipeline | {theirs['wall_step_s']:.4f} | {theirs['image_s']:.2f} |")
    for label, found in predicted.items():
        step = found.get("step_s")
        print(f"| predicted ({label}) | {step if step is not None else '-'} | {found.get('image_s', '-')} (denoise) |"
              + (f" error {step / ours['wall_step_s'] - 1:+.0%} |" if step else ""))
    print(f"dmap / diffusers per step: {ours['wall_step_s'] / theirs['wall_step_s']:.3f}x; largest pixel difference "
          f"{difference}; {ANCHORS}", flush=True)
    if "peak_allocated_bytes" in theirs:
        record_memory(folder, extra, theirs, env)
    return difference != 0


def record_memory(folder: Path, extra: list[str], measured: dict, env: dict) -> None:
    """The GPU record's memory rows for this run (issue 53): diffusers' loaded and peak bytes beside dmap's plan of
    the same folder with CUDA's kernel rules, and the published FLUX.1 [dev] rows (the folder's T5 has 2 layers, so
    weights differ from the published; the activations above them are the comparable figure)."""
    rules = {k: v for k, v in env.items() if k != "DMAP_KERNELS"}
    plan = bench_predict.dmap("plan", str(folder), *extra, "--mode", "resident", "--no-check", "--json", env=rules)
    weights = sum(c["weights_bytes"] for c in plan["components"].values())
    activations = max(u["activations"] for s in plan["stages"] for u in s["breakdown"].values())
    gib = 1024 ** 3
    loaded, peak = measured["loaded_bytes"], measured["peak_allocated_bytes"]
    print("| memory (GiB) | measured (diffusers) | dmap's plan | published FLUX.1 [dev], H100 |\n|---|---:|---:|---:|")
    print(f"| loaded | {loaded / gib:.2f} | {weights / gib:.2f} | 31.44 |")
    print(f"| activations above the weights | {(peak - loaded) / gib:.2f} | {activations / gib:.2f} | 2.41 |")
    print(f"| peak allocated | {peak / gib:.2f} | {(weights + activations) / gib:.2f} (+ overhead) | 33.85 |")
    print(f"| peak reserved | {measured['peak_reserved_bytes'] / gib:.2f} | - | 36.17 (50 steps) |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

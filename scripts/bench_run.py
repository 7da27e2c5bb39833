"""Benchmark: `dmap run` vs diffusers' own pipeline call vs the hand-written staged recipe.

A mid-size Stable Diffusion 1.5-architecture pipeline with random weights (UNet at 3/10 of SD 1.5's
widths, ~77M parameters, fp32; a 4-layer CLIP text encoder; a small VAE), 256x256 (--size), classifier-free
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
the whole subprocess (interpreter start, imports, exit) on the clock, "process CPU s" its CPU time
(the parent's RUSAGE_CHILDREN delta). Ratios are against diffusers' own call in the same column and
step count; medians over the runs.

Phases (a second table, dmap's plain run beside diffusers' own call, CPU and wall, medians): timestamps
(perf_counter and os.times) taken inside the subprocess. diffusers' side: from_pretrained, __call__,
save. dmap's side: the CLI runs as a user's `dmap run` does, with `dm_cli.run.sessions.single.run`,
`check_component_files`, `make_run_plan`, `StageLoop.__init__` and `save_images` wrapped to timestamp
their calls and the run's own `on_status` / `on_step` callbacks (what the renderer draws) wrapped to
timestamp each status message: resolving SOURCE and settling, the safetensors header checks, planning
(the inline plan), the pipeline object (placeholders, tokenizers, scheduler), loading each stage's
components, encode, denoise, decode, writing the PNG with its metadata, rendering the summary; plus
importing dm_cli's modules (outside the in-process clock) and the interpreter with the shared imports
(process wall minus everything timed inside).

torch runs on ONE intra-op thread by default (--threads N to change; 0 = torch's default), so a
neighbour on another core does not turn thread barriers into noise.

Case `--case sd15-mid` (issue 31): the same pipeline, fp32, 256x256, 8 steps (--steps), CFG 7.5, as two WHOLE
processes side by side, nothing shared and nothing wrapped: `dmap run FOLDER --prompt ...` as a user types it (the
`dmap` console script of this interpreter, its tables printed to a pipe) against a process that runs diffusers' own
`StableDiffusionPipeline.from_pretrained(FOLDER)(...)` and saves the image. One torch thread on both sides
(OMP_NUM_THREADS / MKL_NUM_THREADS = --threads, and torch.set_num_threads in the diffusers script). dmap runs once
first to warm its caches (the skeleton and meta-trace cache in a cache dir of the benchmark's own, DMAP_CACHE_DIR;
the OS page cache for the weights on both sides), then --repeats rounds, the two sides alternating which goes
first; the table gives medians and bests of the process wall and CPU time, and the median of the per-round ratios
(the robust figure on a shared machine). Every PNG is compared pixel for pixel with diffusers' first. `--phases N` adds N instrumented rounds
(not in the ratios): the same two processes with a timestamp at the end of each phase, dmap's CLI entered as its
console script enters it, so the interpreter's teardown at exit is the last phase of both.

Usage: .venv/bin/python scripts/bench_run.py [--repeats N] [--threads N] [--steps 8,50] [--size 256]
       [--rows call,recipe,dmap,tracker]
       .venv/bin/python scripts/bench_run.py --case sd15-mid [--repeats 10] [--phases 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT, SEED, GUIDANCE = "a red fox in the snow", 0, 7.5
SIZE = 256  # --size: every side is given the size (the models' configs do not depend on it)
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
        "out_channels": 3, "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 32, "sample_size": 128,
        "scaling_factor": 0.18215,
    },
}

# The same imports on every side before the in-process clock starts.
PRELUDE = r"""
import json, os, resource, sys, time, warnings
MARKS = []  # (phase, wall, cpu) at its end, in order
def mark(phase):
    MARKS.append((phase, time.perf_counter(), time.process_time()))
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
print(json.dumps({"wall": wall, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "marks": MARKS, "t0": [t, cpu0]}))
"""

DMAP = r"""
mark("shared imports")
from dm_cli.cli import main  # dmap's own modules: outside the in-process clock, inside the process one
import dm_cli.cli.run, dm_cli.planning.make, dm_cli.render.plan, dm_cli.render.run, dm_cli.run.request
import dm_cli.run.sessions.single, dm_cli.run.loops.stages, dm_cli.run.settle.checks
mark("importing dm_cli")
install_marks()
t, cpu0 = time.perf_counter(), sum(os.times()[:2])
sys.argv = ["dmap", *ARGS]
try:
    main()  # as the console script calls it: the process's own exit path
except SystemExit as done:
    if done.code:
        sys.exit(done.code)
finish_marks()
""" + DONE

DIFFUSERS_CALL = r"""
mark("shared imports")
t, cpu0 = time.perf_counter(), sum(os.times()[:2])
pipe = StableDiffusionPipeline.from_pretrained(FOLDER)
pipe.set_progress_bar_config(disable=True)
mark("from_pretrained")
def timed(inner, before, after):  # the parts of __call__, timestamped
    def call(*args, **kwargs):
        mark(before)
        out = inner(*args, **kwargs)
        mark(after)
        return out
    return call
pipe.encode_prompt = timed(pipe.encode_prompt, "__call__: checks, before encode", "__call__: encode")
pipe.vae.decode = timed(pipe.vae.decode, "__call__: denoise (and preparing latents)", "__call__: decode")
image = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
             generator=torch.Generator().manual_seed(SEED)).images[0]
mark("__call__: to PIL")
image.save(OUT)
mark("save")
""" + DONE

# dmap's phases: wrappers that timestamp (`mark`) the end of each phase of a CLI run, the renderer's
# callbacks included. What a status message starts ends at the next message.
MARKS_DMAP = r"""
def install_marks():
    import functools
    import dm_cli.run.request as request, dm_cli.run.sessions.single as single, dm_cli.run.loops.stages as stages
    import dm_cli.run.settle.checks as settle_checks
    state = {"phase": "settle (SOURCE, defaults)"}

    def switch(phase):
        mark(state["phase"])
        state["phase"] = phase

    def wrap(owner, name, before=None, after=None):
        inner = getattr(owner, name)
        @functools.wraps(inner)
        def outer(*args, **kwargs):
            before and before()
            out = inner(*args, **kwargs)
            after and after()
            return out
        setattr(owner, name, outer)

    def status_phase(message):
        if message is not None and message.startswith("Loading "):
            switch("load " + message.split()[1])
        elif message is not None and message.startswith("Importing "):  # torch, diffusers, transformers
            switch("import torch, diffusers, transformers")
        elif message is None and state["phase"].startswith("load "):
            switch("between stages (free, glue)")

    def run(request_, on_plan=None, on_step=None, on_status=None):
        def status(message):
            status_phase(message)
            on_status is not None and on_status(message)
        result = original(request_, on_plan, on_step, status)
        switch("rendering (summary, CLI exit)")
        return result

    original = single.run
    single.run = run
    checks = lambda: state["phase"] != "header checks" and switch("header checks")
    wrap(settle_checks, "check_component_files", before=checks)
    wrap(settle_checks, "make_run_plan", before=lambda: switch("planning (inline plan)"),
         after=lambda: switch("plan checked and shown"))
    wrap(stages.StageLoop, "__init__", before=lambda: switch("pipeline object (placeholders, tokenizers, scheduler)"),
         after=lambda: switch("run start"))
    for name in ("encode", "denoise", "decode"):
        wrap(stages.StageRunners, name, before=lambda name=name: switch(name),  # the loop's runners (issue 56)
             after=lambda: switch("between stages (free, glue)"))
    wrap(single, "save_images", before=lambda: switch("write PNG (metadata)"), after=lambda: switch("run end"))
    globals()["finish_marks"] = lambda: mark(state["phase"])
"""
DMAP = MARKS_DMAP + DMAP

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


def _run_args(folder: Path, steps: int, out: str, size: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["run", str(folder), "--prompt", PROMPT, "--seed", str(SEED), "--steps", str(steps), "--height", str(size),
            "--width", str(size), "--guidance-scale", str(GUIDANCE), "--output", out, "--overwrite", *extra]


def _once(code: str, folder: Path, steps: int, out: str, threads: int, size: int, args: list[str] | None = None) -> dict:
    header = (f"PROMPT, SEED, STEPS, SIZE, GUIDANCE, FOLDER, OUT, THREADS, ARGS = {PROMPT!r}, {SEED}, {steps}, "
              f"{size}, {GUIDANCE}, {str(folder)!r}, {out!r}, {threads}, {args!r}\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", header + PRELUDE + code], capture_output=True, text=True, check=False,
                          env={**os.environ, "COLUMNS": "120"})
    process_wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = process_wall
    result["process_cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    result["phases"] = _phases(result)
    return result


def _phases(result: dict) -> dict[str, tuple[float, float]]:
    """Phase -> (CPU s, wall s) from the subprocess's marks (each mark ends its phase; a name may recur)."""
    marks = result["marks"]
    _, wall0, cpu0 = marks[0]  # "shared imports" ends: what came before is the interpreter and the shared imports
    phases: dict[str, list[float]] = {}
    previous = (wall0, cpu0)
    for name, wall, cpu in marks[1:]:
        entry = phases.setdefault(name, [0.0, 0.0])
        entry[0] += cpu - previous[1]
        entry[1] += wall - previous[0]
        previous = (wall, cpu)
    timed_cpu, timed_wall = previous[1] - cpu0, previous[0] - wall0
    phases = {"interpreter, shared imports, exit": [result["process_cpu"] - timed_cpu, result["process"] - timed_wall],
              **phases}
    return {name: (cpu, wall) for name, (cpu, wall) in phases.items()}


def _pixels(path: str):
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image)


DMAP_ROW = "dmap run (plans inline, warm cache)"
COLUMNS = ("cpu", "wall", "process_cpu", "process")


def _kinds(folder: Path, threads: int, size: int, rows: set[str]) -> dict:
    kinds = {
        "call": (BASE_ROW, lambda steps, out: _once(DIFFUSERS_CALL, folder, steps, out, threads, size)),
        "recipe": ("diffusers staged recipe (hand-written)",
                   lambda steps, out: _once(RECIPE, folder, steps, out, threads, size)),
        "dmap": (DMAP_ROW, lambda steps, out: _once(DMAP, folder, steps, out, threads, size,
                                                    _run_args(folder, steps, out, size))),
        "tracker": ("dmap run --track-activations (per-op tracker, the old CPU default)",
                    lambda steps, out: _once(DMAP, folder, steps, out, threads, size,
                                             _run_args(folder, steps, out, size, ("--track-activations",)))),
    }
    return {label: call for key, (label, call) in kinds.items() if key in rows | {"call"}}


def _print_ratios(step_counts: list[int], kinds: dict, runs: dict, outputs: dict, stat=statistics.median) -> None:
    import numpy as np

    print("| steps | runner | in-process CPU s | ratio | in-process wall s | ratio | process CPU s | ratio "
          "| process wall s | ratio | peak RSS | same pixels |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for steps in step_counts:
        reference = _pixels(outputs[(steps, BASE_ROW)])
        med = {(k, col): stat(r[col] for r in runs[(steps, k)]) for k in kinds for col in COLUMNS}
        rss = {k: max(r["rss"] for r in runs[(steps, k)]) for k in kinds}
        for k in kinds:
            same = "yes" if np.array_equal(_pixels(outputs[(steps, k)]), reference) else "NO"
            cells = " | ".join(f"{med[(k, col)]:.2f} | {med[(k, col)] / med[(BASE_ROW, col)]:.3f}" for col in COLUMNS)
            print(f"| {steps} | {k} | {cells} | {rss[k] / 1e6:.0f} MB | {same} |")


def _print_phases(step_counts: list[int], runs: dict) -> None:
    """dmap's phases beside diffusers' own call's, medians of CPU and wall seconds per phase."""
    print("\n| steps | runner | phase | CPU s | wall s |")
    print("|---:|---|---|---:|---:|")
    for steps in step_counts:
        for kind in (BASE_ROW, DMAP_ROW):
            if (steps, kind) not in runs:
                continue
            results = runs[(steps, kind)]
            names = list(dict.fromkeys(name for r in results for name in r["phases"]))
            short = "diffusers call" if kind == BASE_ROW else "dmap run"
            for name in names:
                cpu = statistics.median(r["phases"].get(name, (0.0, 0.0))[0] for r in results)
                wall = statistics.median(r["phases"].get(name, (0.0, 0.0))[1] for r in results)
                print(f"| {steps} | {short} | {name} | {cpu:.3f} | {wall:.3f} |")
            print(f"| {steps} | {short} | **whole process** | "
                  f"{statistics.median(r['process_cpu'] for r in results):.3f} | "
                  f"{statistics.median(r['process'] for r in results):.3f} |")


# --case sd15-mid: whole processes, nothing shared. diffusers' own call, as a user writes it.
PLAIN_DIFFUSERS = r"""
import torch
if THREADS:
    torch.set_num_threads(THREADS)
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained(FOLDER)
image = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
             generator=torch.Generator().manual_seed(SEED)).images[0]
image.save(OUT)
"""

# --phases: the same two processes with timestamps (perf_counter, process_time) at the end of each phase, printed
# to stderr as the last thing before the interpreter's teardown (which is what is left of the process's time).
_PHASE_HEAD = r"""
import json, sys, time
MARKS = []
def mark(phase):
    MARKS.append((phase, time.perf_counter(), time.process_time()))
mark("interpreter start")
"""
_PHASE_TAIL = r"""
def report():
    print("BENCH-MARKS " + json.dumps(MARKS), file=sys.stderr)
"""
PHASED_DIFFUSERS = _PHASE_HEAD + _PHASE_TAIL + r"""
import torch
if THREADS:
    torch.set_num_threads(THREADS)
mark("import torch")
from diffusers import StableDiffusionPipeline
mark("import diffusers' pipeline (diffusers, transformers)")
pipe = StableDiffusionPipeline.from_pretrained(FOLDER)
mark("from_pretrained")
image = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
             generator=torch.Generator().manual_seed(SEED)).images[0]
mark("__call__ (encode, denoise, decode)")
image.save(OUT)
mark("save")
report()
"""
PHASED_DMAP = _PHASE_HEAD + _PHASE_TAIL + MARKS_DMAP + r"""
from dm_cli.cli import main
mark("importing dm_cli's CLI (typer)")
install_marks()
sys.argv = ["dmap", *ARGS]
try:
    main()  # as the console script calls it: the process's own exit path
except SystemExit as done:
    finish_marks()
    report()
    raise
"""


def _dmap_command() -> list[str]:
    """`dmap` as a user runs it: this interpreter's console script (else `python -m dm_cli`)."""
    script = Path(sys.executable).with_name("dmap")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dm_cli"]


def _whole_process(argv: list[str], threads: int, cache: Path) -> dict:
    """One whole process on the clock: wall; its own CPU time and peak RSS (wait4); its stderr. `cache`: dmap's
    cache dir, the benchmark's own (warmed by its first run; nothing else on the machine can clear it)."""
    env = {**os.environ, "COLUMNS": "120", "DMAP_CACHE_DIR": str(cache)}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed ({proc.returncode}): {argv[:3]}\n{stderr[-3000:]}")
    return {"process": wall, "process_cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
            "stderr": stderr}


def _marked_phases(result: dict) -> dict[str, tuple[float, float]]:
    """Phase -> (CPU s, wall s) from a --phases process's marks; the rest of the process (interpreter start before
    the first mark, teardown after the last) is its own phase."""
    line = [x for x in result["stderr"].splitlines() if x.startswith("BENCH-MARKS ")][-1]
    marks = json.loads(line.split(" ", 1)[1])
    phases: dict[str, list[float]] = {}
    for (_, wall0, cpu0), (name, wall, cpu) in zip(marks, marks[1:]):
        entry = phases.setdefault(name, [0.0, 0.0])
        entry[0] += cpu - cpu0
        entry[1] += wall - wall0
    timed_cpu, timed_wall = marks[-1][2] - marks[0][2], marks[-1][1] - marks[0][1]
    phases["interpreter start + teardown at exit"] = [result["process_cpu"] - timed_cpu,
                                                      result["process"] - timed_wall]
    return {name: (cpu, wall) for name, (cpu, wall) in phases.items()}


def _case_sd15_mid(folder: Path, tmp: Path, step_counts: list[int], threads: int, size: int, rounds: int,
                   phase_rounds: int) -> None:
    """Whole-process `dmap run` against a process running diffusers' own call (see the module's docstring)."""
    import numpy as np

    cache = tmp / "dmap-cache"

    def header(steps: int, out: str, args=None) -> str:
        return (f"PROMPT, SEED, STEPS, SIZE, GUIDANCE, FOLDER, OUT, THREADS, ARGS = {PROMPT!r}, {SEED}, {steps}, "
                f"{size}, {GUIDANCE}, {str(folder)!r}, {out!r}, {threads}, {args!r}\n")

    def diffusers_side(steps: int, out: str, phased: bool = False) -> dict:
        return _whole_process([sys.executable, "-c", header(steps, out) + (PHASED_DIFFUSERS if phased
                                                                            else PLAIN_DIFFUSERS)], threads, cache)

    def dmap_side(steps: int, out: str, phased: bool = False) -> dict:
        args = _run_args(folder, steps, out, size)
        if phased:
            return _whole_process([sys.executable, "-c", header(steps, out, args) + PHASED_DMAP], threads, cache)
        return _whole_process(_dmap_command() + args, threads, cache)

    sides = {"diffusers": ("diffusers' own call (from_pretrained + __call__ + save)", diffusers_side),
             "dmap": ("`dmap run` (plans inline, warm cache)", dmap_side)}
    warm = str(tmp / "warm.png")  # dmap's skeleton/trace cache and the OS page cache, outside the rounds
    dmap_side(1, warm)
    diffusers_side(1, warm)
    print(f"Case sd15-mid: whole processes. SD 1.5-architecture pipeline, random weights: UNet widths {UNET_WIDTHS} "
          f"(fp32), {size}x{size}, CFG {GUIDANCE}, seed {SEED}, CPU, torch threads {threads or 'default'}; dmap warmed "
          f"once (its cache dir, the page cache); {rounds} rounds, the sides alternating which runs first\n")
    print("| steps | runner | rounds | process wall s (median) | best | process CPU s (median) | best | peak RSS "
          "| same pixels |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|:---:|")
    summary, phase_runs = [], {}
    for steps in step_counts:
        runs: dict[str, list[dict]] = {key: [] for key in sides}
        outs: dict[str, list[str]] = {key: [] for key in sides}
        for i in range(rounds + phase_rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for key in order:
                out = str(tmp / f"whole-{steps}-{key}-{i}.png")
                if i < rounds:
                    runs[key].append(sides[key][1](steps, out))
                    outs[key].append(out)
                else:  # the instrumented rounds come after the clean ones and are not in the ratios
                    phase_runs.setdefault((steps, key), []).append(sides[key][1](steps, out, phased=True))
        reference = _pixels(outs["diffusers"][0])
        for key, (label, _) in sides.items():
            same = all(np.array_equal(_pixels(out), reference) for out in outs[key])
            walls = [r["process"] for r in runs[key]]
            cpus = [r["process_cpu"] for r in runs[key]]
            print(f"| {steps} | {label} | {rounds} | {statistics.median(walls):.2f} | {min(walls):.2f} | "
                  f"{statistics.median(cpus):.2f} | {min(cpus):.2f} | {max(r['rss'] for r in runs[key]) / 1e6:.0f} MB "
                  f"| {'yes' if same else 'NO'} |")
        paired = [m["process"] / d["process"] for m, d in zip(runs["dmap"], runs["diffusers"])]
        paired_cpu = [m["process_cpu"] / d["process_cpu"] for m, d in zip(runs["dmap"], runs["diffusers"])]
        med = {k: statistics.median(r["process"] for r in runs[k]) for k in sides}
        best = {k: min(r["process"] for r in runs[k]) for k in sides}
        med_cpu = {k: statistics.median(r["process_cpu"] for r in runs[k]) for k in sides}
        summary.append(f"| {steps} | {med['dmap'] / med['diffusers']:.3f} | {best['dmap'] / best['diffusers']:.3f} | "
                       f"{statistics.median(paired):.3f} | {med_cpu['dmap'] / med_cpu['diffusers']:.3f} | "
                       f"{statistics.median(paired_cpu):.3f} | " + ", ".join(f"{r:.3f}" for r in paired) + " |")
    print("\ndmap / diffusers:\n")
    print("| steps | wall: ratio of medians | wall: ratio of bests | wall: median of per-round ratios "
          "| CPU: ratio of medians | CPU: median of per-round ratios | wall ratio per round |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(summary))
    if phase_runs:
        print(f"\nPhases ({phase_rounds} instrumented rounds after the clean ones, medians; `-c` scripts with "
              "timestamps, dmap's CLI entered as its console script enters it):\n")
        print("| steps | runner | phase | CPU s | wall s |")
        print("|---:|---|---|---:|---:|")
        for (steps, key), results in phase_runs.items():
            phases = [_marked_phases(r) for r in results]
            names = list(dict.fromkeys(name for p in phases for name in p))
            for name in names:
                cpu = statistics.median(p.get(name, (0.0, 0.0))[0] for p in phases)
                wall = statistics.median(p.get(name, (0.0, 0.0))[1] for p in phases)
                print(f"| {steps} | {key} | {name} | {cpu:.3f} | {wall:.3f} |")
            print(f"| {steps} | {key} | **whole process** | {statistics.median(r['process_cpu'] for r in results):.3f} "
                  f"| {statistics.median(r['process'] for r in results):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("rows", "sd15-mid"), default="rows",
                        help="rows: the in-process rows and phases (default); sd15-mid: whole processes, dmap run vs "
                             "diffusers' own call (issue 31)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind (rounds for --case sd15-mid)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (0: torch default)")
    parser.add_argument("--steps", default=None, help="comma-separated step counts (default 8,50; sd15-mid: 8)")
    parser.add_argument("--size", type=int, default=SIZE, help="height and width (128: the older table's case)")
    parser.add_argument("--rows", default="call,recipe,dmap,tracker",
                        help="which rows besides diffusers' call: recipe, dmap, tracker (comma-separated)")
    parser.add_argument("--phases", type=int, default=0,
                        help="sd15-mid: this many more rounds with timestamps per phase (not in the ratios)")
    parser.add_argument("--model-dir", default=None, help="where to build (or find) the bench pipeline")
    options = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-run-"))
    threads, size = options.threads, options.size
    step_counts = [int(s) for s in (options.steps or ("8" if options.case == "sd15-mid" else "8,50")).split(",")]
    folder = build_pipeline(Path(options.model_dir or tmp / "sd15-mid"))  # outside any timing
    # dm_cli's bytecode, as a wheel install has it (an editable install under PYTHONDONTWRITEBYTECODE, as on the
    # machine these tables come from, would compile every dmap module from source in every process)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).resolve().parents[1] / "dm_cli")],
                   check=True, stdout=subprocess.DEVNULL)
    if options.case == "sd15-mid":
        _case_sd15_mid(folder, tmp, step_counts, threads, size, options.repeats, options.phases)
        return
    kinds = _kinds(folder, threads, size, set(options.rows.split(",")))
    warm = str(tmp / "warm.png")  # warms dmap's cache and the OS page cache
    _once(DMAP, folder, 1, warm, threads, size, _run_args(folder, 1, warm, size))
    _once(DIFFUSERS_CALL, folder, 1, warm, threads, size)
    runs: dict[tuple, list] = {(steps, k): [] for steps in step_counts for k in kinds}
    outputs: dict[tuple, str] = {}
    for i in range(options.repeats):
        for steps in step_counts:
            for n, (kind, call) in enumerate(kinds.items()):
                out = str(tmp / f"{steps}-{n}-{i}.png")
                runs[(steps, kind)].append(call(steps, out))
                outputs.setdefault((steps, kind), out)
    print(f"SD 1.5-architecture pipeline, random weights: UNet widths {UNET_WIDTHS} (fp32), {size}x{size}, CFG "
          f"{GUIDANCE}, seed {SEED}, CPU, torch threads {threads or 'default'}; {options.repeats} runs of each "
          "(subprocesses, alternating)\n")
    _print_ratios(step_counts, kinds, runs, outputs)
    print("\nBest of the runs (on a shared machine the CPU time of the same denoising loop moves by 10-30%):\n")
    _print_ratios(step_counts, kinds, runs, outputs, min)
    _print_phases(step_counts, runs)
    if os.environ.get("BENCH_RAW"):
        Path(os.environ["BENCH_RAW"]).write_text(json.dumps({f"{s}|{k}": v for (s, k), v in runs.items()}))


if __name__ == "__main__":
    main()

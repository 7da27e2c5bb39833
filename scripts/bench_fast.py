"""Benchmark: `--compile` against eager, and dmap against `diffusers-cli run`, eager and compiled (issue 55).

The demo pipeline (`dmap demo`'s FLUX-architecture folder, random weights, float32), on the CPU, one torch thread on
every side (OMP_NUM_THREADS / MKL_NUM_THREADS = --threads), everything in whole subprocesses started by this script.

Table 1, eager against compiled inside dmap (`dm_cli.load(FOLDER, compile=...)`, one process per row and size, the
two kinds alternating): at each --sizes (default 128, 256, 512), one image of --steps steps, then a second the same;
"cold s" is the first image's denoise (the cold compile, dynamo and inductor, included; inductor's kernel cache is
whatever this machine has), "compile s" what dynamo reports it spent compiling, "s/step" the second image's denoise
seconds per step (steady state), medians over --repeats.

Table 2, whole processes, the issue's case (--size 256, --steps 8, seed 0): `dmap run FOLDER --prompt P` against
`diffusers-cli run -m FOLDER --device-map cpu --seed 0 --pipeline-kwargs {...}` (the same model, size, steps, seed,
guidance), both eager, then both with `--compile` (dmap's regional; diffusers-cli's bare `--compile`, which is its
`compile_repeated_blocks(fullgraph=True)` too), --pairs rounds of the four processes, which side goes first alternating;
medians of the process wall seconds and the median of the per-pair ratios (dmap / diffusers-cli), then each pair's
ratios, wall and CPU (`--kinds eager` runs the eager pairs alone). Every image is
compared with diffusers-cli eager's: the largest pixel difference (0-255). Every dmap process imports one copy of
dm_cli taken at the start (`snapshot`), so edits to the tree mid-bench cannot re-plan inside a timed run.

Usage: .venv/bin/python scripts/bench_fast.py [--sizes 128,256,512] [--steps 8] [--repeats 1] [--pairs 2]
       [--size 256] [--threads 1] [--skip table1|table2] [--kinds eager,compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red fox in the snow"
DIFFUSERS_CLI = Path(sys.executable).parent / "diffusers-cli"
DMAP = Path(sys.executable).parent / "dmap"
CODE: Path | None = None  # the snapshot of dm_cli the dmap processes import (main sets it)

# one dmap process of table 1: load, two images, the denoise seconds of each and dynamo's compile seconds
IN_PROCESS = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[4]))
import dm_cli
from dm_cli.run.hooks.compile import compile_seconds
folder, size, steps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
with dm_cli.load(folder, height=size, width=size, compile=mode) as session:
    runs = []
    for _ in range(2):
        before = session.stage_totals["denoise"]["run_s"]
        list(session.generate([sys.argv[6]], seed=0, steps=steps))
        runs.append(session.stage_totals["denoise"]["run_s"] - before)
    print("RESULT " + json.dumps({"cold_s": runs[0], "steady_s": runs[1], "compile_s": compile_seconds(),
                                  "notices": session.notices}))
"""


def env(threads: int) -> dict:
    code = {"PYTHONPATH": str(CODE)} if CODE is not None else {}
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", **code}


def snapshot() -> Path:
    """A copy of dm_cli that every dmap process of the bench runs. dmap's caches are keyed by a digest of its code
    (io/cache.py), so a file edited in the tree mid-bench (a shared tree) made the next dmap process re-plan, about
    5 s of CPU counted as dmap's; the warm-up fills the snapshot's caches once."""
    target = Path(tempfile.mkdtemp(prefix="bench_fast-code-"))
    shutil.copytree(REPO / "dm_cli", target / "dm_cli", ignore=shutil.ignore_patterns("__pycache__"))
    return target


def demo_folder() -> str:
    from dm_cli.model.demo import ensure_demo

    return str(ensure_demo())


def in_process(folder: str, size: int, steps: int, mode: str, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, folder, str(size), str(steps), str(threads), mode, PROMPT],
                          capture_output=True, text=True, env=env(threads), cwd=REPO)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise SystemExit(f"dm_cli.load(compile={mode}) at {size}px failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table1(folder: str, sizes: list[int], steps: int, repeats: int, threads: int) -> None:
    print(f"Table 1: dmap eager against --compile regional, demo pipeline, {steps} steps, {threads} thread(s), "
          f"medians of {repeats}")
    print("| size | eager s/step | compiled s/step | steady ratio | compiled cold denoise s | of which compile s "
          "| eager denoise s |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        runs = {"none": [], "regional": []}
        for repeat in range(repeats):
            order = ("none", "regional") if repeat % 2 == 0 else ("regional", "none")
            for mode in order:
                runs[mode].append(in_process(folder, size, steps, mode, threads))
        med = {mode: {key: statistics.median(r[key] for r in rs) for key in ("cold_s", "steady_s", "compile_s")}
               for mode, rs in runs.items()}
        eager, compiled = med["none"], med["regional"]
        print(f"| {size}x{size} | {eager['steady_s'] / steps:.3f} | {compiled['steady_s'] / steps:.3f} | "
              f"{compiled['steady_s'] / eager['steady_s']:.2f}x | {compiled['cold_s']:.1f} | {compiled['compile_s']:.1f} "
              f"| {eager['cold_s']:.1f} |", flush=True)


def dmap_command(folder: str, size: int, steps: int, out: Path, compiled: bool) -> list[str]:
    return [str(DMAP), "run", folder, "--prompt", PROMPT, "--height", str(size), "--width", str(size), "--steps",
            str(steps), "--seed", "0", "-o", str(out), "--overwrite", "--quiet",
            *(["--compile", "regional"] if compiled else [])]


def diffusers_command(folder: str, size: int, steps: int, out: Path, compiled: bool) -> list[str]:
    kwargs = {"prompt": PROMPT, "height": size, "width": size, "num_inference_steps": steps}
    return [str(DIFFUSERS_CLI), "run", "-m", folder, "--device-map", "cpu", "--seed", "0",
            "--pipeline-kwargs", json.dumps(kwargs), "-o", str(out), *(["--compile"] if compiled else [])]


def timed(command: list[str], threads: int) -> tuple[float, float]:
    """(wall s, CPU s: user + system of the process and the children it waited for); CPU is what a machine shared
    with other jobs leaves steady."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env(threads), cwd=REPO)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:3])} failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return time.perf_counter() - start, cpu


def pixels(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def table2(folder: str, size: int, steps: int, pairs: int, threads: int,
           kinds: tuple[bool, ...] = (False, True)) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_fast-"))
    makers = {"dmap": dmap_command, "diffusers-cli": diffusers_command}
    times = {(tool, compiled): [] for tool in makers for compiled in kinds}
    for tool in makers:  # one untimed run each, eager and compiled: the page cache, dmap's caches, inductor's kernels
        for compiled in kinds:
            timed(makers[tool](folder, size, steps, work / f"warm-{tool}-{compiled}.png", compiled), threads)
    for pair in range(pairs):
        for compiled in kinds:
            tools = list(makers) if pair % 2 == 0 else list(reversed(makers))
            for tool in tools:
                out = work / f"{tool}-{compiled}.png"
                times[tool, compiled].append(timed(makers[tool](folder, size, steps, out, compiled), threads))
    reference = pixels(work / f"diffusers-cli-{kinds[0]}.png")  # eager's, unless --kinds compiled alone
    against = "--compile" if kinds[0] else "eager"
    print(f"\nTable 2: whole processes, demo pipeline {size}x{size}, {steps} steps, seed 0, float32, {threads} "
          f"thread(s), {pairs} pairs alternating (after one warm-up run each)")
    print("| kind | dmap s (median) | diffusers-cli s (median) | dmap / diffusers-cli (median of pairs) | "
          f"CPU s, dmap / diffusers-cli (medians) | max pixel diff vs diffusers-cli {against} (dmap, diffusers-cli) |")
    print("|---|---|---|---|---|---|")
    for compiled in kinds:
        ours, theirs = times["dmap", compiled], times["diffusers-cli", compiled]
        ratio = statistics.median(a[0] / b[0] for a, b in zip(ours, theirs))
        cpu = [statistics.median(run[1] for run in runs) for runs in (ours, theirs)]
        diffs = [int(abs(pixels(work / f"{tool}-{compiled}.png") - reference).max()) for tool in makers]
        print(f"| {'--compile' if compiled else 'eager'} | {statistics.median(run[0] for run in ours):.2f} | "
              f"{statistics.median(run[0] for run in theirs):.2f} | {ratio:.2f}x | {cpu[0]:.1f} / {cpu[1]:.1f} | "
              f"{diffs[0]}, {diffs[1]} |", flush=True)
    for compiled in kinds:  # each pair's ratios, wall and CPU, in the order they ran
        pairs_line = ", ".join(f"{a[0] / b[0]:.2f} ({a[1] / b[1]:.2f})"
                               for a, b in zip(times["dmap", compiled], times["diffusers-cli", compiled]))
        print(f"{'--compile' if compiled else 'eager'} per pair, dmap / diffusers-cli wall (CPU): {pairs_line}")
    if kinds != (False, True):
        return
    eager = statistics.median(run[0] for run in times["dmap", False])
    print(f"dmap --compile / dmap eager (whole process, inductor's cache warm): "
          f"{statistics.median(run[0] for run in times['dmap', True]) / eager:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="128,256,512")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip", choices=("table1", "table2"), default=None)
    parser.add_argument("--kinds", default="eager,compiled", help="table 2's kinds: eager, compiled or both")
    args = parser.parse_args(argv)
    global CODE
    folder, CODE = demo_folder(), snapshot()
    print(f"torch {__import__('torch').__version__}, diffusers {__import__('diffusers').__version__}, "
          f"{os.cpu_count()} CPUs; demo folder {folder}")
    if args.skip != "table1":
        table1(folder, [int(s) for s in args.sizes.split(",")], args.steps, args.repeats, args.threads)
    if args.skip != "table2":
        kinds = tuple(kind == "compiled" for kind in ("eager", "compiled") if kind in args.kinds.split(","))
        table2(folder, args.size, args.steps, args.pairs, args.threads, kinds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

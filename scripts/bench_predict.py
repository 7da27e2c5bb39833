"""Benchmark: the step time `dmap plan` predicts against what `dmap run` measures, case by case, on this CPU (issue 42).

First `dmap calibrate` measures this CPU into a profile (one torch thread: OMP_NUM_THREADS=1 for every process here,
so that two helpers' runs on a shared machine do not fight over threads). Then for each case (family x size x layout):
`dmap plan ... --profile P --steps S --json` gives the predicted seconds per denoising step; `dmap run ... --json` is
run at two step counts, S1 and S2, and the measured step is the difference of the denoise stage's run times over the
difference of the steps (the first step's one-off costs, the encoders and the decoder cancel out). Queue cases divide
by the prompts too. The smallest of --repeats runs at each step count is kept (the machine's other load only slows a
run down). Error = predicted / measured - 1.

Layouts: resident (everything on the CPU), split (two simulated GPUs, `--simulate`: the denoiser's blocks over two
devices of this CPU), offload (a simulated GPU too small for the denoiser: its weights stream in every step from the
checkpoint), queue (3 prompts). Each case is measured in a fresh process through dmap's API (`load`, `generate`: the
plan `dmap run` makes) timing each denoising step between `on_step` calls, on the main thread's CPU clock (with one
torch thread it does all the work; other processes on a shared machine do not inflate it) and on the wall clock.

Usage: OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_predict.py [--repeats 1] [--cases a,b] [--steps 2,6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DMAP = [sys.executable, "-m", "dm_cli"]
# name -> (source: "demo" or a tiny preset written with `dmap demo`, extra args for plan and run, prompts)
CASES = {
    "demo-256": ("demo", ["--height", "256", "--width", "256"], 1),
    "demo-384": ("demo", ["--height", "384", "--width", "384"], 1),
    "demo-512": ("demo", ["--height", "512", "--width", "512"], 1),
    "demo-256-split": ("demo", ["--height", "256", "--width", "256", "-m", "0=40MB,1=40MB,cpu=4GB", "--overhead",
                                "0=0,1=0", "--mode", "staged", "--simulate"], 1),
    "demo-256-offload": ("demo", ["--height", "256", "--width", "256", "-m", "0=24MB,cpu=4GB", "--mode", "staged",
                                  "--simulate"], 1),
    "demo-256-queue3": ("demo", ["--height", "256", "--width", "256"], 3),
    "tiny-flux-128": ("tiny-flux", ["--height", "128", "--width", "128"], 1),
    "tiny-flux-256": ("tiny-flux", ["--height", "256", "--width", "256"], 1),
    "tiny-sd15-128": ("tiny-sd15", ["--height", "128", "--width", "128"], 1),
    "tiny-sd15-256": ("tiny-sd15", ["--height", "256", "--width", "256"], 1),
    "tiny-qwenimage-128": ("tiny-qwenimage", ["--height", "128", "--width", "128"], 1),
    "tiny-sd3-64": ("tiny-sd3", ["--height", "64", "--width", "64"], 1),  # its pos_embed stops at 64 pixels
    "tiny-zimage-128": ("tiny-zimage", ["--height", "128", "--width", "128"], 1),
}
RUN_ONLY = ("--simulate",)


def dmap(*args: str, env: dict) -> dict:
    proc = subprocess.run([*DMAP, *args], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"dmap {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


def denoise_seconds(result: dict) -> float:
    """The denoise stage's run time (summed over a queue's chunks)."""
    stages = result.get("stages", [])
    if isinstance(stages, dict):  # a queue's: stage name -> totals
        return stages.get("denoise", {}).get("run_s", 0.0)
    return sum(stage.get("run_s", 0.0) for stage in stages if stage.get("name") == "denoise")


def measure_in_process(source: str, extra: list[str], prompts: int, steps: int, env: dict) -> dict:
    """One case measured in a fresh process (`--measure`): the median step, on the main thread's CPU clock and on the
    wall clock."""
    spec = json.dumps({"source": source, "extra": extra, "prompts": prompts, "steps": steps})
    proc = subprocess.run([sys.executable, __file__, "--measure", spec], capture_output=True, text=True, env=env,
                          cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"measuring {spec} failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(spec: dict) -> dict:
    """Load the case's pipeline with dmap's API (as `dmap run` would: the same plan), generate once to warm up, then
    again timing each denoising step from one `on_step` call to the next (the first step of each prompt left out):
    the median on the thread's CPU clock (what a machine shared with other work does not inflate; with one torch
    thread the main thread does all the work) and on the wall clock."""
    import time

    from dm_cli.api import load

    extra = spec["extra"]
    options = {"height": int(extra[extra.index("--height") + 1]), "width": int(extra[extra.index("--width") + 1])}
    if "-m" in extra:
        options["max_memory"] = extra[extra.index("-m") + 1]
    if "--overhead" in extra:
        options["overhead"] = extra[extra.index("--overhead") + 1]
    if "--mode" in extra:
        options["mode"] = extra[extra.index("--mode") + 1]
    session = load(None if spec["source"] == "demo" else spec["source"], simulate="--simulate" in extra, **options)
    prompts = [f"a cat number {i}" for i in range(spec["prompts"])]
    list(session.generate(prompts, steps=2))
    marks: list[tuple[int, float, float]] = []
    list(session.generate(prompts, steps=spec["steps"],
                          on_step=lambda step, *_: marks.append((step, time.perf_counter(), time.thread_time()))))
    walls = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    cpus = [b[2] - a[2] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    return {"wall_step_s": statistics.median(walls), "cpu_step_s": statistics.median(cpus), "marks": len(marks)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", default="2,6", help="the two step counts S1,S2")
    parser.add_argument("--profile", help="use this profile instead of calibrating")
    args = parser.parse_args()
    s1, s2 = (int(x) for x in args.steps.split(","))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    work = Path(tempfile.mkdtemp(prefix="dmap-bench-predict-"))
    profile = args.profile or str(work / "profile.json")
    print(f"load average before: {os.getloadavg()}", flush=True)
    print("| case | predicted s/step | measured s/step (CPU clock) | error | measured s/step (wall) | error (wall) "
          "| largest predicted terms |\n|---|---|---|---|---|---|---|", flush=True)
    if not args.profile:
        subprocess.run([*DMAP, "calibrate", "-o", profile], check=True, env=env, cwd=REPO)
    sources = {}
    rows = []
    for name in args.cases.split(","):
        source, extra, prompts = CASES[name]
        if source != "demo" and source not in sources:
            folder = work / source
            subprocess.run([*DMAP, "demo", source, "-o", str(folder)], check=True, env=env, cwd=REPO,
                           capture_output=True)
            sources[source] = str(folder)
        where = sources.get(source, source)
        plan_args = [a for a in extra if a not in RUN_ONLY]
        planned = dmap("plan", where, *plan_args, "--steps", str(s2), "--queue", str(prompts), "--profile", profile,
                       "--no-check", "--json", env=env)
        predicted = planned.get("predicted_time")
        if not predicted:  # no family or no trace: nothing to compare
            print(f"| {name} | no prediction: {' '.join(planned.get('warnings', []))[:200]} |||||", flush=True)
            continue
        if prompts > 1:
            queue_file = work / f"{name}.txt"
            queue_file.write_text("".join(f"a cat number {i}\n" for i in range(prompts)))
            run_what = ["--prompts", str(queue_file), "-o", str(work / f"{name}-out"), "--no-resume"]
        else:
            run_what = ["-p", "a cat", "-o", str(work / f"{name}.png"), "--overwrite"]
        del run_what
        runs = [measure_in_process(where, extra, prompts, s2, env) for _ in range(args.repeats)]
        cpu = min(r["cpu_step_s"] for r in runs)
        wall = min(r["wall_step_s"] for r in runs)
        error = predicted["step_s"] / cpu - 1
        rows.append((name, predicted["step_s"], cpu, error, predicted["step_terms_s"]))
        top = sorted(predicted["step_terms_s"].items(), key=lambda item: -item[1])[:2]
        print(f"| {name} | {predicted['step_s']:.4f} | {cpu:.4f} | {error:+.0%} | {wall:.4f} | "
              f"{predicted['step_s'] / wall - 1:+.0%} | {', '.join(f'{k} {v:.3g}' for k, v in top)} |", flush=True)
    errors = [abs(r[3]) for r in rows]
    print(f"load average after: {os.getloadavg()}")
    print(f"cases {len(rows)}, within 25%: {sum(e <= 0.25 for e in errors)}, median |error| "
          f"{statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()

"""Benchmark: the step time `dmap plan` predicts against what `dmap run` measures, case by case, on this CPU (issue 42).

First `dmap calibrate` measures this CPU into a profile (one torch thread: OMP_NUM_THREADS=1 for every process here,
so that two helpers' runs on a shared machine do not fight over threads). Then for each case (family x size x layout):
`dmap plan ... --profile P --steps S --json` gives the predicted seconds per denoising step; `dmap run ... --json` is
run at two step counts, S1 and S2, and the measured step is the difference of the denoise stage's run times over the
difference of the steps (the first step's one-off costs, the encoders and the decoder cancel out). Queue cases divide
by the prompts too. The smallest of --repeats runs at each step count is kept (the machine's other load only slows a
run down). Error = predicted / measured - 1.

Layouts: resident (everything on the CPU), split (two simulated GPUs, `--simulate`: the denoiser's blocks over two
devices of this CPU), offload (a simulated GPU too small for the denoiser: its weights stream in every step), queue
(--prompts, 3 prompts).

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
    "demo-256-split": ("demo", ["--height", "256", "--width", "256", "-m", "0=30MB,1=30MB,cpu=4GB", "--mode", "staged",
                                "--simulate"], 1),
    "demo-256-offload": ("demo", ["--height", "256", "--width", "256", "-m", "0=24MB,cpu=4GB", "--mode", "staged",
                                  "--simulate"], 1),
    "demo-256-queue3": ("demo", ["--height", "256", "--width", "256"], 3),
    "tiny-flux-128": ("tiny-flux", ["--height", "128", "--width", "128"], 1),
    "tiny-flux-256": ("tiny-flux", ["--height", "256", "--width", "256"], 1),
    "tiny-sd15-128": ("tiny-sd15", ["--height", "128", "--width", "128"], 1),
    "tiny-sd15-256": ("tiny-sd15", ["--height", "256", "--width", "256"], 1),
    "tiny-qwenimage-128": ("tiny-qwenimage", ["--height", "128", "--width", "128"], 1),
    "tiny-sd3-128": ("tiny-sd3", ["--height", "128", "--width", "128"], 1),
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


def main() -> None:
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
        predicted = dmap("plan", where, *plan_args, "--steps", str(s2), "--queue", str(prompts), "--profile", profile,
                         "--no-check", "--json", env=env)["predicted_time"]
        if prompts > 1:
            queue_file = work / f"{name}.txt"
            queue_file.write_text("".join(f"a cat number {i}\n" for i in range(prompts)))
            run_what = ["--prompts", str(queue_file), "-o", str(work / f"{name}-out"), "--no-resume"]
        else:
            run_what = ["-p", "a cat", "-o", str(work / f"{name}.png"), "--overwrite"]
        times = {}
        for steps in (s1, s2):
            times[steps] = min(denoise_seconds(dmap("run", where, *run_what, *extra, "--steps", str(steps), "--json",
                                                    env=env)) for _ in range(args.repeats))
        measured = (times[s2] - times[s1]) / (s2 - s1) / prompts
        error = predicted["step_s"] / measured - 1 if measured > 0 else float("nan")
        rows.append((name, predicted["step_s"], measured, error, predicted["step_terms_s"]))
        top = sorted(predicted["step_terms_s"].items(), key=lambda item: -item[1])[:2]
        print(f"| {name} | {predicted['step_s']:.4f} | {measured:.4f} | {error:+.0%} | "
              f"{', '.join(f'{k} {v:.3g}' for k, v in top)} |", flush=True)
    errors = [abs(r[3]) for r in rows]
    print(f"load average after: {os.getloadavg()}")
    print(f"cases {len(rows)}, within 25%: {sum(e <= 0.25 for e in errors)}, median |error| "
          f"{statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()

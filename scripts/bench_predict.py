"""Benchmark: the step time `dmap plan` predicts against what `dmap run` measures, case by case, on this CPU (issue 42).

First `dmap calibrate` measures this CPU into a profile (one torch thread: OMP_NUM_THREADS=1 for every process here,
so that two helpers' runs on a shared machine do not fight over threads). Then for each case (family x size x layout):
`dmap plan ... --profile P --steps S --json` gives the predicted seconds per denoising step; the same case is
measured in a fresh process (below), --repeats times, and the median run kept; the plan is given the measured
prompt (`--prompt`: Qwen-Image and Z-Image run the text at its length). Error = predicted / measured - 1.

Layouts: resident (everything on the CPU), split (two simulated GPUs, `--simulate`: the denoiser's blocks over two
devices of this CPU), offload (a simulated GPU too small for the denoiser: its weights stream in every step from the
checkpoint), queue (3 prompts). The simulated rows are printed but left out of the goal: `--simulate` loads the
whole denoiser on this CPU (no accelerate hooks, no streaming) and runs the split check's device tagging on every op,
so it measures neither a split nor an offload; the prediction is of the GPUs the plan names (hops, hooks, weights
streamed), which one CPU cannot have. Each case is measured in a fresh process through dmap's API (`load`, `generate`: the
plan `dmap run` makes) timing each denoising step between `on_step` calls, on the main thread's CPU clock (with one
torch thread it does all the work; other processes on a shared machine do not inflate it) and on the wall clock.

2-rank groups (RANK_GROUPS): the same case on one rank and under `torchrun --nproc-per-node 2` with `--parallel
cfg`, `context` or `pipeline` (gloo, one torch thread per rank: each rank's CPU stands for its GPU of the plan, so
the calibrated link is gloo between two processes). Each layout's seconds per image-step are the denoise stage
(`dmap run --json`; the shortest of the ranks that report it: a rank that started first also waited for the other's
loading) at S2 steps less at S1 (--rank-steps, 2 and 10), over (S2 - S1) x prompts, on the wall clock (the ranks
wait on each other: a CPU clock would miss it), so they need a quiet machine; the prediction is `dmap plan
--world-size 2 --parallel LAYOUT`'s `predicted_time.layouts`. Then `--parallel auto`'s pick and reason against the
measured fastest layout ("one" stands for auto's split: one process), judged where the fastest is at least 10% faster
than the next, among the layouts for one prompt (auto picks the pipeline only where no layout that shares every step
fits: it speeds up a queue, and one prompt alone runs at the split's speed).

Usage: OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_predict.py [--repeats 3] [--cases a,b] [--steps 2,6]
       [--rank-steps 2,10]
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
# 2-rank groups (torchrun, gloo, one torch thread per rank: each rank's CPU stands for one GPU of the plan): name ->
# (source, args for plan and run, {layout: prompts}); "one" is the same case on one rank (the plan's resident CPU
# placement), each other layout `--parallel LAYOUT` over two ranks (GPUs 0 and 1 of the plan, RANK_MEMORY each).
# Seconds per denoising step (per image-step for the pipeline's queue of 2: both prompts in flight).
RANK_GROUPS = {
    "demo-256-ranks": ("demo", ["--height", "256", "--width", "256"], {"one": 1, "context": 1, "pipeline": 2}),
    "tiny-sd15-128-ranks": ("tiny-sd15", ["--height", "128", "--width", "128"], {"one": 1, "cfg": 1}),
}
RANK_MEMORY = "0=2GB,1=2GB"
RUN_ONLY = ("--simulate",)
PROMPT = "a cat number {}"  # the prompts measured; the plan predicts for the first (its text length)


def dmap(*args: str, env: dict) -> dict:
    proc = subprocess.run([*DMAP, *args], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"dmap {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


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
    prompts = [PROMPT.format(i) for i in range(spec["prompts"])]
    list(session.generate(prompts, steps=2))
    marks: list[tuple[int, float, float]] = []
    list(session.generate(prompts, steps=spec["steps"],
                          on_step=lambda step, *_: marks.append((step, time.perf_counter(), time.thread_time()))))
    walls = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    cpus = [b[2] - a[2] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    return {"wall_step_s": statistics.median(walls), "cpu_step_s": statistics.median(cpus), "marks": len(marks)}


def _results(output: str) -> list[dict]:
    """Every JSON object a launch printed (each rank of a queue prints its own)."""
    results, decoder = [], json.JSONDecoder()
    while "{" in output:
        obj, end = decoder.raw_decode(output, output.index("{"))
        results.append(obj)
        output = output[end:]
    return results


def denoise_seconds(where: str, extra: list[str], layout: str, prompts: int, steps: int, work: Path,
                    env: dict) -> float:
    """The denoise stage (`dmap run --json`: its run_s) of one launch, the shortest of the ranks that report it (the
    pipeline's both; a rank that started its stage first also waited for the other's loading): `dmap run` alone for
    "one", else under torchrun on 2 ranks with `--parallel LAYOUT`."""
    queue = work / f"prompts-{prompts}.txt"
    queue.write_text("".join(PROMPT.format(i) + "\n" for i in range(prompts)))
    what = ["--prompt", PROMPT.format(0), "--output", str(work / "one.png")] if prompts == 1 else [
        "--prompts", str(queue), "--output", str(work / f"queue-{layout}-{steps}"), "--overwrite"]
    args = ["run", where, *extra, *what, "--steps", str(steps), "--json", "--overwrite"]
    if layout == "one":
        command = [*DMAP, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                   "dm_cli", *args, "--max-memory", RANK_MEMORY, "--parallel", layout]  # each rank's CPU: its GPU
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    seconds = []
    for result in _results(proc.stdout):
        stages = result.get("stages")
        found = stages.get("denoise") if isinstance(stages, dict) else next(
            (stage for stage in stages or () if stage.get("name") == "denoise"), None)
        if found:
            seconds.append(float(found["run_s"]))
    if not seconds:
        raise SystemExit(f"{' '.join(command)} printed no denoise stage: {proc.stdout[-800:]}")
    return min(seconds)


def measure_ranks(where: str, extra: list[str], layout: str, prompts: int, s1: int, s2: int, repeats: int,
                  work: Path, env: dict) -> list[float]:
    """Seconds per image-step of `layout`, `repeats` times: the denoise stage at S2 steps less at S1, over (S2 - S1) x
    prompts (what the first step's warm-up, the encoders' broadcast and the pipeline's fill and drain cost cancels).
    S1 is launched once (the fixed part it cancels), S2 `repeats` times: a launch is seconds of imports and loading."""
    short = denoise_seconds(where, extra, layout, prompts, s1, work, env)
    return [(denoise_seconds(where, extra, layout, prompts, s2, work, env) - short) / ((s2 - s1) * prompts)
            for _ in range(repeats)]


def rank_group(name: str, sources: dict, profile: str, s1: int, s2: int, repeats: int, work: Path,
               env: dict) -> list[tuple]:
    """One 2-rank group: per layout the predicted and measured seconds per image-step (printed as rows), then what
    `--parallel auto` picks against the measured fastest. Returns the rows (name, predicted, measured, error)."""
    source, extra, layouts = RANK_GROUPS[name]
    where = sources[source]
    common = [*extra, "--profile", profile, "--steps", str(s2), "--prompt", PROMPT.format(0), "--no-check", "--json"]
    rows, measured = [], {}
    for layout, prompts in layouts.items():
        if layout == "one":
            planned = dmap("plan", where, *common, env=env)
            predicted = (planned.get("predicted_time") or {}).get("step_s")
        else:
            planned = dmap("plan", where, *common, "--max-memory", RANK_MEMORY, "--world-size", "2", "--parallel",
                           layout, env=env)
            predicted = (((planned.get("predicted_time") or {}).get("layouts") or {}).get(layout) or {}).get("step_s")
        runs = measure_ranks(where, extra, layout, prompts, s1, s2, repeats, work, env)
        seconds = statistics.median(runs)
        measured[layout] = seconds
        error = predicted / seconds - 1 if predicted else None
        rows.append((f"{name} {layout}", predicted, seconds, error))
        spread = f"{min(runs):.4f}-{max(runs):.4f}"
        print(f"| {name} {layout}{' (queue of 2, per image-step)' if prompts > 1 else ''} | "
              f"{predicted if predicted is None else f'{predicted:.4f}'} | {seconds:.4f} ({spread}) | "
              f"{'-' if error is None else f'{error:+.0%}'} | (wall, denoise stage) | | |", flush=True)
    auto = dmap("plan", where, *common, "--max-memory", RANK_MEMORY, "--world-size", "2", "--parallel", "auto",
                env=env).get("parallel") or {}
    picked = "one" if auto.get("layout") == "split" else auto.get("layout")  # the split runs as one rank would
    # auto chooses for one prompt: among the layouts that share every step, the pipeline only when none fits (it
    # speeds up a queue; one prompt alone runs at the split's speed), so it is judged among those
    ranked = sorted((layout for layout in measured if layout != "pipeline" or picked == "pipeline"), key=measured.get)
    margin = measured[ranked[1]] / measured[ranked[0]] - 1 if len(ranked) > 1 else 0.0
    verdict = ("right" if picked == ranked[0] else "WRONG") if margin >= 0.10 else "no clear fastest (<10%)"
    print(f"  auto on {name}: picks {picked} ({auto.get('reason', '')}); measured fastest {ranked[0]}, "
          f"{margin:.0%} faster than {ranked[1] if len(ranked) > 1 else '-'}: {verdict}", flush=True)
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case, the median kept")
    parser.add_argument("--cases", default=",".join([*CASES, *RANK_GROUPS]),
                        help=f"comma-separated; one-process cases: {', '.join(CASES)}; 2-rank groups: "
                             f"{', '.join(RANK_GROUPS)}")
    parser.add_argument("--steps", default="2,6", help="the two step counts S1,S2")
    parser.add_argument("--rank-steps", default="2,10", help="the 2-rank groups' step counts S1,S2 (whole launches "
                        "differenced: more steps than --steps, so that the steps outweigh a launch's noise)")
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
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES and n not in RANK_GROUPS]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}: use {', '.join([*CASES, *RANK_GROUPS])}")
    for name in names:
        source = (CASES.get(name) or RANK_GROUPS[name])[0]
        if source != "demo" and source not in sources:
            folder = work / source
            subprocess.run([*DMAP, "demo", source, "-o", str(folder)], check=True, env=env, cwd=REPO,
                           capture_output=True)
            sources[source] = str(folder)
        sources.setdefault(source, source)
    rank_rows = []
    for name in names:
        if name in RANK_GROUPS:
            r1, r2 = (int(x) for x in args.rank_steps.split(","))
            rank_rows += rank_group(name, sources, profile, r1, r2, args.repeats, work, env)
            continue
        source, extra, prompts = CASES[name]
        where = sources[source]
        plan_args = [a for a in extra if a not in RUN_ONLY]
        planned = dmap("plan", where, *plan_args, "--steps", str(s2), "--queue", str(prompts), "--profile", profile,
                       "--prompt", PROMPT.format(0), "--no-check", "--json", env=env)
        predicted = planned.get("predicted_time")
        if not predicted:  # no family or no trace: nothing to compare
            print(f"| {name} | no prediction: {' '.join(planned.get('warnings', []))[:200]} |||||", flush=True)
            continue
        runs = [measure_in_process(where, extra, prompts, s2, env) for _ in range(args.repeats)]
        cpu = statistics.median(r["cpu_step_s"] for r in runs)
        wall = statistics.median(r["wall_step_s"] for r in runs)
        error = predicted["step_s"] / cpu - 1
        simulated = "--simulate" in extra
        rows.append((name, predicted["step_s"], cpu, error, simulated))
        top = sorted(predicted["step_terms_s"].items(), key=lambda item: -item[1])[:2]
        spread = f"{min(r['cpu_step_s'] for r in runs):.4f}-{max(r['cpu_step_s'] for r in runs):.4f}"
        print(f"| {name}{' (simulated)' if simulated else ''} | {predicted['step_s']:.4f} | {cpu:.4f} ({spread}) | "
              f"{error:+.0%} | {wall:.4f} | {predicted['step_s'] / wall - 1:+.0%} | "
              f"{', '.join(f'{k} {v:.3g}' for k, v in top)} |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    rank_rows = [(r[0], r[1], r[2], r[3], False) for r in rank_rows if r[3] is not None]
    for label, chosen in (("goal cases (not simulated)", [r for r in rows if not r[4]] + rank_rows),
                          ("of them on 2 ranks (groups)", rank_rows), ("all cases", rows + rank_rows)):
        errors = [abs(r[3]) for r in chosen]
        if errors:
            print(f"{label}: {len(errors)}, within 25%: {sum(e <= 0.25 for e in errors)}, median |error| "
                  f"{statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()

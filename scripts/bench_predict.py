"""Benchmark: the step time `dmap plan` predicts against what `dmap run` measures, case by case, on this CPU (issue 42).

In rounds (--repeats, 3): each round `dmap calibrate` measures this CPU into a profile (one torch thread:
OMP_NUM_THREADS=1 for every process here), then every case (family x size x layout) once: `dmap plan ... --profile
P --steps S --json` gives the predicted seconds per denoising step, and the same case is measured in a fresh process
(below); the plan is given the measured prompt (`--prompt`: Qwen-Image and Z-Image run the text at its length).
Error = the median over the rounds of each round's predicted / measured, less 1: this machine's speed drifts by a
third over minutes (the same run 65 to 100 ms a step), and a round pairs each measurement with a profile measured
minutes before, where repeats in a row put one case's runs all in one spell.

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
loading) at S2 steps less at S1 (--rank-steps, 2 and 20), over (S2 - S1) x prompts, on the wall clock (the ranks
wait on each other: a CPU clock would miss it), so they need a quiet machine; the prediction is `dmap plan
--world-size 2 --parallel LAYOUT`'s `predicted_time.layouts`. Then `--parallel auto`'s pick and reason against the
measured fastest layout ("one" stands for auto's split: one process), judged where the fastest is at least 10% faster
than the next, among the layouts for one prompt (auto picks the pipeline only where no layout that shares every step
fits: it speeds up a queue, and one prompt alone runs at the split's speed).

Usage: OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_predict.py [--repeats 3] [--cases a,b] [--steps 2,6]
       [--rank-steps 2,20]
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

from launch_output import json_results  # scripts/: the folder Python runs this file from

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


def plan(source: str, args: list[str], profile: str, steps: int, env: dict) -> dict:
    """`dmap plan`'s JSON for a case on `profile` (no check: the prediction only), at the measured prompt (Qwen-Image
    and Z-Image run the text at its length)."""
    return dmap("plan", source, *args, "--steps", str(steps), "--profile", profile, "--prompt", PROMPT.format(0),
                "--no-check", "--json", env=env)


def measure_in_process(source: str, extra: list[str], prompts: int, steps: int, env: dict,
                       output: str | None = None) -> dict:
    """One case measured in a fresh process (`--measure`): the median step, on the main thread's CPU clock and on the
    wall clock (`output`: where the first image is saved)."""
    spec = json.dumps({"source": source, "extra": extra, "prompts": prompts, "steps": steps, "output": output})
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

    import torch

    from dm_cli.api import load

    extra = spec["extra"]
    options = {"height": int(extra[extra.index("--height") + 1]), "width": int(extra[extra.index("--width") + 1])}
    for flag, option in (("-m", "max_memory"), ("--overhead", "overhead"), ("--mode", "mode"), ("--dtype", "dtype")):
        if flag in extra:
            options[option] = extra[extra.index(flag) + 1]
    session = load(None if spec["source"] == "demo" else spec["source"], simulate="--simulate" in extra, **options)
    prompts = [PROMPT.format(i) for i in range(spec["prompts"])]
    list(session.generate(prompts, steps=2))
    # on a GPU each step waits for its kernels: the host would otherwise run ahead and time its own launches
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    marks: list[tuple[int, float, float]] = []

    def on_step(step, *_):
        sync()
        marks.append((step, time.perf_counter(), time.thread_time()))

    start = time.perf_counter()
    done = list(session.generate(prompts, steps=spec["steps"], on_step=on_step))
    image_s = (time.perf_counter() - start) / len(prompts)
    if spec.get("output"):  # the first image, for a comparison of pixels (scripts/gpu_check.py)
        done[0].image.save(spec["output"])
    walls = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    cpus = [b[2] - a[2] for a, b in zip(marks, marks[1:]) if b[0] > a[0] and a[0] >= 1]
    return {"wall_step_s": statistics.median(walls), "cpu_step_s": statistics.median(cpus), "marks": len(marks),
            "image_s": image_s}


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
    for result in json_results(proc.stdout):
        stages = result.get("stages")
        found = stages.get("denoise") if isinstance(stages, dict) else next(
            (stage for stage in stages or () if stage.get("name") == "denoise"), None)
        if found:
            seconds.append(float(found["run_s"]))
    if not seconds:
        raise SystemExit(f"{' '.join(command)} printed no denoise stage: {proc.stdout[-800:]}")
    return min(seconds)


def measure_ranks(where: str, extra: list[str], layout: str, prompts: int, s1: int, s2: int, work: Path,
                  env: dict) -> float:
    """Seconds per image-step of `layout`: the denoise stage at S2 steps less at S1, over (S2 - S1) x prompts (what
    the first step's warm-up, the encoders' broadcast and the pipeline's fill and drain cost cancels)."""
    short = denoise_seconds(where, extra, layout, prompts, s1, work, env)
    return (denoise_seconds(where, extra, layout, prompts, s2, work, env) - short) / ((s2 - s1) * prompts)


def rank_round(name: str, sources: dict, profile: str, s1: int, s2: int, work: Path, env: dict) -> dict:
    """One round of a 2-rank group: layout -> (predicted, measured) seconds per image-step, and "auto" -> the layout
    `--parallel auto` picks ("one" for its split, which runs as one rank would) with its reason."""
    source, extra, layouts = RANK_GROUPS[name]
    where = sources[source]
    ranks = ["--max-memory", RANK_MEMORY, "--world-size", "2", "--parallel"]
    found = {}
    for layout, prompts in layouts.items():
        if layout == "one":
            predicted = (plan(where, extra, profile, s2, env).get("predicted_time") or {}).get("step_s")
        else:
            planned = plan(where, [*extra, *ranks, layout], profile, s2, env)
            predicted = (((planned.get("predicted_time") or {}).get("layouts") or {}).get(layout) or {}).get("step_s")
        found[layout] = (predicted, measure_ranks(where, extra, layout, prompts, s1, s2, work, env))
    auto = plan(where, [*extra, *ranks, "auto"], profile, s2, env).get("parallel") or {}
    found["auto"] = ("one" if auto.get("layout") == "split" else auto.get("layout"), auto.get("reason", ""))
    return found


def one_round(name: str, sources: dict, profile: str, s2: int, env: dict) -> dict | None:
    """One round of a one-process case: the plan's prediction and one measurement (None: no prediction)."""
    source, extra, prompts = CASES[name]
    where = sources[source]
    plan_args = [a for a in extra if a not in RUN_ONLY]
    planned = plan(where, [*plan_args, "--queue", str(prompts)], profile, s2, env)
    predicted = planned.get("predicted_time")
    if not predicted:  # no family or no trace: nothing to compare
        print(f"| {name} | no prediction: {' '.join(planned.get('warnings', []))[:200]} |||||", flush=True)
        return None
    return {"predicted": predicted, **measure_in_process(where, extra, prompts, s2, env)}


def _error(pairs: list[tuple[float, float]]) -> float:
    """predicted / measured - 1, the median over the rounds of each round's own ratio (a round's prediction is on
    the profile calibrated just before it: the machine's speed drifts over minutes, and each pair shares one speed)."""
    return statistics.median(p / m for p, m in pairs) - 1


def report_one(name: str, found: list[dict]) -> tuple:
    """A one-process case's row over its rounds; returns (name, predicted, measured, error, simulated)."""
    predicted = statistics.median(r["predicted"]["step_s"] for r in found)
    cpu = statistics.median(r["cpu_step_s"] for r in found)
    wall = statistics.median(r["wall_step_s"] for r in found)
    error = _error([(r["predicted"]["step_s"], r["cpu_step_s"]) for r in found])
    wall_error = _error([(r["predicted"]["step_s"], r["wall_step_s"]) for r in found])
    simulated = "--simulate" in CASES[name][1]
    top = sorted(found[-1]["predicted"]["step_terms_s"].items(), key=lambda item: -item[1])[:2]
    spread = f"{min(r['cpu_step_s'] for r in found):.4f}-{max(r['cpu_step_s'] for r in found):.4f}"
    print(f"| {name}{' (simulated)' if simulated else ''} | {predicted:.4f} | {cpu:.4f} ({spread}) | {error:+.0%} | "
          f"{wall:.4f} | {wall_error:+.0%} | {', '.join(f'{k} {v:.3g}' for k, v in top)} |", flush=True)
    return name, predicted, cpu, error, simulated


def report_ranks(name: str, found: list[dict]) -> list[tuple]:
    """A 2-rank group's rows over its rounds, then auto's pick against the measured fastest layout for one prompt
    (auto picks the pipeline only where no layout that shares every step fits: it speeds up a queue, and one prompt
    alone runs at the split's speed). Returns the rows (name, predicted, measured, error, False)."""
    rows, measured = [], {}
    for layout, prompts in RANK_GROUPS[name][2].items():
        pairs = [r[layout] for r in found]
        seconds = statistics.median(m for _, m in pairs)
        measured[layout] = seconds
        usable = [(p, m) for p, m in pairs if p and m > 0]
        predicted = statistics.median(p for p, _ in usable) if usable else None
        error = _error(usable) if usable else None
        if error is not None:
            rows.append((f"{name} {layout}", predicted, seconds, error, False))
        spread = f"{min(m for _, m in pairs):.4f}-{max(m for _, m in pairs):.4f}"
        print(f"| {name} {layout}{' (queue of 2, per image-step)' if prompts > 1 else ''} | "
              f"{'-' if predicted is None else f'{predicted:.4f}'} | {seconds:.4f} ({spread}) | "
              f"{'-' if error is None else f'{error:+.0%}'} | (wall, denoise stage) | | |", flush=True)
    picks = [r["auto"] for r in found]
    picked, reason = max(picks, key=lambda pick: sum(p[0] == pick[0] for p in picks))  # the most rounds' pick
    ranked = sorted((layout for layout in measured if layout != "pipeline" or picked == "pipeline"), key=measured.get)
    margin = measured[ranked[1]] / measured[ranked[0]] - 1 if len(ranked) > 1 else 0.0
    verdict = ("right" if picked == ranked[0] else "WRONG") if margin >= 0.10 else "no clear fastest (<10%)"
    print(f"  auto on {name}: picks {picked} in {sum(p[0] == picked for p in picks)} of {len(picks)} rounds ({reason}); "
          f"measured fastest {ranked[0]}, {margin:.0%} faster than {ranked[1] if len(ranked) > 1 else '-'}: {verdict}",
          flush=True)
    return rows


def sources_for(names: list[str], work: Path, env: dict) -> dict:
    """Each case's SOURCE: the demo, or a tiny preset written with random weights."""
    sources = {}
    for name in names:
        source = (CASES.get(name) or RANK_GROUPS[name])[0]
        if source != "demo" and source not in sources:
            folder = work / source
            subprocess.run([*DMAP, "demo", source, "-o", str(folder)], check=True, env=env, cwd=REPO,
                           capture_output=True)
            sources[source] = str(folder)
        sources.setdefault(source, source)
    return sources


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds: each calibrates, then measures every case once")
    parser.add_argument("--cases", default=",".join([*CASES, *RANK_GROUPS]),
                        help=f"comma-separated; one-process cases: {', '.join(CASES)}; 2-rank groups: "
                             f"{', '.join(RANK_GROUPS)}")
    parser.add_argument("--steps", default="2,6", help="the two step counts S1,S2")
    parser.add_argument("--rank-steps", default="2,20", help="the 2-rank groups' step counts S1,S2 (whole launches "
                        "differenced: more steps than --steps, so that the steps outweigh a launch's noise)")
    parser.add_argument("--profile", help="use this profile instead of calibrating")
    args = parser.parse_args()
    s2 = int(args.steps.split(",")[1])
    r1, r2 = (int(x) for x in args.rank_steps.split(","))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    work = Path(tempfile.mkdtemp(prefix="dmap-bench-predict-"))
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES and n not in RANK_GROUPS]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}: use {', '.join([*CASES, *RANK_GROUPS])}")
    print(f"load average before: {os.getloadavg()}", flush=True)
    sources = sources_for(names, work, env)
    found: dict[str, list] = {name: [] for name in names}
    for round_ in range(args.repeats):  # rounds, not repeats in a row: a slow spell of the machine spreads over all
        profile = args.profile or str(work / f"profile-{round_}.json")
        if not args.profile:
            subprocess.run([*DMAP, "calibrate", "-o", profile, "--overwrite"], check=True, env=env, cwd=REPO)
        for name in names:
            got = (rank_round(name, sources, profile, r1, r2, work, env) if name in RANK_GROUPS
                   else one_round(name, sources, profile, s2, env))
            if got is not None:
                found[name].append(got)
        print(f"round {round_ + 1} of {args.repeats} done, load average {os.getloadavg()}", flush=True)
    print("| case | predicted s/step | measured s/step (CPU clock) | error | measured s/step (wall) | error (wall) "
          "| largest predicted terms |\n|---|---|---|---|---|---|---|", flush=True)
    rows, rank_rows = [], []
    for name in names:
        if found[name]:
            if name in RANK_GROUPS:
                rank_rows += report_ranks(name, found[name])
            else:
                rows.append(report_one(name, found[name]))
    print(f"load average after: {os.getloadavg()}")
    for label, chosen in (("goal cases (not simulated)", [r for r in rows if not r[4]] + rank_rows),
                          ("of them on 2 ranks (groups)", rank_rows), ("all cases", rows + rank_rows)):
        errors = [abs(r[3]) for r in chosen]
        if errors:
            print(f"{label}: {len(errors)}, within 25%: {sum(e <= 0.25 for e in errors)}, median |error| "
                  f"{statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()

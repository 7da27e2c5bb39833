"""Step caches (`--cache`, issue 33): speed-up, memory (planned against measured) and image difference, per family.

For each family (FLUX, Wan, Qwen-Image), a mid-size random-weight pipeline (the tiny preset's configs with a wider,
deeper denoiser, written by dm_cli.model.demo.write_random_pipeline) runs the same prompt and seed with no cache and
with each cache the family takes, at its default settings, side by side in one process:

- speed: the denoise stage's seconds (a plain CPU run: `--max-memory cpu=...`), no cache / cache;
- memory: a `--simulate` run with every op tracked (virtual GPU 0): the denoise stage's measured peak on GPU 0 with
  the cache minus without it, against what the plan counts for the cache there (`step_cache.components.*.bytes`);
- image: PSNR and the largest pixel difference of the cached image against the uncached one;
- skipped: the denoiser calls that did not run their blocks in full, of all calls (every guidance branch counted).

Random weights change little between steps in a different way from trained ones (the residuals of a random
transformer are not the smooth trajectory of a trained one), so skip counts and image differences here say how the
hooks behave, not what quality a trained model keeps.

    .venv/bin/python scripts/bench_cache.py [--steps 20] [--families flux,wan,qwenimage] [--size 256]

The gain by step count and size (issue 40), two more modes:

- `--flops`: the denoiser's calls counted on the meta device (torch's FlopCounterMode: matmuls and attention, no
  weights, no noise, seconds), a run of N calls with the cache's hooks on against N without, for each steps x size
  x cache, on the twins and on the real configs of the presets (FLUX.1 [dev] at 1024x1024, Wan 2.2's high-noise
  expert at 480x832 x 81 frames). What the hooks skip, so the most a cache can gain
  where matmuls are the time (a GPU at real sizes);
- `--sweep`: timed runs of the twins, each steps x size with no cache and each cache side by side, interleaved
  (the order turned each round), the median of `--repeat`, the load average printed: the denoise stage's ratio
  and the image against the uncached one.

    .venv/bin/python scripts/bench_cache.py --flops [--steps-list 8,16,28] [--sizes 64,128]
    .venv/bin/python scripts/bench_cache.py --sweep --families flux --steps-list 16 --sizes 64 --repeat 3 \\
        --caches taylorseer,taylorseer:lite=false,magcache
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the denoiser of each family, wider and deeper than the tiny preset's (other components as the preset has them)
FAMILIES = {
    "flux": ("tiny-flux", {"num_layers": 4, "num_single_layers": 8, "attention_head_dim": 64, "num_attention_heads": 8,
                           "axes_dims_rope": [16, 24, 24]}, {"max_sequence_length": 64}),
    "wan": ("tiny-wan", {"num_layers": 8, "attention_head_dim": 64, "num_attention_heads": 8, "ffn_dim": 2048}, {"frames": 9}),
    "qwenimage": ("tiny-qwenimage", {"num_layers": 8, "attention_head_dim": 64, "num_attention_heads": 8,
                                     "axes_dims_rope": [16, 24, 24]},
                  {"max_sequence_length": 64, "prompt": None, "negative_prompt": None}),
}
PROMPT = "a lighthouse on a cliff at dusk"
# Qwen-Image's plan is its worst case: the longest prompt (its pipeline trims the text to the prompt's own tokens,
# up to max_sequence_length) and true CFG (two denoiser calls, two cache contexts, with a negative prompt). A short
# prompt without a negative prompt holds a quarter of what the plan counts (12 MB against 50 MB at 128x128 in an
# earlier table); these prompts fill the 64 tokens planned, and the negative prompt turns true CFG on.
LONG_PROMPT = ("a lighthouse on a cliff at dusk, waves breaking on black rocks below, gulls circling the lamp, a "
               "fishing boat with a red hull coming home across the bay, low clouds lit orange and violet by the "
               "setting sun, wet grass bending in the wind, a stone path to the keeper's cottage with one lit window")
LONG_NEGATIVE = ("blurry, low resolution, overexposed, underexposed, noisy, jpeg artifacts, watermark, text, "
                 "signature, cropped, out of frame, deformed, duplicated, extra limbs, bad anatomy, cartoon, "
                 "painting, sketch, flat lighting, washed out colours, grainy film, lens flare, motion blur")
FAMILIES["qwenimage"][2].update(prompt=LONG_PROMPT, negative_prompt=LONG_NEGATIVE)


def build(family: str, root: Path) -> Path:
    """The family's mid-size random pipeline folder (configs of the tiny preset, the denoiser widened)."""
    from dm_cli.model.demo import write_random_pipeline

    preset, changes, _ = FAMILIES[family]
    configs = root / f"{family}-configs"
    shutil.copytree(REPO / "dm_cli" / "presets" / preset, configs)
    for name in ("transformer", "transformer_2"):
        path = configs / name / "config.json"
        if path.exists():
            config = json.loads(path.read_text())
            config.update({k: v for k, v in changes.items() if v is not None and k in config})
            path.write_text(json.dumps(config, indent=2))
    target = root / family
    write_random_pipeline(configs, target, seed=0)
    return target


def run(folder: Path, out: Path, cache: str | None, steps: int, size: int, extra: dict, simulate: bool,
        gpu: bool = False):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run as run_one

    memory = "0=80GB,cpu=80GB" if simulate or gpu else "cpu=80GB"
    request = RunRequest.of(str(folder), extra.get("prompt") or PROMPT, seed=1, steps=steps, height=size, width=size,
                            num_frames=extra.get("frames"), max_memory=memory, simulate=simulate, overwrite=True,
                            output=str(out), cache=cache, max_sequence_length=extra.get("max_sequence_length"),
                            negative_prompt=extra.get("negative_prompt"))
    return run_one(request)


def denoise(result):
    stages = [s for s in result.stages if s.name == "denoise"]
    return sum(s.run_s for s in stages), max((s.measured_peak.get("0", 0) for s in stages), default=0)


def pixels(result):
    import numpy as np

    data = result.images_data[0]
    return np.asarray(data if hasattr(data, "shape") else data.convert("RGB"), dtype=np.float64)


def compare(base, other) -> tuple[float, int]:
    import numpy as np

    diff = base - other
    mse = float(np.mean(diff ** 2))
    return (math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)), int(np.max(np.abs(diff)))


# the real configs the --flops mode counts beside the twins: preset, the denoiser, size (h, w), extra inputs
# (Qwen-Image's 60 blocks 3072 wide took over 15 minutes of meta calls here: its twin only)
REAL = {
    "flux": ("flux.1-dev", "transformer", (1024, 1024), {"max_sequence_length": 512}),
    "wan": ("wan2.2-t2v-a14b", "transformer", (480, 832), {"frames": 81, "max_sequence_length": 512}),
}


def counted_flops(folder: Path, component: str, height: int, width: int, extra: dict, caches: list[str],
                  steps_list: list[int]) -> dict:
    """(cache, steps) -> the FLOPs of `steps` denoiser calls with the cache's hooks on (one cache context: every
    guidance branch is its own and skips alike), and (None, steps) -> without, counted on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dm_cli.families import family_for
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.step_cache import enable, parse_cache
    from dm_cli.planning.trace.trace import _materialise, _meta_model, _resolve_call

    source = resolve_source(str(folder))
    comp = source.component(component)
    pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
    family = family_for(pipeline_class)
    model = _meta_model(comp, "bfloat16")
    inputs = InputSpec(height=height, width=width, max_sequence_length=extra.get("max_sequence_length"),
                       num_frames=extra.get("frames"))
    spec = _resolve_call(model, comp, pipeline_class, inputs)
    kwargs = _materialise(spec.kwargs, torch.bfloat16, torch.device("meta"))

    def one_call() -> int:
        with FlopCounterMode(display=False) as counter:
            model(**kwargs)
        return counter.get_total_flops()

    out = {}
    with torch.no_grad():
        full = one_call()
        for steps in steps_list:
            out[(None, steps)] = full * steps
            for label in caches:
                cache = parse_cache(label)
                if cache.name not in family.step_caches or cache.name == "fbc":
                    continue  # fbc decides on the tensors' values, which the meta device has not
                enable(model, cache, family, steps, "bfloat16")
                try:
                    with model.cache_context("cond"):
                        out[(label, steps)] = sum(one_call() for _ in range(steps))
                finally:
                    model.disable_cache()
    return out


def flops_table(args) -> int:
    from dm_cli.families import family_for

    steps_list, sizes = _ints(args.steps_list), _ints(args.sizes)
    caches = [c for c in args.caches.split(",") if c]
    print("| model | size | cache | " + " | ".join(f"{n} steps" for n in steps_list) + " |")
    print("|---|---|---|" + "---:|" * len(steps_list))
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            folder = build(family, Path(tmp))
            cases = [(f"{family} twin", folder, "transformer", (size, size), FAMILIES[family][2]) for size in sizes]
            if family in REAL:
                preset, component, (height, width), extra = REAL[family]
                cases.append((preset, REPO / "dm_cli" / "presets" / preset, component, (height, width), extra))
            for name, path, component, (height, width), extra in cases:
                pipeline_class = json.loads((path / "model_index.json").read_text())["_class_name"]
                takes = [c for c in caches if c.split(":")[0] in family_for(pipeline_class).step_caches]
                counted = counted_flops(path, component, height, width, extra, takes, steps_list)
                for label in takes:
                    if (label, steps_list[0]) not in counted:
                        continue
                    gains = [counted[(None, n)] / counted[(label, n)] for n in steps_list]
                    print(f"| {name} | {height}x{width}{'x%d' % extra['frames'] if extra.get('frames') else ''} | "
                          f"{label} | " + " | ".join(f"{g:.2f}x" for g in gains) + " |", flush=True)
    return 0


def sweep_table(args) -> int:
    from dm_cli.families import family_for

    steps_list, sizes = _ints(args.steps_list), _ints(args.sizes)
    rows = []
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in args.families.split(","):
            folder = build(family, root)
            extra = FAMILIES[family][2]
            pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
            caches = [None, *(c for c in args.caches.split(",") if c.split(":")[0] in family_for(pipeline_class).step_caches)]
            out = root / f"{family}.{'mp4' if extra.get('frames') else 'png'}"
            run(folder, out, None, 2, min(sizes), extra, simulate=False)  # warm-up: the first run in a process is slow
            for size in sizes:
                for steps in steps_list:
                    timed = {cache: [] for cache in caches}
                    images, skipped = {}, {}
                    for round_ in range(args.repeat):
                        for cache in (caches if round_ % 2 == 0 else caches[::-1]):
                            result = run(folder, out, cache, steps, size, extra, simulate=False)
                            timed[cache].append(denoise(result)[0])
                            images[cache] = pixels(result)
                            counts = result.step_cache.get("counts", {}) if cache else {}
                            skipped[cache] = (sum(c["skipped"] for c in counts.values()),
                                              sum(c["calls"] for c in counts.values()))
                    base = statistics.median(timed[None])
                    for cache in caches[1:]:
                        psnr, max_diff = compare(images[None], images[cache])
                        median = statistics.median(timed[cache])
                        rows.append({"family": family, "size": size, "steps": steps, "cache": cache,
                                     "uncached_s": round(base, 2), "denoise_s": round(median, 2),
                                     "speedup": round(base / median, 2),
                                     "skipped": f"{skipped[cache][0]}/{skipped[cache][1]}",
                                     "psnr_db": round(psnr, 1), "max_pixel_diff": max_diff,
                                     "runs_s": [round(t, 2) for t in timed[cache]],
                                     "uncached_runs_s": [round(t, 2) for t in timed[None]]})
                        print(json.dumps(rows[-1]), flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print()
    print("| family | size | steps | cache | denoise s, median (none -> cache) | speed-up | skipped calls | PSNR dB "
          "| max pixel diff |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['family']} | {r['size']} | {r['steps']} | {r['cache']} | {r['uncached_s']} -> {r['denoise_s']} | "
              f"{r['speedup']}x | {r['skipped']} | {r['psnr_db']} | {r['max_pixel_diff']} |")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--families", default="flux,wan,qwenimage")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per case (the fastest counts; --sweep: the median)")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA GPU 0: speed and memory from the same real "
                        "runs (max_memory_allocated), no simulated run")
    parser.add_argument("--flops", action="store_true", help="count each cache's FLOPs on the meta device, by steps "
                        "and size, twins and real configs")
    parser.add_argument("--sweep", action="store_true", help="timed runs by steps and size (the median of --repeat)")
    parser.add_argument("--steps-list", default="8,16,28")
    parser.add_argument("--sizes", default="64,128")
    parser.add_argument("--caches", default="fbc,taylorseer,taylorseer:lite=false,magcache",
                        help="the caches (--cache specs) --flops and --sweep compare; each family runs those it takes")
    args = parser.parse_args()
    if args.flops:
        return flops_table(args)
    if args.sweep:
        return sweep_table(args)
    import dm_cli.run.request as request_module
    from dm_cli.families import family_for

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in args.families.split(","):
            folder = build(family, root)
            extra = FAMILIES[family][2]
            pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
            caches = [None, *family_for(pipeline_class).step_caches]
            out = root / f"{family}.{'mp4' if extra.get('frames') else 'png'}"
            timed, images, skipped, memory = {}, {}, {}, {}
            for cache in caches:
                best = None
                for _ in range(args.repeat):
                    result = run(folder, out, cache, args.steps, args.size, extra, simulate=False, gpu=args.gpu)
                    seconds = denoise(result)[0]
                    best = seconds if best is None else min(best, seconds)
                timed[cache], images[cache] = best, pixels(result)
                counts = result.step_cache.get("counts", {}) if cache else {}
                skipped[cache] = (sum(c["skipped"] for c in counts.values()), sum(c["calls"] for c in counts.values()))
                start = time.perf_counter()
                if args.gpu:  # CUDA's max_memory_allocated of the timed run itself
                    tracked = result
                else:
                    request_module.TRACKED_STEPS = None  # every step tracked: the cache's state is held from the first
                    tracked = run(folder, out, cache, min(args.steps, 8), args.size, extra, simulate=True)
                    request_module.TRACKED_STEPS = 2
                planned = sum(c["bytes"].get("0", 0) for c in tracked.plan.step_cache.get("components", {}).values()) \
                    if cache else 0
                memory[cache] = (denoise(tracked)[1], planned, time.perf_counter() - start)
            for cache in caches[1:]:
                psnr, max_diff = compare(images[None], images[cache])
                measured_extra = memory[cache][0] - memory[None][0]
                planned = memory[cache][1]
                rows.append({"family": family, "cache": cache, "steps": args.steps, "size": args.size,
                             "denoise_s": round(timed[cache], 2), "uncached_s": round(timed[None], 2),
                             "speedup": round(timed[None] / timed[cache], 2),
                             "skipped": f"{skipped[cache][0]}/{skipped[cache][1]}",
                             "planned_extra_bytes": planned, "measured_extra_bytes": measured_extra,
                             "extra_error": round((planned - measured_extra) / measured_extra, 3) if measured_extra else None,
                             "measured_peak_bytes": memory[cache][0], "uncached_peak_bytes": memory[None][0],
                             "psnr_db": round(psnr, 1), "max_pixel_diff": max_diff})
                print(json.dumps(rows[-1]), flush=True)
    print()
    print("| family | cache | denoise s (none -> cache) | speed-up | skipped calls | extra memory planned / measured "
          "| PSNR dB | max pixel diff |")
    print("|---|---|---|---:|---:|---|---:|---:|")
    for r in rows:
        extra = f"{r['planned_extra_bytes'] / 1e6:.2f} MB / {r['measured_extra_bytes'] / 1e6:.2f} MB"
        print(f"| {r['family']} | {r['cache']} | {r['uncached_s']} -> {r['denoise_s']} | {r['speedup']}x | "
              f"{r['skipped']} | {extra} | {r['psnr_db']} | {r['max_pixel_diff']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

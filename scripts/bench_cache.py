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
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
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
    from dm_cli.run.single import run as run_one

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--families", default="flux,wan,qwenimage")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per case (the fastest counts)")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA GPU 0: speed and memory from the same real "
                        "runs (max_memory_allocated), no simulated run")
    args = parser.parse_args()
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

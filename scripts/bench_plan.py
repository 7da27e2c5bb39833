#!/usr/bin/env python
"""Compare `dmap plan` with accelerate and diffusers' pipeline "balanced" on the presets (no GPU needed).

For every (model, budget, input) case:
- dmap: the pipeline plan (mode auto, strategy auto), and the denoiser planned alone on all devices;
- accelerate: `infer_auto_device_map` on the meta denoiser with its no-split classes, for the
  sequential, balanced and balanced_low_0 strategies (`get_balanced_memory` for the last two);
- diffusers: the pipeline "balanced" assignment (diffusers' own `_assign_components_to_devices` over
  component sizes sorted largest first; a component that misses goes whole to cpu).
Reported: bytes offloaded to cpu/disk, device hops along the execution order, the largest share of
the GPU-resident weights on one GPU, whether weights + activations (dmap's meta estimate for the
inputs) + 600 MB per GPU fit every device, and whether the split check passes (`--check-anchors` also
checks accelerate's maps: slow). Prints a markdown table; exits 1 if dmap ever offloads more than either.
Cases with `--weights fp8`: dmap counts each tensor as layerwise casting stores it (norms, embeddings,
modulation in bf16) plus the compute copy of the largest layer; accelerate knows no per-tensor rule
and is given the model flat in float8 (`dtype=float8_e4m3fn`); every map is judged with the real bytes.

    .venv/bin/python scripts/bench_plan.py [--check-anchors] [--only N[,M...]]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dm_cli.families import family_for  # noqa: E402
from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec  # noqa: E402
from dm_cli.model.formats.weight_formats import STORAGE_DTYPES, parse_weights_spec  # noqa: E402
from dm_cli.model.sources import resolve_source  # noqa: E402
from dm_cli.planning.make import make_plan  # noqa: E402
from dm_cli.planning.placement.budgets import DEFAULT_GPU_OVERHEAD  # noqa: E402
from dm_cli.planning.placement.components import prepare_component  # noqa: E402
from dm_cli.planning.plan_options import PlanOptions  # noqa: E402
from dm_cli.units import parse_device_spec  # noqa: E402


@dataclass
class Case:
    preset: str
    dtype: str
    budget: str
    size: int  # height (and width unless given)
    width: int | None = None
    frames: int | None = None  # video pipelines (Wan)
    weights: str | None = None  # --weights (fp8: accelerate is then given a flat fp8 size, its only way)
    images: tuple[tuple[int, int], ...] = ()  # input images as (width, height): references, images to edit

    @property
    def inputs(self) -> InputSpec:
        return self.generation.inputs()

    @property
    def generation(self) -> Generation:
        """What dmap plans for: the size, the frames and the input images' sizes."""
        return Generation(height=self.size, width=self.width or self.size, num_frames=self.frames,
                          images=tuple(InputImage(w, h) for w, h in self.images))

    @property
    def model(self) -> str:
        return f"{self.preset} {self.dtype}" + (f" +{self.weights}" if self.weights else "")

    @property
    def label(self) -> str:
        size = f"{self.size}²" if not self.width else f"{self.size}x{self.width}"
        return size + (f"x{self.frames}f" if self.frames else "") + (f" +{len(self.images)} img" if self.images else "")


CASES = [
    Case("flux", "bf16", "0=16GB,1=16GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=24GB,1=24GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=12GB,1=12GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=8GB,1=8GB,2=8GB,3=8GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=12GB,1=12GB,2=12GB,3=12GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=24GB,1=12GB,cpu=64GB", 1024),
    Case("flux", "bf16", "0=16GB,1=8GB,2=8GB,cpu=64GB", 768),
    Case("flux-schnell", "bf16", "0=10GB,1=10GB,cpu=64GB", 1024),
    Case("sdxl", "fp32", "0=5GiB,1=5GiB,cpu=30GiB", 1024),
    Case("sdxl", "fp32", "0=6GiB,1=10GiB,cpu=30GiB", 1024),
    Case("sdxl", "fp16", "0=8GB,1=8GB,cpu=32GB", 1024),
    Case("sd3", "fp16", "0=8GB,1=8GB,cpu=64GB", 1024),
    Case("sd3", "fp16", "0=8GB,1=8GB,2=8GB,3=8GB,cpu=64GB", 1024),
    Case("sd3", "fp16", "0=24GB,1=8GB,cpu=64GB", 1024),
    Case("sd15", "fp32", "0=8GB,1=8GB,cpu=32GB", 512),
    Case("flux2", "bf16", "0=40GB,1=40GB,2=40GB,3=40GB,cpu=200GB", 1024),
    Case("flux2", "bf16", ",".join(f"{i}=24GB" for i in range(8)), 1024),
    Case("flux2", "bf16", "0=48GB,1=48GB,2=48GB", 1024),
    Case("flux2", "bf16", ",".join(f"{i}=40GB" for i in range(8)), 1024),
    Case("flux2", "bf16", "0=80GB,1=80GB", 1024),
    Case("flux2-klein", "bf16", "0=12GB,1=12GB,cpu=32GB", 1024),
    Case("flux2-klein", "bf16", "0=8GB,1=8GB,2=8GB,cpu=32GB", 1024),
    Case("wan2.2", "bf16", "0=24GB,1=24GB,cpu=128GB", 480, 832, 81),
    Case("wan2.2", "bf16", "0=80GB,cpu=128GB", 480, 832, 81),
    Case("wan2.2", "bf16", "0=16GB,1=16GB,2=16GB,3=16GB,cpu=128GB", 480, 832, 81),
    Case("wan2.2", "bf16", "0=48GB,1=48GB,cpu=128GB", 720, 1280, 81),
    Case("flux", "bf16", "0=12GB,1=12GB,cpu=64GB", 1024, weights="fp8"),
    Case("flux", "bf16", "0=16GB,cpu=64GB", 1024, weights="fp8"),
    Case("flux2", "bf16", "0=24GB,1=24GB,cpu=128GB", 1024),
    Case("flux2", "bf16", "0=24GB,1=24GB,cpu=128GB", 1024, weights="fp8"),
    Case("wan2.2", "bf16", "0=16GB,1=16GB,cpu=128GB", 480, 832, 81, weights="fp8"),
    Case("qwen-image", "bf16", "0=24GB,1=24GB,cpu=64GB", 1024),
    Case("qwen-image", "bf16", "0=24GB,1=24GB,2=24GB,cpu=64GB", 1024),
    Case("qwen-image", "bf16", "0=16GB,1=16GB,2=16GB,3=16GB,cpu=64GB", 1024),
    Case("qwen-image", "bf16", "0=48GB,1=24GB,cpu=64GB", 1024),
    Case("qwen-image", "bf16", "0=24GB,cpu=64GB", 1024),
    Case("qwen-image", "bf16", "0=24GB,cpu=64GB", 1024, weights="fp8"),
    Case("z-image", "bf16", "0=12GB,cpu=32GB", 1024),
    Case("z-image", "bf16", "0=8GB,1=8GB", 1024),
    Case("ltx-2", "bf16", "0=24GB,1=24GB,cpu=64GB", 512, 768, 121),  # video + audio: the joint transformer
    Case("ltx-2", "bf16", "0=80GB", 512, 768, 121),
    # FLUX.2 [dev] with 3 references of 1024x1024: 3 x 4096 reference tokens after the 4096 generated ones
    Case("flux2", "bf16", "0=40GB,1=40GB,2=40GB,3=40GB", 1024, images=((1024, 1024),) * 3),
    # Wan 2.2 image-to-video from an 832x480 first frame: I2V-A14B's two experts (the conditioning video's channels
    # concatenated, 36 in), and TI2V-5B at 720p (one timestep per latent token, the Wan 2.2 VAE) on one 24 GB card
    Case("wan2.2-i2v", "bf16", "0=24GB,1=24GB,cpu=128GB", 480, 832, 81, images=((832, 480),)),
    Case("wan2.2-ti2v", "bf16", "0=24GB,cpu=64GB", 704, 1280, 121, images=((1280, 704),)),
    # Qwen-Image-Edit-2511 at 1024x1024 with 1, 2 and 3 images of 1024x1024: each adds 4096 tokens to the transformer's
    # sequence (its VAE-size latents) and 196 vision tokens to the prompt (384x384 through Qwen2.5-VL)
    *(Case("qwen-image-edit", "bf16", "0=24GB,1=24GB,cpu=64GB", 1024, images=((1024, 1024),) * n) for n in (1, 2, 3)),
]

_META_MODELS: dict = {}


def meta_model(comp, dtype):
    import torch

    from dm_cli.model.skeleton import build_on_meta

    key = (comp.cls, str(comp.folder), dtype)
    if key not in _META_MODELS:
        model = build_on_meta(comp.library, comp.cls, comp.config)
        _META_MODELS[key] = model.to(getattr(torch, dtype))
    return _META_MODELS[key]


def device_of(device_map: dict, tensor: str):
    from dm_cli.devices import device_of as placed

    return placed(tensor.rstrip("."), device_map)


def evaluate_map(prepared, device_map: dict, budgets) -> dict:
    """Offload, hops, max share and 'fits with activations' of a component-level map, in dmap's terms."""
    skeleton, spec = prepared.skeleton, prepared.spec
    gpu_keys = [b.device for b in budgets if b.is_gpu]
    weights: dict = {}
    for tensor in skeleton.tensors:
        device = device_of(device_map, tensor.name)
        weights[device] = weights.get(device, 0) + tensor.bytes_at(prepared.dtype, prepared.weights)
    main = next((d for d in device_map.values() if d in gpu_keys), "cpu")
    offloaded = sum(v for k, v in weights.items() if k not in gpu_keys)
    hops, last, acts, reserve = 0, None, {}, 0
    for block in spec.blocks:
        device = device_of(device_map, block.name + ".") if block.name else main
        device = device_of(device_map, block.name) if device is None else device
        runs = device if device in gpu_keys else main
        if device not in gpu_keys:
            reserve = max(reserve, block.bytes)
        if last is not None and runs != last:
            hops += 1
        last = runs
        acts[runs] = max(acts.get(runs, 0), block.activation)
    gpu_total = sum(weights.get(g, 0) for g in gpu_keys) or 1
    share = max(weights.get(g, 0) for g in gpu_keys) / gpu_total
    fits = True
    for budget in budgets:
        if not budget.is_gpu or (budget.device not in weights and budget.device not in acts):
            continue
        peak = weights.get(budget.device, 0) + acts.get(budget.device, 0) + DEFAULT_GPU_OVERHEAD
        peak += reserve if budget.device == main else 0
        fits = fits and peak <= budget.capacity_bytes
    return {"offloaded": offloaded, "hops": hops, "share": share, "fits": fits}


def accelerate_maps(comp, dtype, budgets) -> dict:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    model = meta_model(comp, dtype)
    max_memory = {b.device: b.capacity_bytes for b in budgets if b.capacity_bytes is not None}
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    maps = {"sequential": infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split,
                                                dtype=model.dtype)}
    for name, low_zero in (("balanced", False), ("balanced_low_0", True)):
        balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                       dtype=model.dtype, low_zero=low_zero)
        maps[name] = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split,
                                           dtype=model.dtype)
    return maps


def diffusers_balanced(plan, prepared_all, budgets) -> dict:
    """diffusers' pipeline 'balanced': whole components dealt zig-zag over GPUs, misses go to cpu."""
    from diffusers.pipelines.pipeline_loading_utils import _assign_components_to_devices

    sizes = {p.spec.name: p.spec.weights_bytes for p in prepared_all}
    sizes = dict(sorted(sizes.items(), key=lambda item: item[1], reverse=True))
    gpu_memory = {b.device: b.capacity_bytes for b in budgets if b.is_gpu}
    mapping = _assign_components_to_devices(sizes, gpu_memory)
    placed = {c: d for d, comps in mapping.items() for c in comps}
    missing = [c for c in sizes if c not in placed]  # diffusers' overwrite bug drops earlier cpu misses
    on_gpu = {d: sum(sizes[c] for c in comps) for d, comps in mapping.items() if d != "cpu"}
    offloaded = sum(sizes[c] for c in sizes if placed.get(c, "cpu") == "cpu")
    acts = {p.spec.name: p.spec.activation_peak for p in prepared_all}
    fits = True
    first_gpu = next(iter(gpu_memory))
    for device, capacity in gpu_memory.items():
        comps = [c for c, d in placed.items() if d == device]
        streamed = [c for c in sizes if placed.get(c, "cpu") == "cpu"] if device == first_gpu else []
        peak = on_gpu.get(device, 0) + max([acts[c] for c in comps] + [sizes[c] + acts[c] for c in streamed] + [0])
        fits = fits and peak + DEFAULT_GPU_OVERHEAD <= capacity
    total = sum(on_gpu.values()) or 1
    return {"offloaded": offloaded, "hops": 0, "share": max(on_gpu.values(), default=0) / total, "fits": fits,
            "map": {c: placed.get(c, "lost") for c in sizes}, "missing": missing}


def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def case_options(case: Case, weights_only: bool = False, component: str | None = None) -> PlanOptions:
    """The options of one of a case's dmap plans: the pipeline, a component alone, or a component's weights only."""
    generation = Generation(height=0, width=0, num_frames=case.frames) if weights_only else case.generation
    return PlanOptions(PlacementSpec(case.budget, dtype=case.dtype, weights=case.weights), generation,
                       component=component)


def write_case_plans(number: int, case: Case, folder: Path) -> None:
    """`--plans-to`: the case's three dmap plans as `dmap plan --output` writes them (to compare planner versions)."""
    denoiser = family_for(resolve_source(case.preset).pipeline_class).denoiser
    for kind, options in (("pipeline", case_options(case)), ("alone", case_options(case, component=denoiser)),
                          ("bare", case_options(case, weights_only=True, component=denoiser))):
        text = json.dumps(make_plan(case.preset, options).to_json(), indent=2) + "\n"
        (folder / f"{number:02d}-{kind}.json").write_text(text, encoding="utf-8")


def run_case(case: Case, check_anchors: bool) -> dict:
    inputs = case.inputs
    budgets = parse_device_spec(case.budget)
    started = time.perf_counter()
    plan = make_plan(case.preset, case_options(case))
    elapsed = time.perf_counter() - started
    source = resolve_source(case.preset)
    denoiser = family_for(source.pipeline_class).denoiser
    formats = parse_weights_spec(case.weights, [c.name for c in source.components])
    prepared_all = [prepare_component(c, source.pipeline_class, inputs, plan.dtype, weights=formats)
                    for c in source.components]
    prepared = next(p for p in prepared_all if p.spec.name == denoiser)
    alone = make_plan(case.preset, case_options(case, component=denoiser))
    dmap_alone = evaluate_map(prepared, alone.components[denoiser].device_map, budgets)
    dmap_alone["check"] = not alone.check.get("problems")
    # the same accounting as accelerate: weights only, no activations, no GPU overhead
    bare = make_plan(case.preset, case_options(case, weights_only=True, component=denoiser))
    dmap_bare = evaluate_map(prepared, bare.components[denoiser].device_map, budgets)
    dmap_bare["check"] = not bare.check.get("problems")
    anchors = {}
    flat = STORAGE_DTYPES[prepared.weights] if prepared.weights == "fp8" else plan.dtype
    for name, device_map in accelerate_maps(prepared.source, flat, budgets).items():
        result = evaluate_map(prepared, device_map, budgets)
        result["check"] = None
        if check_anchors and len(set(device_map.values())) > 1:
            from dm_cli.planning.refine.split_check import cached_check
            from dm_cli.planning.trace.trace import check_device_map

            result["check"] = not cached_check(prepared, source.pipeline_class, inputs, device_map, True,
                                                check_device_map)
        anchors[name] = result
    peaks_ok = all(use.peak <= (next(d.capacity for d in plan.devices if d.name == key) or float("inf"))
                   for stage in plan.stages for key, use in stage.use.items())
    return {
        "case": case, "plan": plan, "seconds": elapsed, "peaks_ok": peaks_ok, "denoiser": denoiser,
        "dmap_alone": dmap_alone, "dmap_bare": dmap_bare, "accelerate": anchors, "diffusers": diffusers_balanced(plan, prepared_all, budgets),
    }


def yes(value) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def main() -> int:
    import logging

    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available": planning for absent GPUs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-anchors", action="store_true", help="Also run the split check on accelerate's maps.")
    parser.add_argument("--only", default=None, help="Run only these cases (1-based, comma-separated: 16,17).")
    parser.add_argument("--preset", default=None, help="Run only the cases of this preset (e.g. qwen-image).")
    parser.add_argument("--plans-to", type=Path, default=None,
                        help="Only write each case's dmap plans (NN-pipeline/alone/bare.json) to this folder.")
    args = parser.parse_args()
    numbers = range(1, len(CASES) + 1) if args.only is None else [int(n) for n in args.only.split(",")]
    cases = [(n, CASES[n - 1]) for n in numbers if args.preset in (None, CASES[n - 1].preset)]  # the case numbers of docs/performance.md
    if args.plans_to is not None:
        args.plans_to.mkdir(parents=True, exist_ok=True)
        for done, (number, case) in enumerate(cases, 1):
            print(f"[{done}/{len(cases)}] case {number}: {case.model} {case.budget} {case.label}", file=sys.stderr)
            write_case_plans(number, case, args.plans_to)
        return 0
    rows, violations = [], []
    for done, (number, case) in enumerate(cases, 1):
        print(f"[{done}/{len(cases)}] case {number}: {case.model} {case.budget} {case.label}", file=sys.stderr)
        rows.append({**run_case(case, args.check_anchors), "number": number})
    print("\n### Pipeline level: dmap plan vs diffusers \"balanced\" (GB offloaded to cpu; fits = weights + activations + 600 MB/GPU)\n")
    print("| # | model | devices | input | dmap mode | dmap offload | dmap hops | dmap max share | dmap fits | dmap check | diffusers offload | diffusers fits | diffusers map | plan s |")
    print("|---|---|---|---|---|---:|---:|---:|---|---|---:|---|---|---:|")
    for row in rows:
        index, case, plan, diff = row["number"], row["case"], row["plan"], row["diffusers"]
        share = plan_share(plan)
        check = plan.check
        print(f"| {index} | {case.model} | {case.budget} | {case.label} | {plan.mode} | "
              f"{gb(plan.offloaded_bytes)} | {plan.hops} | {share:.2f} | {yes(row['peaks_ok'])} | "
              f"{yes(not check.get('problems')) if check.get('ran') else '—'} | {gb(diff['offloaded'])} | "
              f"{yes(diff['fits'])} | {fmt_map(diff['map'])} | {row['seconds']:.2f} |")
        if plan.offloaded_bytes > diff["offloaded"]:
            violations.append(f"case {index}: dmap offloads more than diffusers balanced")
    print("\n### Denoiser alone on all devices: dmap vs accelerate infer_auto_device_map (GB offloaded / hops / max share / activations fit / check)\n")
    print("dmap (input-aware) counts activations and 600 MB per GPU; dmap (weights only) counts what accelerate "
          "counts, so its offload is the like-for-like comparison. 'fits' is always judged with activations.\n")
    print("| # | model | component | devices | dmap (input-aware) | dmap (weights only) | accelerate sequential "
          "| accelerate balanced | accelerate balanced_low_0 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        index, case = row["number"], row["case"]
        cells = [cell(row["dmap_alone"]), cell(row["dmap_bare"])] + [
            cell(row["accelerate"][k]) for k in ("sequential", "balanced", "balanced_low_0")]
        print(f"| {index} | {case.model} {case.label} | {row['denoiser']} | {case.budget} | "
              + " | ".join(cells) + " |")
        least = min(r["offloaded"] for r in row["accelerate"].values())
        if row["dmap_bare"]["offloaded"] > least:
            violations.append(f"case {index}: dmap offloads more than accelerate")
    print()
    totals = {"dmap input-aware": sum(r["dmap_alone"]["offloaded"] for r in rows),
              "dmap weights-only": sum(r["dmap_bare"]["offloaded"] for r in rows)}
    for name in ("sequential", "balanced", "balanced_low_0"):
        totals[name] = sum(r["accelerate"][name]["offloaded"] for r in rows)
    totals["diffusers"] = sum(r["diffusers"]["offloaded"] for r in rows)
    totals["dmap pipeline"] = sum(r["plan"].offloaded_bytes for r in rows)
    print("Totals offloaded (GB): " + ", ".join(f"{k} {gb(v)}" for k, v in totals.items()))
    fits = {"dmap input-aware": sum(r["dmap_alone"]["fits"] for r in rows),
            "dmap weights-only": sum(r["dmap_bare"]["fits"] for r in rows),
            **{k: sum(r["accelerate"][k]["fits"] for r in rows) for k in ("sequential", "balanced", "balanced_low_0")},
            "diffusers": sum(r["diffusers"]["fits"] for r in rows)}
    print(f"Cases where weights + activations fit every GPU (of {len(rows)}): "
          + ", ".join(f"{k} {v}" for k, v in fits.items()))
    if violations:
        print("\nVIOLATIONS:\n" + "\n".join(violations))
        return 1
    print("dmap never offloads more than accelerate or diffusers.")
    return 0


def plan_share(plan) -> float:
    """Largest share of the GPU weights on one GPU, in the stage with the most GPU weights."""
    heaviest = max(plan.stages, key=lambda s: sum(u.weights for k, u in s.use.items() if k.isdigit()))
    gpu = {k: u.weights for k, u in heaviest.use.items() if k.isdigit()}
    return max(gpu.values()) / sum(gpu.values()) if gpu and sum(gpu.values()) else 0.0


def fmt_map(mapping: dict) -> str:
    short = {"text_encoder": "te", "text_encoder_2": "te2", "text_encoder_3": "te3", "transformer": "tr",
             "transformer_2": "tr2", "unet": "unet", "vae": "vae"}
    return " ".join(f"{short.get(c, c)}:{d}" for c, d in mapping.items())


def cell(result: dict) -> str:
    check = "" if result.get("check") is None else (" ✓" if result["check"] else " ✗check")
    return (f"{gb(result['offloaded'])} / {result['hops']} / {result['share']:.2f} / "
            f"{'fits' if result['fits'] else '**OOM**'}{check}")


if __name__ == "__main__":
    sys.exit(main())

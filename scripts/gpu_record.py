"""The public record of GPU measurements as dmap's test set: each published figure re-planned from configs alone.

    .venv/bin/python scripts/gpu_record.py            # the table: published, predicted, error, bound, verdict
    .venv/bin/python scripts/gpu_record.py --write    # and docs/gpu-record.md

The rows (tests/planning/gpu_record_rows.json) are published measurements of diffusers pipelines on GPUs, copied as
published with their sources (docs/gpu-record-sources.md says where each comes from). Each row that dmap can plan
the same way (a preset of the model, a table row for the GPU, the whole pipeline resident, weights in a format dmap
runs; a row that compiled its denoiser with torch.compile planned with `--compile full`) is planned with
`dm_cli.plan(..., profile="table:GPU")` and its figure compared:

- `loaded_memory`: the components' weights; `peak_allocated`: the plan's peak on the GPU (weights, activations as
  CUDA's kernels hold them, and dmap's 600 MB per-GPU overhead, which stands for the CUDA context and cuBLAS's
  workspace) must be at least the published figure and within 10% above it; `peak_reserved` (the caching allocator's
  segments and their fragmentation too, which dmap does not model) within 10% either way; the activations above the
  weights, where a source gives both, within 25%;
- `image_seconds` (one pipeline call: encode, every step, decode), `step_seconds` and `its` (steps per second):
  within 25%.

A row dmap cannot plan the same way says why (`unmatched`): diffusers' own offload hooks, a weight format dmap does
not run (or runs eager under --compile), a GPU without a datasheet row, a model without a preset. "GB" in a source is read as GiB
(torch.cuda's counters divided by 1024**3, which every source whose code could be read does). Memory figures are
published in GiB, so errors are of bytes. tests/planning/test_gpu_record.py re-plans every row and fails when one
leaves its bound, or, for a row outside its bound for a reason the row names, when it gets worse.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "tests" / "planning" / "gpu_record_rows.json"
EXPLAINED = REPO / "tests" / "planning" / "gpu_record_explained.json"
DOC = REPO / "docs" / "gpu-record.md"
GIB = 1024 ** 3
PRESETS = {"flux.1-dev": "flux-dev", "flux.1-schnell": "flux-schnell", "flux.2-dev": "flux2-dev", "sdxl-base-1.0": "sdxl",
           "sd-1.5": "sd15", "sd3-medium": "sd3-medium", "qwen-image": "qwen-image", "wan2.2-ti2v-5b": "wan2.2-ti2v-5b",
           "wan2.2-t2v-a14b": "wan2.2-t2v-a14b"}  # the record's model names -> dmap's presets
GPU_MEMORY = {"h100-sxm": "80GB", "h100-pcie": "80GB", "h200-sxm": "141GB", "a100-80gb": "80GB", "a100-40gb": "40GB",
              "l40s": "48GB", "l20": "48GB", "l4": "24GB", "a10g": "24GB", "rtx-3090": "24GB", "rtx-4090": "24GB",
              "rtx-5090": "32GB"}
FORMATS = {"torchao int8_weight_only": "int8", "fp8 e4m3 layerwise casting": "fp8", "bnb nf4": "nf4", "bf16": None,
           "fp16": None}
BOUNDS = {"loaded_memory": 0.10, "peak_allocated": 0.10, "peak_reserved": 0.10, "activations": 0.25,
          "image_seconds": 0.25, "step_seconds": 0.25, "its": 0.25}
MEMORY = ("loaded_memory", "peak_allocated", "peak_reserved", "activations")


def rows() -> list[dict]:
    return json.loads(ROWS.read_text())


@functools.lru_cache(maxsize=1)
def explained() -> dict:
    """Row id -> {"why": why it is outside its bound, "error": its error when that was written} or
    {"not_comparable": why the published figure is not of what dmap plans}."""
    return json.loads(EXPLAINED.read_text()) if EXPLAINED.exists() else {}


def weights_spec(row: dict) -> str | None | bool:
    """dmap's --weights for the row's formats (None: all in the run dtype; False: a format dmap does not run)."""
    parts = []
    for component, text in (row.get("weights") or {}).items():
        fmt = next((dmap for name, dmap in FORMATS.items() if str(text).lower().startswith(name)), False)
        if fmt is False:
            return False
        if fmt:
            parts.append(f"{component}={fmt}")
    return ",".join(parts) or None


def unmatched(row: dict) -> str | None:
    """Why dmap cannot plan this row as it was measured (None: it can)."""
    judged_apart = explained().get(row["id"], {}).get("not_comparable")
    if judged_apart:
        return judged_apart
    if row.get("no_preset") or row["model"] not in PRESETS:
        return f"no dmap preset of {row['model']}"
    if row["gpu"] not in GPU_MEMORY:
        return f"no datasheet row for the {row['gpu']}"
    if row.get("offload") not in (None, "none"):
        return f"diffusers' {row['offload']} offload hooks, not a dmap placement"
    if weights_spec(row) is False:
        return f"a weight format dmap does not run ({', '.join(map(str, row['weights'].values()))})"
    if str(row.get("attention") or "").startswith("math"):
        return "attention in PyTorch ops (diffusers' default processors), not scaled_dot_product_attention"
    if row["quantity"] not in BOUNDS:
        return f"a {row['quantity']} figure (its counter is not stated)"
    if not row.get("height"):
        return "its size is not stated"
    return None


def plan_key(row: dict) -> tuple:
    return (row["model"], row["gpu"], row["dtype"], weights_spec(row), row.get("cfg"), row["height"], row["width"], row["frames"],
            row["steps"], row["batch"], compile_mode(row))


def compile_mode(row: dict) -> str:
    """dmap's --compile for the row: a row that compiled its denoiser whole (torch.compile on the model) is `full`."""
    return "none" if row.get("compile") in (None, "none") else "full"


def make(row: dict):
    """The row's plan: the whole pipeline resident on one GPU of the row's kind, its profile the table's row."""
    import dm_cli

    return dm_cli.plan(PRESETS[row["model"]], max_memory=f"0={GPU_MEMORY[row['gpu']]}", height=row["height"],
                       width=row["width"], batch_size=row["batch"] or 1, num_frames=row["frames"],
                       dtype=row["dtype"], weights=weights_spec(row), mode="resident", check=False,
                       profile=f"table:{row['gpu']}", steps=row["steps"], compile=compile_mode(row),
                       # Qwen-Image's true CFG runs only with a negative prompt (its second call per step)
                       negative_prompt=" " if row.get("cfg") == "true" and row["model"] == "qwen-image" else None)


def figures(plan) -> dict[str, float]:
    """What the plan predicts of each quantity (GiB, seconds, steps per second)."""
    weights = sum(c.weights_bytes for c in plan.components.values())
    peak = max(max(s.peak_bytes.values()) for s in plan.stages)
    activations = max(u.activations for s in plan.stages for u in s.use.values())
    predicted = plan.predicted_time
    out = {"loaded_memory": weights / GIB, "peak_allocated": peak / GIB, "peak_reserved": peak / GIB,
           "activations": activations / GIB}
    if predicted and predicted.get("compile_eager_because"):  # asked to compile, the run would not: nothing to compare
        return {"unmatched": f"dmap runs it eager under --compile: {predicted['compile_eager_because']}"}
    if predicted:
        out.update(image_seconds=predicted.get("pipeline_s", 0.0), step_seconds=predicted["step_s"],
                   its=1.0 / predicted["step_s"] if predicted["step_s"] else 0.0)
    return out


def activation_rows(all_rows: list[dict]) -> list[dict]:
    """Rows of the activations above the weights, where a source gives a loaded and a peak figure of one run."""
    out = []
    for row in all_rows:
        if row["quantity"] != "peak_allocated":
            continue
        loaded = next((r for r in all_rows if r["quantity"] == "loaded_memory" and plan_key(r) == plan_key(row)
                       and r["source"]["url"] == row["source"]["url"] and r["compile"] == row["compile"]
                       and r["offload"] == row["offload"]), None)
        if loaded is not None:
            out.append({**row, "id": row["id"] + "-activations", "quantity": "activations",
                        "value": row["value"] - loaded["value"], "derived": f"{row['id']} - {loaded['id']}"})
    return out


def judged(row: dict, predicted: float | None) -> dict:
    """The row with its prediction, error and verdict against its bound."""
    value = float(row["value"])
    result = {"id": row["id"], "quantity": row["quantity"], "published": value, "unit": row["unit"]}
    if predicted is None:
        return result
    error = (predicted - value) / value
    bound = BOUNDS[row["quantity"]]
    within = 0 <= error <= bound if row["quantity"] == "peak_allocated" else abs(error) <= bound
    return {**result, "predicted": round(predicted, 4), "error": round(error, 4), "bound": bound, "within": within}


def evaluate(selected: list[dict] | None = None, on_plan=None) -> list[dict]:
    """Every row judged (unmatched rows with their reason), each distinct plan made once."""
    all_rows = rows()
    table = selected if selected is not None else all_rows + activation_rows(all_rows)
    plans: dict[tuple, dict] = {}
    out = []
    for row in table:
        reason = unmatched(row)
        if reason is not None:
            out.append({**judged(row, None), "unmatched": reason})
            continue
        key = plan_key(row)
        if key not in plans:
            plans[key] = figures(make(row))
            if on_plan is not None:
                on_plan(row, plans[key])
        if "unmatched" in plans[key]:
            out.append({**judged(row, None), "unmatched": plans[key]["unmatched"]})
            continue
        out.append(judged(row, plans[key].get(row["quantity"])))
    return out


def summary(results: list[dict]) -> dict:
    compared = [r for r in results if "error" in r]
    memory = [abs(r["error"]) for r in compared if r["quantity"] in MEMORY]
    time = [abs(r["error"]) for r in compared if r["quantity"] not in MEMORY]
    return {"rows": len(results), "compared": len(compared), "within": sum(r["within"] for r in compared),
            "memory_rows": len(memory), "memory_median": statistics.median(memory) if memory else None,
            "time_rows": len(time), "time_median": statistics.median(time) if time else None}


def markdown(results: list[dict]) -> str:
    why = explained()
    by_id = {r["id"]: r for r in rows()}
    stats = summary(results)
    lines = ["# The public record of GPU measurements, against dmap's plan", "",
             "Published measurements of diffusers pipelines on GPUs (sources: [gpu-record-sources.md]"
             "(gpu-record-sources.md)), each re-planned by dmap from configs alone with `--profile table:GPU` "
             "(`scripts/gpu_record.py`, which writes this page; `tests/planning/test_gpu_record.py` re-plans every "
             "row). Memory in GiB, times in seconds (its: steps per second). Bounds: a plan's peak at least an "
             "allocated peak and at most 10% above it; a reserved peak within 10%; the activations above the "
             "weights within 25%; times within 25%.", "",
             f"**{stats['within']} of {stats['compared']} compared rows within their bounds**; median error "
             f"{_pct(stats['memory_median'])} over {stats['memory_rows']} memory rows and {_pct(stats['time_median'])} "
             f"over {stats['time_rows']} time rows; {stats['rows'] - stats['compared']} rows dmap cannot plan the "
             "way they were measured (why, in the last column).", "",
             "| row | model | GPU | size, steps, batch | weights | quantity | published | dmap | error | verdict |",
             "|---|---|---|---|---|---|---:|---:|---:|---|"]
    for r in results:
        row = by_id.get(r["id"]) or by_id.get(r["id"].removesuffix("-activations"), {})
        size = f"{row.get('width')}x{row.get('height')}" + (f"x{row['frames']}" if row.get("frames") else "")
        weights = ", ".join(f"{k} {v}" for k, v in (row.get("weights") or {}).items()) or row.get("dtype") or ""
        if "error" in r:
            verdict = "within" if r["within"] else "**outside**: " + why.get(r["id"], {}).get("why", "")
            shown = f"{r['predicted']:.4g}", f"{r['error']:+.0%}"
        else:
            verdict, shown = f"not compared: {r['unmatched']}", ("", "")
        lines.append(f"| {r['id']} | {row.get('model')} | {row.get('gpu')} | {size}, {row.get('steps')}, "
                     f"{row.get('batch')} | {weights} | {r['quantity']} | {r['published']:.4g} {r['unit']} | "
                     f"{shown[0]} | {shown[1]} | {verdict} |")
    return "\n".join(lines) + "\n"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write docs/gpu-record.md")
    parser.add_argument("--rows", help="only these row ids (comma-separated)")
    parser.add_argument("--explain", action="store_true",
                        help="record each explained row's error now in tests/planning/gpu_record_explained.json")
    args = parser.parse_args(argv)
    selected = None
    if args.rows:
        wanted = set(args.rows.split(","))
        selected = [r for r in rows() if r["id"] in wanted]
    results = evaluate(selected, on_plan=lambda row, _figures: print(f"planned {row['id']}", file=sys.stderr))
    for r in results:
        if "error" in r:
            print(f"{r['id']:<44} {r['quantity']:<15} {r['published']:>9.4g} {r['predicted']:>9.4g} "
                  f"{r['error']:>+7.1%}  {'within' if r['within'] else 'OUTSIDE'}")
        else:
            print(f"{r['id']:<44} {r['quantity']:<15} {r['published']:>9.4g}  not compared: {r['unmatched']}")
    print(json.dumps(summary(results)))
    if args.write:
        DOC.write_text(markdown(results))
    if args.explain:
        entries = json.loads(EXPLAINED.read_text())  # a copy: explained() is read once and cached
        for r in results:
            if "error" in r and r["id"] in entries and "why" in entries[r["id"]]:
                entries[r["id"]]["error"] = r["error"]
        EXPLAINED.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Plans for community GGUF files beside diffusers' own way to run them (no GPU, no weights needed).

For each case a header-only GGUF file is written with the real tensor names (the original BFL / Wan layout, the
inverse of diffusers' single-file mapping: tests/original_layouts.py), shapes and quantization types (matrices in
the case's type, biases and norms F32, convolutions F16) and a hole for data; `dmap plan FILE --pipeline PRESET`
reads only headers (Wan 2.2: both experts as files, the second by `--component-file transformer_2=FILE`). Beside
it, what diffusers offers for the same file: `from_single_file(...,
quantization_config=GGUFQuantizationConfig(...))` and then `enable_model_cpu_offload()` (each whole component
moved to one GPU when it runs; it never splits one across GPUs) — "fits" means its largest component, weights plus
dmap's activation estimate plus 600 MB, fits the largest GPU.

    .venv/bin/python scripts/bench_single_file.py [--only N[,M]]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CASES = [  # (preset, layout, ggml type, --max-memory, file name, {other component: its file} via --component-file)
    ("flux2", "flux2", "Q4_K", "0=12GB,1=12GB,cpu=64GB", "flux2-dev-Q4_K.gguf", {}),
    ("wan2.2", "wan", "Q8_0", "0=16GB,cpu=64GB", "wan2.2_t2v_high_noise_14B_Q8_0.gguf",
     {"transformer_2": "wan2.2_t2v_low_noise_14B_Q8_0.gguf"}),  # both experts as GGUF
]
GPU_OVERHEAD = 600 * 10**6


def header_only(folder: Path, preset: str, layout: str, quant: str, name: str, component: str = "transformer") -> Path:
    import gguf
    from original_layouts import header_only_gguf, to_original

    from dm_cli.model.skeleton import load_skeleton
    from dm_cli.model.sources import resolve_source

    comp = resolve_source(preset).component(component)
    skeleton = load_skeleton(comp.name, comp.library, comp.cls, comp.config)
    shapes = {t.name: t.shape for t in skeleton.tensors if t.kind != "buffer_np"}
    return header_only_gguf(folder / name, to_original(shapes, layout), getattr(gguf.GGMLQuantizationType, quant))


def row(number: int, case, folder: Path) -> str:
    import dm_cli
    from dm_cli.units import format_size, parse_device_spec

    preset, layout, quant, budget, name, others = case
    path = header_only(folder, preset, layout, quant, name)
    files = {comp: str(header_only(folder, preset, layout, quant, file, comp)) for comp, file in others.items()}
    started = time.perf_counter()
    plan = dm_cli.plan(str(path), pipeline=preset, component_files=files, max_memory=budget, dtype="bfloat16")
    seconds = time.perf_counter() - started
    transformers = [plan.components[name] for name in ("transformer", *others)]
    size = sum(Path(f).stat().st_size for f in (path, *files.values()))
    largest_gpu = max(b.capacity_bytes for b in parse_device_spec(budget) if b.is_gpu)
    need = max(c.weights_bytes + plan.activation_peaks.get(c.name, 0) for c in plan.components.values()) + GPU_OVERHEAD
    check = "passed" if plan.check.get("ran") and not plan.check.get("problems") else "FAILED"
    what = f"{preset} {quant}" + (" (" + " + ".join(("transformer", *others)) + ")" if others else "")
    return (f"| {number} | {what} | {budget} | {format_size(size)} | "
            f"{' + '.join(format_size(t.weights_bytes) for t in transformers)} | {format_size(plan.offloaded_bytes)} | "
            f"{plan.mode} | "
            f"{check} | {'yes' if need <= largest_gpu else 'no'} ({format_size(need)}) | {seconds:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="case numbers, e.g. 1,2")
    args = parser.parse_args()
    only = {int(n) for n in args.only.split(",")} if args.only else None
    print("| # | file(s) | --max-memory | file size | transformer(s) planned | dmap offloads | mode | split check | "
          "diffusers model offload fits (needs) | plan time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for number, case in enumerate(CASES, 1):
            if only is None or number in only:
                print(row(number, case, Path(folder)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check (needs one CUDA GPU; NOT run in CI, and not yet run at all): a real CUDA plan with GPU + CPU placement.

Builds a mid-size FLUX-architecture pipeline with random weights (transformer ~1.3 GB in bf16),
plans it for `0=<GPU budget>,cpu=64GB` so that the transformer does not fit the GPU whole (part of it
is streamed from the original safetensors through accelerate hooks), runs `dmap run` for real on
CUDA, and prints per stage and device the measured peak (torch.cuda.max_memory_allocated) beside the
plan's peak_bytes. Exit 1 when a measured GPU peak exceeds the planned one.

Usage: .venv/bin/python scripts/gpu_check.py [--gpu-budget 1.6GB] [--size 512] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-budget", default="1.6GB")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU here: this check needs one.", file=sys.stderr)
        return 2
    os.environ.setdefault("DMAP_CACHE_DIR", tempfile.mkdtemp(prefix="dmap-gpu-check-"))
    from dm_cli.model.demo import DEMO_CONFIGS, write_configs, write_random_pipeline
    from dm_cli.run.request import RunRequest
    from dm_cli.run.single import run

    configs = copy.deepcopy(DEMO_CONFIGS)
    configs["transformer"].update(num_layers=4, num_single_layers=12, num_attention_heads=12, attention_head_dim=128,
                                  joint_attention_dim=1024, axes_dims_rope=[16, 56, 56])
    configs["text_encoder_2"].update(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_layers=6)
    root = Path(os.environ["DMAP_CACHE_DIR"]) / "gpu-check-pipeline"
    if not (root / "transformer").is_dir():
        root.mkdir(parents=True, exist_ok=True)  # write_configs writes into an existing folder
        write_configs(configs, root)
        write_random_pipeline(root, root, seed=0, max_shard_size="200MB", dtype="bfloat16")
    request = RunRequest.of(source=str(root), prompt="a red fox in the snow", max_memory=f"0={args.gpu_budget},cpu=64GB",
                         mode="staged", steps=args.steps, height=args.size, width=args.size,
                         output=str(root.parent / "gpu-check.png"), overwrite=True)
    result = run(request, on_plan=lambda plan: print(json.dumps(
        {n: c.device_map for n, c in plan.components.items()}, indent=1)))
    print("| stage | device | measured peak | planned peak_bytes | measured/planned |")
    print("|---|---|---:|---:|---:|")
    worst = 0.0
    for stage in result.stages:
        for dev in sorted(set(stage.measured_peak) | set(stage.planned_peak)):
            m, p = stage.measured_peak.get(dev, 0), stage.planned_peak.get(dev, 0)
            ratio = m / p if p else 0.0
            if dev.isdigit():
                worst = max(worst, ratio)
            print(f"| {stage.name} | {dev} | {m / 1e9:.3f} GB | {p / 1e9:.3f} GB | {ratio:.2f} |")
    print(f"stage wall times: {[(s.name, round(s.wall_s, 2)) for s in result.stages]}")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

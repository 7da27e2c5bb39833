"""Start-up and inspect timings, measured in one run: `dmap --help`, cold and warm `dmap inspect flux`.

Cold = empty skeleton cache (builds every component on the meta device, imports torch);
warm = cached skeletons (no torch import). Each figure is the median of several runs.
Compared with the ecosystem's way of getting the same numbers: importing diffusers/transformers
and building each component on the meta device.

    .venv/bin/python scripts/bench_inspect.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ECOSYSTEM = """
import json, torch
from pathlib import Path
import diffusers, transformers
import dm_cli.presets as p
root = Path(p.__path__[0]) / "flux.1-dev"
index = json.loads((root / "model_index.json").read_text())
total = 0
for name, value in index.items():
    if name.startswith("_") or name not in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        continue
    lib, cls = value
    config = json.loads((root / name / "config.json").read_text())
    if lib == "diffusers":
        with torch.device("meta"):
            model = getattr(diffusers, cls).from_config(config)
    else:
        c = getattr(transformers, cls).config_class.from_dict(config)
        with torch.device("meta"):
            model = getattr(transformers, cls)(c)
        model.tie_weights()
    total += sum(p.numel() for p in model.parameters())
print(total)
"""


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dmap = [sys.executable, "-m", "dm_cli"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DMAP_CACHE_DIR": tmp}
        rows.append(("dmap --help", statistics.median(timed(dmap + ["--help"], env) for _ in range(args.repeat)), 0.3))
        cold = []
        for i in range(max(1, args.repeat // 2)):
            cold_env = {**env, "DMAP_CACHE_DIR": os.path.join(tmp, f"cold{i}")}
            cold.append(timed(dmap + ["inspect", "flux", "--json"], cold_env))
        rows.append(("dmap inspect flux (cold cache)", statistics.median(cold), None))
        timed(dmap + ["inspect", "flux", "--json"], env)  # fill the cache
        warm = statistics.median(timed(dmap + ["inspect", "flux", "--json"], env) for _ in range(args.repeat))
        rows.append(("dmap inspect flux (warm cache)", warm, 1.0))
        eco = statistics.median(timed([sys.executable, "-c", ECOSYSTEM], env) for _ in range(max(1, args.repeat // 2)))
        rows.append(("ecosystem: import diffusers+transformers, build on meta", eco, None))
    print("| measurement | wall time (s) | target | vs warm dmap |")
    print("|---|---:|---:|---:|")
    for name, seconds, target in rows:
        tgt = f"< {target}" if target else "—"
        print(f"| {name} | {seconds:.3f} | {tgt} | {seconds / warm:.1f}× |")


if __name__ == "__main__":
    main()

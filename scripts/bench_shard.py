#!/usr/bin/env python
"""Benchmark `dmap shard` against today's ways of resharding and against `cp`.

Builds a random SD 1.5 UNet in fp32 (~3.4 GB, one safetensors file, written in chunks with a
hand-made header so building it never holds the model in RAM), then runs each contender in its own
subprocess and reports wall time and that process's peak RSS (os.wait4). The machine may be
shared and noisy, so the methods run in interleaved rounds (`--repeat`, default 3) and the table
shows each one's median wall time (best in brackets); every ratio uses the medians:

  - cp of the same file (and cp + fsync of the copy, since dmap fsyncs what it writes)
  - dmap shard --max-shard-size 500MB (verification on, the default) and with --no-verify
  - huggingface_hub.save_torch_state_dict(safetensors.torch.load_file(...), max_shard_size="500MB")
  - diffusers UNet2DConditionModel.from_pretrained(...).save_pretrained(max_shard_size="500MB")

Usage: python scripts/bench_shard.py [--workdir /tmp] [--repeat 3] [--only cp,dmap,...] [--keep]
Targets (issue 3): dmap peak RSS < 300 MB whatever the model size; throughput >= 0.8x cp.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "dm_cli" / "presets" / "sd-1.5" / "unet" / "config.json"
PY = sys.executable


def build_checkpoint(folder: Path) -> int:
    """Random fp32 SD 1.5 UNet: shapes from the config on the meta device, data written in chunks."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    from dm_cli.model.skeleton import build_on_meta

    config = json.loads(CONFIG.read_text())
    model = build_on_meta("diffusers", "UNet2DConditionModel", config)
    entries, offset = {}, 0
    shapes = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    for name, shape in shapes:
        n = 4
        for d in shape:
            n *= d
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    folder.mkdir(parents=True)
    shutil.copy(CONFIG, folder / "config.json")
    block = (np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32) * 0.02).tobytes()  # 64 MB
    with open(folder / "diffusion_pytorch_model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        left, i = offset, 0
        while left:
            chunk = block[(i * 4096) % len(block):][: min(left, len(block))]  # shifted so tensors differ
            chunk = chunk or block[: min(left, len(block))]
            handle.write(chunk)
            left -= len(chunk)
            i += 1
        handle.flush()
        os.fsync(handle.fileno())
    return offset


HUB = """
import os, sys
from safetensors.torch import load_file
from huggingface_hub import save_torch_state_dict
os.makedirs(sys.argv[2])
save_torch_state_dict(load_file(sys.argv[1]), sys.argv[2], max_shard_size="500MB")
"""

DIFFUSERS = """
import sys
from diffusers import UNet2DConditionModel
UNet2DConditionModel.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], max_shard_size="500MB")
"""


def measure_rounds(methods: list[tuple[str, str, list[str], Path | None]], repeat: int) -> list[dict]:
    """Run every method once per round, rounds interleaved, so slow spells of a noisy machine hit all
    methods alike; per method: median and best wall time, highest peak RSS."""
    walls: dict[str, list[float]] = {key: [] for key, *_ in methods}
    rss: dict[str, int] = {key: 0 for key, *_ in methods}
    for _ in range(repeat):
        for key, name, argv, out in methods:
            run = measure_once(name, argv, out)
            walls[key].append(run["wall"])
            rss[key] = max(rss[key], run["rss"])
    return [{"key": key, "name": name, "wall": statistics.median(walls[key]), "best": min(walls[key]), "rss": rss[key]}
            for key, name, *_ in methods]


def measure_once(name: str, argv: list[str], out: Path | None) -> dict:
    """Wall time and peak RSS of one subprocess; its output is removed afterwards."""
    os.sync()
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{stderr}")
    written = 0
    if out is not None and out.exists():
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else out.stat().st_size
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    print(f"{name}: {wall:.2f} s, peak RSS {usage.ru_maxrss / 1e3:,.0f} MB", file=sys.stderr)
    return {"name": name, "wall": wall, "rss": usage.ru_maxrss * 1024, "written": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp", help="Where to put the ~3.4 GB checkpoint and outputs.")
    parser.add_argument("--keep", action="store_true", help="Keep the work folder.")
    parser.add_argument("--repeat", type=int, default=3, help="Interleaved rounds of every method (median reported).")
    parser.add_argument("--only", help="Comma-separated subset of: cp,cp-sync,dmap,dmap-no-verify,hub,diffusers.")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # internal: build the checkpoint in a child
    args = parser.parse_args()
    if args.build:
        print(build_checkpoint(Path(args.build)))
        return
    work = Path(tempfile.mkdtemp(prefix="dmap-bench-shard-", dir=args.workdir))
    try:
        started = time.perf_counter()
        unet = work / "unet"
        # Built in a child: Linux carries a parent's peak RSS into every child it forks, so the parent
        # must stay small for the per-process numbers below to mean anything.
        data_bytes = int(subprocess.run([PY, __file__, "--build", str(unet)], check=True, capture_output=True,
                                        text=True).stdout)
        source = unet / "diffusion_pytorch_model.safetensors"
        size = source.stat().st_size
        print(f"built {source} ({size / 1e9:.2f} GB, {data_bytes / 1e9:.2f} GB of tensors) "
              f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        methods = [
            ("cp", "cp", ["cp", str(source), str(work / "copy.safetensors")], work / "copy.safetensors"),
            ("cp-sync", "cp + sync (fsync the copy)",
             ["sh", "-c", f"cp '{source}' '{work}/copy.safetensors' && sync '{work}/copy.safetensors'"],
             work / "copy.safetensors"),
            ("dmap", "dmap shard -s 500MB (verified, the default)",
             [PY, "-m", "dm_cli", "shard", str(unet), "-s", "500MB", "-o", str(work / "dmap"), "--quiet"], work / "dmap"),
            ("dmap-no-verify", "dmap shard -s 500MB --no-verify",
             [PY, "-m", "dm_cli", "shard", str(unet), "-s", "500MB", "-o", str(work / "dmap2"), "--quiet", "--no-verify"],
             work / "dmap2"),
            ("hub", "huggingface_hub save_torch_state_dict", [PY, "-c", HUB, str(source), str(work / "hub")], work / "hub"),
            ("diffusers", "diffusers save_pretrained", [PY, "-c", DIFFUSERS, str(unet), str(work / "diffusers")],
             work / "diffusers"),
        ]
        if args.only:
            keep = set(args.only.split(","))
            methods = [m for m in methods if m[0] in keep]
        runs = measure_rounds(methods, args.repeat)
        ratio = {r["key"]: r["wall"] for r in runs}
        print(f"\nSource: random SD 1.5 UNet, fp32, one file of {size / 1e9:.2f} GB; {os.cpu_count()} CPUs; outputs on "
              f"the same file system; median of {args.repeat} interleaved rounds (best in brackets).\n")
        baseline = measure_once("baseline: python -c pass", [PY, "-c", "pass"], None)["rss"]
        print(f"(peak RSS of a bare child of this script: {baseline / 1e6:.0f} MB)\n")
        print("| method | wall time | throughput | vs cp | vs cp + sync | peak RSS |")
        print("|---|---:|---:|---:|---:|---:|")
        for run in runs:
            vs = [f"{ratio[k] / run['wall']:.2f}x" if k in ratio else "-" for k in ("cp", "cp-sync")]
            print(f"| {run['name']} | {run['wall']:.2f} s ({run['best']:.2f}) | {size / run['wall'] / 1e9:.2f} GB/s | "
                  f"{vs[0]} | {vs[1]} | {run['rss'] / 1e6:,.0f} MB |")
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

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

With `--size 1GB` the source is instead a synthetic transformer-like checkpoint of about that size (one
safetensors file, fp32: large projection and MLP matrices, small biases and norms) given to dmap as the file
itself, and `--shard-size` (default 300MB with --size, 500MB without) sets dmap's --max-shard-size; the
default methods are then cp, cp-sync, dmap and dmap-no-verify (hub also works; diffusers needs the UNet).

Usage: python scripts/bench_shard.py [--workdir /tmp] [--repeat 3] [--only cp,dmap,...] [--keep]
       python scripts/bench_shard.py --size 1GB --repeat 9      (issue 31: 300MB shards by default)
Targets (issue 3): dmap peak RSS < 300 MB whatever the model size; throughput >= 0.8x cp.
Target (issue 31): 1 GB single file into 300 MB shards, verified, >= 0.8x cp + sync in the same run.
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


def write_random_safetensors(path: Path, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """A float32 safetensors file of these tensors with random data, written in 64 MB chunks (never all in RAM,
    the header made by hand); returns the bytes of tensor data."""
    import numpy as np

    entries, offset = {}, 0
    for name, shape in shapes:
        n = 4
        for d in shape:
            n *= d
        entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    block = (np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32) * 0.02).tobytes()  # 64 MB
    with open(path, "wb") as handle:
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


def build_checkpoint(folder: Path) -> int:
    """Random fp32 SD 1.5 UNet: shapes from the config on the meta device."""
    sys.path.insert(0, str(REPO))
    from dm_cli.model.skeleton import build_on_meta

    model = build_on_meta("diffusers", "UNet2DConditionModel", json.loads(CONFIG.read_text()))
    folder.mkdir(parents=True)
    shutil.copy(CONFIG, folder / "config.json")
    shapes = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    return write_random_safetensors(folder / "diffusion_pytorch_model.safetensors", shapes)


def build_synthetic(folder: Path, size: int) -> int:
    """A transformer-like fp32 checkpoint of about `size` bytes of tensors: per block four 1024x1024 attention
    matrices, two 1024x4096 MLP matrices, their biases and two norms."""
    hidden, mlp = 1024, 4096
    block = [("attn.q.weight", (hidden, hidden)), ("attn.q.bias", (hidden,)), ("attn.k.weight", (hidden, hidden)),
             ("attn.k.bias", (hidden,)), ("attn.v.weight", (hidden, hidden)), ("attn.v.bias", (hidden,)),
             ("attn.out.weight", (hidden, hidden)), ("attn.out.bias", (hidden,)), ("norm1.weight", (hidden,)),
             ("norm1.bias", (hidden,)), ("mlp.fc1.weight", (mlp, hidden)), ("mlp.fc1.bias", (mlp,)),
             ("mlp.fc2.weight", (hidden, mlp)), ("mlp.fc2.bias", (hidden,)), ("norm2.weight", (hidden,)),
             ("norm2.bias", (hidden,))]
    per_block = sum(4 * a * (b[0] if b else 1) for _, (a, *b) in block)
    shapes = [("embed.weight", (hidden, hidden))]
    shapes += [(f"blocks.{i}.{name}", shape) for i in range(max(1, round((size - 4 * hidden * hidden) / per_block)))
               for name, shape in block]
    folder.mkdir(parents=True)
    return write_random_safetensors(folder / "model.safetensors", shapes)


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
    parser.add_argument("--size", help="Bench a synthetic single file of about this size (e.g. 1GB) instead of the "
                                           "SD 1.5 UNet.")
    parser.add_argument("--shard-size", help="dmap's --max-shard-size (default: 300MB with --size, else 500MB).")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # internal: build the checkpoint in a child
    parser.add_argument("--build-size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        if args.build_size:
            print(build_synthetic(Path(args.build), int(args.build_size)))
        else:
            print(build_checkpoint(Path(args.build)))
        return
    if args.size:
        sys.path.insert(0, str(REPO))
        from dm_cli.units import parse_size

        synthetic = parse_size(args.size)
    else:
        synthetic = 0
    shard_size = args.shard_size or ("300MB" if synthetic else "500MB")
    work = Path(tempfile.mkdtemp(prefix="dmap-bench-shard-", dir=args.workdir))
    try:
        started = time.perf_counter()
        unet = work / "unet"
        # Built in a child: Linux carries a parent's peak RSS into every child it forks, so the parent
        # must stay small for the per-process numbers below to mean anything.
        build = [PY, __file__, "--build", str(unet)] + (["--build-size", str(synthetic)] if synthetic else [])
        data_bytes = int(subprocess.run(build, check=True, capture_output=True, text=True).stdout)
        source = unet / ("model.safetensors" if synthetic else "diffusion_pytorch_model.safetensors")
        size = source.stat().st_size
        target = str(source) if synthetic else str(unet)  # what dmap shards: the file itself, or the UNet folder
        print(f"built {source} ({size / 1e9:.2f} GB, {data_bytes / 1e9:.2f} GB of tensors) "
              f"in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        methods = [
            ("cp", "cp", ["cp", str(source), str(work / "copy.safetensors")], work / "copy.safetensors"),
            ("cp-sync", "cp + sync (fsync the copy)",
             ["sh", "-c", f"cp '{source}' '{work}/copy.safetensors' && sync '{work}/copy.safetensors'"],
             work / "copy.safetensors"),
            ("dmap", f"dmap shard -s {shard_size} (verified, the default)",
             [PY, "-m", "dm_cli", "shard", target, "-s", shard_size, "-o", str(work / "dmap"), "--quiet"], work / "dmap"),
            ("dmap-no-verify", f"dmap shard -s {shard_size} --no-verify",
             [PY, "-m", "dm_cli", "shard", target, "-s", shard_size, "-o", str(work / "dmap2"), "--quiet", "--no-verify"],
             work / "dmap2"),
            ("hub", "huggingface_hub save_torch_state_dict",
             [PY, "-c", HUB.replace('"500MB"', repr(shard_size)), str(source), str(work / "hub")], work / "hub"),
            ("diffusers", "diffusers save_pretrained", [PY, "-c", DIFFUSERS, str(unet), str(work / "diffusers")],
             work / "diffusers"),
        ]
        if args.only or synthetic:
            keep = set(args.only.split(",")) if args.only else {"cp", "cp-sync", "dmap", "dmap-no-verify"}
            if synthetic and "diffusers" in keep:
                raise SystemExit("--size: the synthetic checkpoint is no diffusers model; leave out 'diffusers'.")
            methods = [m for m in methods if m[0] in keep]
        runs = measure_rounds(methods, args.repeat)
        ratio = {r["key"]: r["wall"] for r in runs}
        what = "synthetic transformer-like checkpoint" if synthetic else "random SD 1.5 UNet"
        print(f"\nSource: {what}, fp32, one file of {size / 1e9:.2f} GB, into {shard_size} shards; {os.cpu_count()} "
              f"CPUs; outputs on the same file system; median of {args.repeat} interleaved rounds (best in brackets).\n")
        baseline = measure_once("baseline: python -c pass", [PY, "-c", "pass"], None)["rss"]
        print(f"(peak RSS of a bare child of this script: {baseline / 1e6:.0f} MB)\n")
        print("| method | wall time | throughput | vs cp | vs cp + sync | peak RSS |")
        print("|---|---:|---:|---:|---:|---:|")
        for run in runs:
            vs = [f"{ratio[k] / run['wall']:.2f}x" if k in ratio else "-" for k in ("cp", "cp-sync")]
            print(f"| {run['name']} | {run['wall']:.2f} s ({run['best']:.2f}) | {size / run['wall'] / 1e9:.2f} GB/s | "
                  f"{vs[0]} | {vs[1]} | {run['rss'] / 1e6:,.0f} MB |")
        if "cp-sync" in ratio and "dmap" in ratio:
            dmap = next(run for run in runs if run["key"] == "dmap")
            print(f"\ndmap shard (verified) vs cp + sync, same run: {ratio['cp-sync']:.2f} s / {ratio['dmap']:.2f} s = "
                  f"{ratio['cp-sync'] / ratio['dmap']:.2f}x (target >= 0.8x); dmap peak RSS {dmap['rss'] / 1e6:,.0f} MB "
                  "(target < 300 MB)")
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A header with a million tensors: dmap's strict reader, `inspect` and `shard` beside safetensors' own.

    .venv/bin/python scripts/bench_headers.py [--tensors 1000000] [--repeats 1]

Writes one safetensors file with N one-element F32 tensors (a ~96 MB header, safetensors' limit
is 100 MB), then runs each row in its own subprocess and reports wall time and peak RSS:
safetensors `safe_open` + `keys()` (the ecosystem's reader, Rust), dmap's header reader (the same
checks, in Python), `dmap inspect --json`, and `dmap shard -s 20MB` (verified). Ratios are against
safe_open. Interleaved rounds, medians.
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
PEAK = "import resource, sys; print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"

ROWS = {
    "safetensors safe_open + keys()": "from safetensors import safe_open\n"
                                      "with safe_open(sys.argv[1], 'np') as f: n = len(list(f.keys()))\n",
    "dmap header reader (same checks)": "from dm_cli.io.checkpoint import read_safetensors_header\n"
                                        "n = len(read_safetensors_header(sys.argv[1]).tensors)\n",
    "dmap inspect --json": "from dm_cli.cli import main\n"
                           "try:\n    main(['inspect', sys.argv[1], '--json', '--no-cache'])\nexcept SystemExit as done:\n    if done.code:\n        raise\n",
    "dmap shard -s 20MB (verified)": "import shutil\nfrom dm_cli.cli import main\nshutil.rmtree(sys.argv[2], ignore_errors=True)\n"
                                     "try:\n    main(['shard', sys.argv[1], '-s', '20MB', '-o', sys.argv[2], '--json'])\n"
                                     "except SystemExit as done:\n    if done.code:\n        raise\n",
}


def write_file(path: Path, count: int) -> None:
    parts, offset = [], 0
    for i in range(count):
        parts.append(f'"model.layers.{i // 10}.block.{i % 10}.weight":'
                     f'{{"dtype":"F32","shape":[1],"data_offsets":[{offset},{offset + 4}]}}')
        offset += 4
    header = ("{" + ",".join(parts) + "}").encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        handle.write(bytes(offset))


def run_row(code: str, path: Path, out: Path) -> tuple[float, int]:
    script = "import sys\n" + code + PEAK
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, str(path), str(out)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "DMAP_CACHE_DIR": str(out.parent / "cache")})
    wall = time.perf_counter() - started
    peak = [line for line in proc.stderr.splitlines() if line.startswith("PEAK")]
    if proc.returncode != 0 or not peak:
        raise SystemExit(f"row failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, int(peak[-1].split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="dmap-bench-headers-"))
    try:
        path = folder / "model.safetensors"
        write_file(path, args.tensors)
        header_mb = struct.unpack("<Q", path.read_bytes()[:8])[0] / 1e6
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        peaks: dict[str, list[int]] = {row: [] for row in ROWS}
        for _ in range(args.repeats):
            for row, code in ROWS.items():
                wall, peak = run_row(code, path, folder / "out")
                times[row].append(wall)
                peaks[row].append(peak)
        base_time = statistics.median(times["safetensors safe_open + keys()"])
        base_peak = statistics.median(peaks["safetensors safe_open + keys()"])
        print(f"{args.tensors:,} tensors, header {header_mb:.1f} MB, {args.repeats} round(s), "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print("| reader | wall s (median) | vs safe_open | peak RSS | vs safe_open |")
        print("|---|---:|---:|---:|---:|")
        for row in ROWS:
            wall, peak = statistics.median(times[row]), statistics.median(peaks[row])
            print(f"| {row} | {wall:.1f} | {wall / base_time:.2f}x | {peak / 1e6:,.0f} MB | {peak / base_peak:.2f}x |")
        print(json.dumps({"tensors": args.tensors, "times": times, "peaks": peaks}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

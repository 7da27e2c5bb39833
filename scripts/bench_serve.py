#!/usr/bin/env python
"""Requests per minute: `dmap serve` with 16 concurrent clients, against 16 `dmap run` processes at a time (one per
request, as a naive server would spawn them) and against one `dmap run --prompts` (the queue), side by side.

Every method makes the same R images (the random-weight demo pipeline, SIZE x SIZE, STEPS steps, staged plan,
seeds 0 .. R-1). The serve row's clock starts when the server has answered one first request (its start-up: import,
plan, first load and first batch, printed beside it: a server pays it once); the other rows include their start-up, which is their cost per request or
per queue. Loopback only; no GPU needed (add --max-memory / -d to serve a real plan).

    .venv/bin/python scripts/bench_serve.py --requests 16 --clients 16 --size 64 --steps 2
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]


def _dmap(*args) -> list[str]:
    return [sys.executable, "-m", "dm_cli", *map(str, args)]


def _common(size: int, steps: int) -> list[str]:
    return ["--height", size, "--width", size, "--steps", steps, "--mode", "staged"]


def bench_serve(prompts: list[str], clients: int, size: int, steps: int, extra: list[str]) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(_dmap("serve", *_common(size, steps), "--port", 0, "--max-batch", clients,
                                  "--queue-size", max(64, len(prompts)), "--quiet", *extra),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"dmap serve did not start: {line}{proc.stderr.read()}")
    url = urlsplit(line.split(" on ", 1)[1].split(";", 1)[0])
    # the first request pays the first load and the libraries' first calls, once per server: start-up, not throughput
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
    connection.request("POST", "/v1/images/generations", json.dumps({"prompt": "warm", "seed": 0}),
                       {"Content-Type": "application/json"})
    if connection.getresponse().status != 200:
        raise SystemExit("dmap serve did not answer its first request")
    connection.close()
    startup = time.perf_counter() - started
    todo = list(enumerate(prompts))
    lock, failures, latencies = threading.Lock(), [], []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                seed, prompt = todo.pop(0)
            sent = time.perf_counter()
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
            connection.request("POST", "/v1/images/generations", json.dumps({"prompt": prompt, "seed": seed}),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            body = json.loads(response.read())
            connection.close()
            with lock:
                latencies.append(time.perf_counter() - sent)
                if response.status != 200 or not base64.b64decode(body["data"][0]["b64_json"]):
                    failures.append(body)

    begin = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begin
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    if failures:
        raise SystemExit(f"dmap serve answered {len(failures)} request(s) with an error: {failures[0]}")
    latencies.sort()
    return {"method": f"dmap serve, {clients} clients", "wall_s": wall, "startup_s": startup,
            "p50_s": latencies[len(latencies) // 2], "max_s": latencies[-1]}


def bench_processes(prompts: list[str], at_once: int, size: int, steps: int, extra: list[str], folder: Path) -> dict:
    begin = time.perf_counter()
    latencies = []
    for start in range(0, len(prompts), at_once):
        wave = []
        for seed in range(start, min(start + at_once, len(prompts))):
            wave.append((time.perf_counter(), subprocess.Popen(
                _dmap("run", "-p", prompts[seed], "--seed", seed, *_common(size, steps), "-o", folder / f"{seed}.png",
                      "--quiet", "--overwrite", *extra), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for sent, proc in wave:
            if proc.wait() != 0:
                raise SystemExit(f"dmap run failed: {proc.stderr.read().decode()}")
            latencies.append(time.perf_counter() - sent)
    latencies.sort()
    return {"method": f"{at_once} dmap run processes", "wall_s": time.perf_counter() - begin, "startup_s": None,
            "p50_s": latencies[len(latencies) // 2], "max_s": latencies[-1]}


def bench_queue(prompts: list[str], size: int, steps: int, extra: list[str], folder: Path) -> dict:
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    begin = time.perf_counter()
    done = subprocess.run(_dmap("run", "--prompts", path, "--seed", 0, *_common(size, steps), "-o", folder / "queue",
                                "--quiet", "--no-resume", *extra), cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"dmap run --prompts failed: {done.stderr}")
    wall = time.perf_counter() - begin
    return {"method": "one dmap run --prompts", "wall_s": wall, "startup_s": None, "p50_s": None, "max_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="images each method makes")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, and dmap run processes at once")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args, extra = parser.parse_known_args()  # the rest goes to every dmap command (e.g. SOURCE-less plan options)
    prompts = [f"prompt number {i}: a red fox in the snow" for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        folder = Path(tmp)
        # warm the caches (the demo's weights, skeletons, traces) so that no method pays for them
        warm = subprocess.run(_dmap("run", "-p", "warm", *_common(args.size, args.steps), "-o", folder / "warm.png",
                                    "--quiet", *extra), cwd=REPO, capture_output=True, text=True)
        if warm.returncode != 0:
            raise SystemExit(f"dmap run failed: {warm.stderr}")
        rows = [bench_serve(prompts, args.clients, args.size, args.steps, extra),
                bench_processes(prompts, args.clients, args.size, args.steps, extra, folder),
                bench_queue(prompts, args.size, args.steps, extra, folder)]
    for row in rows:
        row["requests_per_min"] = args.requests / row["wall_s"] * 60
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.requests} images, demo pipeline {args.size}x{args.size}, {args.steps} steps, staged, "
          f"{os.cpu_count()} CPU(s)")
    print("| method | wall s | requests/min | p50 latency s | max latency s | start-up s (not in wall) |")
    print("|---|---:|---:|---:|---:|---:|")
    shown = lambda value: "–" if value is None else f"{value:.1f}"  # noqa: E731
    for row in rows:
        print(f"| {row['method']} | {row['wall_s']:.1f} | {row['requests_per_min']:.1f} | {shown(row['p50_s'])} | "
              f"{shown(row['max_s'])} | {shown(row['startup_s'])} |")


if __name__ == "__main__":
    main()

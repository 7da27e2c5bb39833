#!/usr/bin/env python
"""Requests per minute: `dmap serve` with 16 concurrent clients, against 16 `dmap run` processes at a time (one per
request, as a naive server would spawn them) and against one `dmap run --prompts` (the queue), side by side.

Every method makes the same R images (the random-weight demo pipeline, SIZE x SIZE, STEPS steps, staged plan,
seeds 0 .. R-1). The serve row's clock starts when the server has answered one first request (its start-up: import,
plan, first load and first batch, printed beside it: a server pays it once); the other rows include their start-up, which is their cost per request or
per queue. Loopback only; no GPU needed (add --max-memory / -d to serve a real plan).

    .venv/bin/python scripts/bench_serve.py --requests 16 --clients 16 --size 64 --steps 2

`--batching` measures instead whether a batch pays on this machine's device: seconds per image when K images run
as one chunk of `Session.generate` (K = 1, 2, 4, 8: the device's own answer), and `dmap serve --max-batch 8` given
the same N requests concurrently and one after another (what the server's measured batch limit makes of it).

    .venv/bin/python scripts/bench_serve.py --batching --requests 4 --size 64 --steps 2
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
    line += proc.stdout.readline() if line.startswith("Serving") else ""  # the URL: the line after, alone
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"dmap serve did not start: {line}{proc.stderr.read()}")
    url = urlsplit(line[line.index("http://"):].split()[0])
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


def bench_batch_sizes(size: int, steps: int, sizes=(1, 2, 4, 8), repeats: int = 3) -> list[dict]:
    """Seconds per image by batch size: K prompts run as one chunk of Session.generate (stage-major), after one
    warm-up image, the least of `repeats` tries; in a child process (the demo pipeline)."""
    code = f"""
import json, sys, time
from dm_cli.run.request import RunRequest
from dm_cli.run.sessions.session import Session
run = RunRequest.of(None, "", height={size}, width={size}, steps={steps}, mode="staged", output=None,
                    per_prompt_images=True)
with Session(run) as session:
    list(session.generate("warm-up", seed=0, chunk_size=1))
    best = {{}}
    for _ in range({repeats}):  # sizes interleaved, the least of each: other work on the machine is noise
        for k in {tuple(sizes)!r}:
            begin = time.perf_counter()
            list(session.generate([f"prompt {{i}}" for i in range(k)], seed=1, chunk_size=k))
            best[k] = min(best.get(k, float("inf")), (time.perf_counter() - begin) / k)
    rows = [{{"batch": k, "s_per_image": best[k]}} for k in {tuple(sizes)!r}]
print(json.dumps(rows))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the batch-size measure failed: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_concurrent_vs_sequential(requests: int, size: int, steps: int, extra: list[str]) -> dict:
    """`dmap serve --max-batch 8`: the same requests sent all at once, then one after another (seconds each); the
    batch limit and per-step seconds by batch size the server measured."""
    proc = subprocess.Popen(_dmap("serve", *_common(size, steps), "--port", 0, "--max-batch", 8, "--quiet", *extra),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    line += proc.stdout.readline() if line.startswith("Serving") else ""  # the URL: the line after, alone
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"dmap serve did not start: {line}{proc.stderr.read()}")
    url = urlsplit(line[line.index("http://"):].split()[0])

    def post(seed: int) -> None:
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
        connection.request("POST", "/v1/images/generations", json.dumps({"prompt": f"p {seed}", "seed": seed}),
                           {"Content-Type": "application/json"})
        if connection.getresponse().status != 200:
            raise SystemExit("dmap serve answered an error")
        connection.close()

    def get(path: str) -> str:
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        connection.request("GET", path)
        text = connection.getresponse().read().decode()
        connection.close()
        return text

    try:
        begin = time.perf_counter()
        threads = [threading.Thread(target=post, args=(seed,)) for seed in range(requests)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        concurrent = time.perf_counter() - begin
        begin = time.perf_counter()
        for seed in range(requests):
            post(seed)
        sequential = time.perf_counter() - begin
        metrics = get("/metrics").splitlines()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    limit = next((line.split()[-1] for line in metrics if line.startswith("dmap_batch_limit ")), None)  # older dmap
    measured = {line.split('"')[1]: float(line.split()[-1]) for line in metrics
                if line.startswith("dmap_batch_step_seconds{")}
    return {"concurrent_s": concurrent, "sequential_s": sequential, "ratio": concurrent / sequential,
            "batch_limit": limit and int(limit), "step_s_by_batch": measured}


def main_batching(args, extra: list[str]) -> None:
    if extra:
        raise SystemExit("--batching measures the demo pipeline: give no plan options")
    sizes = bench_batch_sizes(args.size, args.steps)
    served = bench_concurrent_vs_sequential(args.requests, args.size, args.steps, extra)
    if args.json:
        print(json.dumps({"batch_sizes": sizes, "serve": served}, indent=1))
        return
    print(f"demo pipeline {args.size}x{args.size}, {args.steps} steps, staged, {os.cpu_count()} CPU(s)")
    print("| batch | s per image | vs batch 1 |")
    print("|---:|---:|---:|")
    for row in sizes:
        print(f"| {row['batch']} | {row['s_per_image']:.3f} | {row['s_per_image'] / sizes[0]['s_per_image']:.2f}x |")
    print(f"dmap serve --max-batch 8, {args.requests} requests: concurrent {served['concurrent_s']:.1f} s, one after "
          f"another {served['sequential_s']:.1f} s ({served['ratio']:.2f}x); batch limit {served['batch_limit']}, "
          f"measured s per image-step by batch {served['step_s_by_batch']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="images each method makes")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, and dmap run processes at once")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--batching", action="store_true", help="whether a batch pays here (see above)")
    args, extra = parser.parse_known_args()  # the rest goes to every dmap command (e.g. SOURCE-less plan options)
    if args.batching:
        main_batching(args, extra)
        return
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

"""gpu_check's `fast` section (issue 55): dmap's two fast paths against diffusers' own, on the FLUX.1 [dev]-shaped
folder of the `flux` section (random bf16 weights), the same size, steps and seed:

- **compile**: `dmap run --compile regional` against diffusers' `transformer.compile_repeated_blocks(fullgraph=True)`:
  the cold call's seconds and the warm step, dmap eager beside them, pixels against dmap eager.
- **overlapped offload**: dmap planned for `0=<--offload-budget>,cpu=64GB` (the transformer does not fit: the plan
  streams blocks from the cpu, overlapped where it predicts that faster; the plan's choice printed) against
  diffusers' `transformer.enable_group_offload(..., offload_type="block_level", num_blocks_per_group=1,
  use_stream=True)`: warm seconds per step, pixels against dmap's resident run.

Returns True (a failure) when the offloaded run's pixels differ from the resident run's (the same computation, only
the copies' timing differs); the memory section compares measured and planned peaks.

On a CPU (`--device cpu --small`, float32) compile runs dynamo with the eager backend on both sides (inductor's C++
build takes minutes) and nothing overlaps (a CPU run streams nothing): the section checks itself, not the speed.

    python3 scripts/gpu_check_fast.py SPEC     # diffusers' side, a fresh process (what fast_check calls)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_predict import PROMPT, REPO


def fast_check(args, work: Path, env: dict, torch, flux_folder) -> bool:
    gpu = args.device.startswith("cuda")
    size, steps = (64, 3) if args.small else (args.flux_size, min(args.flux_steps, 8))
    dtype = "bfloat16" if gpu else "float32"  # a CPU's bf16 matmuls: about 10x slower
    folder = flux_folder(args, work, torch)
    index = args.device.partition(":")[2] or "0"
    resident = f"{index}=70GB" if gpu else "cpu=64GB"
    offloaded = f"{index}={args.offload_budget},cpu=64GB" if gpu else "cpu=64GB"
    if not gpu:
        os.environ.setdefault("DMAP_COMPILE_BACKEND", "eager")
    sync = (lambda: torch.cuda.synchronize(torch.device(args.device))) if gpu else (lambda: None)
    rows, images, choice = [], {}, {}
    for label, memory, mode, compile_mode in (("eager", resident, "resident", "none"),
                                              ("compiled", resident, "resident", "regional"),
                                              ("offloaded", offloaded, "auto", "none")):
        step_s, cold_s, choice[label] = dmap_measure(str(folder), memory, mode, compile_mode, size, steps, dtype,
                                                     sync, work / f"fast-dmap-{label}.png")
        rows.append((f"dmap {label}", step_s, cold_s))
        images[label] = work / f"fast-dmap-{label}.png"
        if gpu:
            torch.cuda.empty_cache()
    for side in ("compile", "group_offload"):
        spec = {"folder": str(folder), "device": args.device, "size": size, "steps": steps, "dtype": dtype,
                "side": side, "output": str(work / f"fast-diffusers-{side}.png")}
        proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True, env=env,
                              cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"diffusers' {side} call failed: {proc.stderr.strip()[-800:]}")
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((f"diffusers {side}", theirs["step_s"], theirs["cold_s"]))
        images[f"diffusers {side}"] = Path(spec["output"])
    return _report(args, size, steps, dtype, rows, images, choice)


def dmap_measure(source: str, memory: str, mode: str, compile_mode: str, size: int, steps: int, dtype: str, sync,
                 output: Path) -> tuple[float, float, dict]:
    """dmap's API on the folder: the cold call timed whole, then the warm call per step (median, each step waiting
    for the device); (warm s/step, cold call s, the plan's offload of the transformer)."""
    from dm_cli.api import load

    session = load(source, max_memory=memory, mode=mode, dtype=dtype, height=size, width=size, compile=compile_mode)
    started = time.perf_counter()
    list(session.generate([PROMPT.format(0)], steps=steps, seed=0))
    sync()
    cold_s = time.perf_counter() - started
    marks: list[float] = []

    def on_step(*_):
        sync()
        marks.append(time.perf_counter())

    done = list(session.generate([PROMPT.format(0)], steps=steps, seed=0, on_step=on_step))
    done[0].image.save(output)
    offload = dict(session.plan.components["transformer"].offload or {})
    del session
    steps_s = [b - a for a, b in zip(marks, marks[1:])]
    return (statistics.median(steps_s) if steps_s else 0.0), cold_s, offload


def _report(args, size, steps, dtype, rows, images, choice) -> bool:
    import numpy as np
    from PIL import Image

    def diff(a: str, b: str) -> int:
        return int(np.abs(np.asarray(Image.open(images[a]), dtype=np.int16)
                          - np.asarray(Image.open(images[b]), dtype=np.int16)).max())

    print(f"fast paths: FLUX.1 [dev]-shaped, {size}x{size}, {steps} steps, {dtype}, on {args.device}\n"
          "| run | warm s/step | first call s (compile included) |\n|---|---:|---:|")
    for name, step_s, cold_s in rows:
        print(f"| {name} | {step_s:.4f} | {cold_s:.2f} |")
    steps_by = {name: step_s for name, step_s, _ in rows}
    print(f"dmap compiled / diffusers compile_repeated_blocks: "
          f"{steps_by['dmap compiled'] / steps_by['diffusers compile']:.3f}x; dmap offloaded / diffusers group "
          f"offload with streams: {steps_by['dmap offloaded'] / steps_by['diffusers group_offload']:.3f}x; "
          f"the plan's transformer offload: {json.dumps(choice.get('offloaded'))}")
    print(f"largest pixel difference: compiled against eager {diff('compiled', 'eager')}, offloaded against eager "
          f"{diff('offloaded', 'eager')}, diffusers' compiled against dmap compiled "
          f"{diff('diffusers compile', 'compiled')}", flush=True)
    return diff("offloaded", "eager") != 0


def diffusers_fast(spec: dict) -> dict:
    """diffusers' own fast path on the folder: `compile` (compile_repeated_blocks) or `group_offload` (block-level
    group offloading of the transformer on a second stream); the cold call timed whole, the warm call per step."""
    import diffusers
    import torch

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    if spec["side"] == "compile":
        pipe = diffusers.FluxPipeline.from_pretrained(spec["folder"], torch_dtype=dtype).to(device)
        pipe.transformer.compile_repeated_blocks(fullgraph=True, **({} if gpu else {"backend": "eager"}))
    else:
        pipe = diffusers.FluxPipeline.from_pretrained(spec["folder"], torch_dtype=dtype)
        for name in ("text_encoder", "text_encoder_2", "vae"):
            getattr(pipe, name).to(device)
        pipe.transformer.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                              offload_type="block_level", num_blocks_per_group=1, use_stream=gpu)
    pipe.set_progress_bar_config(disable=True)
    marks: list[float] = []

    def on_step(_pipe, _step, _timestep, kwargs):
        sync()
        marks.append(time.perf_counter())
        return kwargs

    def call(callback=None):
        return pipe(PROMPT.format(0), height=spec["size"], width=spec["size"], num_inference_steps=spec["steps"],
                    generator=torch.Generator().manual_seed(0), callback_on_step_end=callback).images[0]

    started = time.perf_counter()
    call()
    sync()
    cold_s = time.perf_counter() - started
    image = call(on_step)
    image.save(spec["output"])
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return {"step_s": statistics.median(steps) if steps else 0.0, "cold_s": cold_s}


if __name__ == "__main__":
    print(json.dumps(diffusers_fast(json.loads(sys.argv[1]))))

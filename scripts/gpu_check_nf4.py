"""gpu_check's `nf4` section (issue 54): the FLUX.1 [dev]-shaped folder of the `flux` section (random bf16 weights)
with its transformer in 4-bit NF4, `dmap run --weights transformer=nf4` against diffusers' own call with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16)` on the same
folder, size, steps and seed: seconds per step (NF4 and dmap's bf16 run beside it), measured against planned peaks
per stage, and the largest pixel difference (0 expected: both quantize each weight with `Params4bit.to(device)` and
run bitsandbytes' kernels). True (a failure) when a measured GPU peak exceeds the planned one or the pixels differ.

On a CPU (`--device cpu --small`, float32 compute: a CPU's bf16 is about 10x slower) diffusers' quantizer refuses
without a GPU: its check is bypassed there, as in tests/model/test_nf4.py. On a lent machine carry the bitsandbytes wheel too:
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl bitsandbytes==0.50.2

    python3 scripts/gpu_check_nf4.py SPEC     # diffusers' side, a fresh process (what nf4_check calls)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_predict import PROMPT, REPO


def nf4_check(args, work: Path, env: dict, torch, flux_folder) -> bool:
    import numpy as np
    from PIL import Image

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    size, steps = (64, 3) if args.small else (args.flux_size, min(args.flux_steps, 8))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"  # a CPU's bf16 matmuls: about 10x slower
    plain = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    folder = flux_folder(args, work, torch)
    memory = "cpu=64GB" if args.device == "cpu" else f"{args.device.partition(':')[2] or 0}=70GB"
    rows, per_step, worst = [], {}, 0.0
    for weights in ("transformer=nf4", None):
        output = work / f"nf4-dmap-{weights or plain}.png"
        result = run(RunRequest.of(source=str(folder), prompt=PROMPT.format(0), seed=0, steps=steps, height=size,
                                   width=size, dtype=dtype, weights=weights, max_memory=memory, mode="staged",
                                   output=str(output), overwrite=True))
        denoise = next(s for s in result.stages if s.name == "denoise")
        per_step[weights or plain] = denoise.run_s / steps
        for stage in result.stages:
            for dev in sorted(set(stage.measured_peak) | set(stage.planned_peak)):
                m, p = stage.measured_peak.get(dev, 0), stage.planned_peak.get(dev, 0)
                if dev.isdigit() and p:
                    worst = max(worst, m / p)
                rows.append(f"| {weights or plain} | {stage.name} | {dev} | {m / 1e9:.3f} GB | {p / 1e9:.3f} GB |")
    spec = {"folder": str(folder), "device": args.device, "size": size, "steps": steps, "dtype": dtype,
            "output": str(work / "nf4-diffusers.png")}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"diffusers' NF4 call failed: {proc.stderr.strip()[-800:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    difference = int(np.abs(np.asarray(Image.open(work / "nf4-dmap-transformer=nf4.png"), dtype=np.int16)
                            - np.asarray(Image.open(spec["output"]), dtype=np.int16)).max())
    print(f"NF4: FLUX.1 [dev]-shaped transformer in NF4, {size}x{size}, {steps} steps, {dtype} compute, on {args.device}\n"
          "| weights | stage | device | measured peak | planned peak_bytes |\n|---|---|---|---:|---:|")
    print("\n".join(rows))
    print(f"s/step: dmap NF4 {per_step['transformer=nf4']:.4f}, dmap {plain} {per_step[plain]:.4f} "
          f"(NF4/{plain} {per_step['transformer=nf4'] / per_step[plain]:.2f}x), diffusers NF4 {theirs['step_s']:.4f}; "
          f"largest measured/planned GPU peak {worst:.2f}; largest pixel difference against diffusers {difference}",
          flush=True)
    return worst > 1.0 or difference != 0


def diffusers_nf4(spec: dict) -> dict:
    """diffusers' own NF4 loading of the folder's transformer, the rest in bf16, one call timed per step."""
    import diffusers
    import torch

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    if device.type == "cpu":  # diffusers' quantizer asks for a GPU; bitsandbytes' CPU backend runs it
        from diffusers.quantizers.bitsandbytes.bnb_quantizer import BnB4BitDiffusersQuantizer

        BnB4BitDiffusersQuantizer.validate_environment = lambda self, *a, **k: None
    config = diffusers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=dtype)
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(
        Path(spec["folder"]) / "transformer", quantization_config=config, torch_dtype=dtype,
        device_map={"": device.index if device.type == "cuda" else "cpu"})
    pipe = diffusers.FluxPipeline.from_pretrained(spec["folder"], transformer=None, torch_dtype=dtype).to(device)
    pipe.transformer = transformer
    pipe.set_progress_bar_config(disable=True)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    marks: list[float] = []

    def on_step(_pipe, _step, _timestep, kwargs):
        sync()
        marks.append(time.perf_counter())
        return kwargs

    image = pipe(PROMPT.format(0), height=spec["size"], width=spec["size"], num_inference_steps=spec["steps"],
                 generator=torch.Generator().manual_seed(0), callback_on_step_end=on_step).images[0]
    image.save(spec["output"])
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return {"step_s": statistics.median(steps) if steps else 0.0}


if __name__ == "__main__":
    print(json.dumps(diffusers_nf4(json.loads(sys.argv[1]))))

"""4-bit NF4 (`--weights nf4`, issue 54) against bf16 and fp8: bytes, and seconds on this CPU, side by side.

Three tables, each with the ratio to bf16:

1. bytes of the full-size presets' denoiser and largest text encoder, as `dmap inspect --weights` counts them (the
   bytes bitsandbytes, layerwise casting and the run dtype hold; configs only, nothing is downloaded);
2. one FLUX.1-sized linear layer (3072 -> 12288, the double blocks' feed-forward) on this CPU: its forward for
   `--tokens` tokens in bf16, fp8 (diffusers' layerwise casting: upcast, then matmul) and NF4 (bitsandbytes'
   Linear4bit: dequantize, then matmul), the median of `--repeat` timed calls;
3. `dmap run` of a mid-size FLUX-architecture random-weight pipeline (tiny-flux's configs with a wider, deeper
   transformer) with the transformer in bf16, fp8 and nf4: planned transformer bytes, the denoise stage's seconds
   (the median of `--repeat` interleaved runs) and the image's largest pixel difference from the bf16 one (random
   weights: what 4 bits change, not what quality a trained model keeps).

    .venv/bin/python scripts/bench_nf4.py [--size 128] [--steps 4] [--repeat 3] [--tokens 1024]
    .venv/bin/python scripts/bench_nf4.py --small     # seconds, for the script's test
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FORMATS = ("none", "fp8", "nf4")  # --weights values; none: the run dtype (bf16)
PRESETS = (("flux", "transformer"), ("flux", "text_encoder_2"), ("qwen-image", "transformer"),
           ("qwen-image", "text_encoder"), ("wan2.2", "transformer"))
TWIN = {"num_layers": 2, "num_single_layers": 4, "attention_head_dim": 64, "num_attention_heads": 8,
        "axes_dims_rope": [16, 24, 24]}
PROMPT = "a lighthouse on a cliff at dusk"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def preset_bytes(presets=PRESETS) -> list[dict]:
    from dm_cli.model.inspection import inspect_source

    rows = []
    for preset, name in presets:
        sizes = {fmt: inspect_source(preset, dtype="bfloat16", component=name, weights=f"{name}={fmt}").components[0].bytes
                 for fmt in FORMATS}
        rows.append({"what": f"{preset} {name}", **sizes})
    return rows


def layer_seconds(tokens: int, repeat: int, features=(3072, 12288)) -> dict:
    import bitsandbytes as bnb
    import torch
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    plain = torch.nn.Linear(*features).to(torch.bfloat16)
    fp8 = torch.nn.Linear(*features).to(torch.bfloat16)
    fp8.load_state_dict(plain.state_dict())
    apply_layerwise_casting(fp8, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    nf4 = bnb.nn.Linear4bit(*features, compute_dtype=torch.bfloat16, quant_type="nf4")
    nf4.load_state_dict(plain.state_dict())
    nf4 = nf4.to("cpu")
    x = torch.randn(tokens, features[0], dtype=torch.bfloat16)
    out = {}
    with torch.no_grad():
        for fmt, layer in (("none", plain), ("fp8", fp8), ("nf4", nf4)):
            layer(x)  # warm-up
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - start)
            out[fmt] = statistics.median(times)
    return out


def build_twin(root: Path, widen: bool = True) -> Path:
    from dm_cli.model.demo import write_random_pipeline

    if not widen:  # --small: tiny-flux as it is
        return write_random_pipeline(REPO / "dm_cli" / "presets" / "tiny-flux", root / "flux-twin", seed=0)
    configs = root / "configs"
    shutil.copytree(REPO / "dm_cli" / "presets" / "tiny-flux", configs)
    path = configs / "transformer" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **{k: v for k, v in TWIN.items() if k in config}}, indent=2))
    return write_random_pipeline(configs, root / "flux-twin", seed=0)


def run_twin(folder: Path, out: Path, fmt: str, size: int, steps: int):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    request = RunRequest.of(str(folder), PROMPT, seed=1, steps=steps, height=size, width=size, max_memory="cpu=80GB",
                            dtype="bfloat16", weights=f"transformer={fmt}", overwrite=True, output=str(out))
    result = run(request)
    denoise = next(s for s in result.stages if s.name == "denoise")
    return result.plan.to_json()["components"]["transformer"]["weights_bytes"], denoise.run_s


def pipeline_rows(size: int, steps: int, repeat: int, widen: bool = True) -> list[dict]:
    import numpy as np
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = build_twin(root, widen)
        seconds = {fmt: [] for fmt in FORMATS}
        planned = {}
        for round_ in range(repeat):
            order = FORMATS[round_ % 3:] + FORMATS[:round_ % 3]  # the order turned each round
            for fmt in order:
                planned[fmt], took = run_twin(folder, root / f"{fmt}.png", fmt, size, steps)
                seconds[fmt].append(took)
        pixels = {fmt: np.asarray(Image.open(root / f"{fmt}.png").convert("RGB")).astype(int) for fmt in FORMATS}
    return [{"format": fmt, "bytes": planned[fmt], "seconds": statistics.median(seconds[fmt]),
             "max_diff": int(np.abs(pixels[fmt] - pixels["none"]).max())} for fmt in FORMATS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--small", action="store_true", help="a quick pass (the script's test)")
    args = parser.parse_args(argv)
    if args.small:
        args.size, args.steps, args.repeat, args.tokens = 32, 1, 1, 16
    from dm_cli.model.formats.weight_formats import quiet_torchao
    from dm_cli.units import format_size

    quiet_torchao()  # diffusers imports torchao, whose CPU build logs the kernels it cannot load

    print("1. full-size bytes (dmap inspect --weights)")
    print(f"{'component':<28}{'bf16':>12}{'fp8':>12}{'nf4':>12}{'fp8/bf16':>10}{'nf4/bf16':>10}")
    for row in preset_bytes(PRESETS[:1] if args.small else PRESETS):
        print(f"{row['what']:<28}{format_size(row['none']):>12}{format_size(row['fp8']):>12}{format_size(row['nf4']):>12}"
              f"{ratio(row['fp8'], row['none']):>10}{ratio(row['nf4'], row['none']):>10}")
    layer = layer_seconds(args.tokens, args.repeat)
    print(f"\n2. one 3072->12288 linear layer, {args.tokens} tokens, this CPU (median of {args.repeat})")
    print(f"{'format':<8}{'seconds':>10}{'/bf16':>8}")
    for fmt in FORMATS:
        print(f"{fmt if fmt != 'none' else 'bf16':<8}{layer[fmt]:>10.4f}{ratio(layer[fmt], layer['none']):>8}")
    print(f"\n3. dmap run, FLUX-architecture twin, {args.size}x{args.size}, {args.steps} steps (median of {args.repeat})")
    print(f"{'format':<8}{'transformer':>13}{'/bf16':>8}{'denoise s':>11}{'/bf16':>8}{'max px diff':>13}")
    rows = pipeline_rows(args.size, args.steps, args.repeat, widen=not args.small)
    base = rows[0]
    for row in rows:
        print(f"{row['format'] if row['format'] != 'none' else 'bf16':<8}{format_size(row['bytes']):>13}"
              f"{ratio(row['bytes'], base['bytes']):>8}{row['seconds']:>11.3f}{ratio(row['seconds'], base['seconds']):>8}"
              f"{row['max_diff']:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

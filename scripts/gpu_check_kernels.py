"""gpu_check's kernels section (issue 53): the kernel rules the plan's GPU time model rests on, each measured beside what
the model assumes for this GPU's table row, and the one family the public record leaves unexplained (SD3) timed whole.

What it measures, on the device, back-to-back in one stream between two synchronisations (as an eager step runs):
- **Elementwise kernels**: `torch.add` of two bf16 tensors at six sizes (3 MB to 800 MB moved); a line through the
  per-op seconds gives each kernel's fixed cost and the sustained bandwidth, against the model's 3 us a kernel and a
  STREAM triad's share of the datasheet's bandwidth (planning/time/gpu_rates.py, step_time.py `KERNEL_SECONDS`).
- **Dispatch**: a chain of 2,000 ops on 4 KB tensors, the per-op seconds the host (or the launch) allows, against
  the table profile's op_seconds and the kernel's 3 us.
- **Attention**: `scaled_dot_product_attention` at head dims 40, 64, 80 and 128 over 4,096 tokens (1,280 channels),
  in TFLOP/s of the call's own head dim and of the width flash's kernel computes (gpu_kernels.py `kernel_head_dim`),
  against FlashAttention-2's share of the peak the model takes.
- **Matmuls** at the shapes of FLUX.1's and SD3's blocks, against the table's curve at their FLOPs.
- **SD3 Medium's transformer** at full size (the bundled preset's config, random fp16 weights), one call at 1024x1024
  under CFG (batch 2, 333 text tokens), against the plan's predicted step on this GPU's table row: the record's SD3
  rows measured 1.6-1.8x the prediction, which FLUX's do not.

`--small` (the script's CPU form) runs every part at tiny sizes in float32 with the tiny SD3 twin, and predicts
nothing (no table row for a CPU). Prints Markdown tables; returns nothing (the record's bounds are judged there).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1e6


def kernels_check(args, torch, table: str | None) -> None:
    """Print each rule's measurement beside the model's figure for `table` (a GPU_TABLE row, or None)."""
    from dm_cli.planning.time.profiles import table_profile

    device = torch.device(args.device)
    dtype = torch.float32 if args.small else torch.bfloat16
    profile = table_profile(table) if table else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    elementwise(torch, device, dtype, profile, sync, args.small)
    dispatch(torch, device, dtype, profile, sync)
    attention(torch, device, dtype, profile, sync, args.small)
    matmuls(torch, device, dtype, profile, sync, args.small)
    sd3_transformer(args, torch, device, table, sync)


def _per_call(run, sync, repeats: int) -> float:
    """Seconds of one `run()`, `repeats` back-to-back after a warm-up, between two synchronisations."""
    run()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    sync()
    return (time.perf_counter() - started) / repeats


def elementwise(torch, device, dtype, profile, sync, small: bool) -> None:
    from dm_cli.planning.time.step_time import KERNEL_SECONDS

    sizes = (1e6, 4e6) if small else (1e6, 4e6, 16e6, 64e6, 128e6, 256e6)  # bytes of each input
    points = []
    print("| elementwise add, bytes moved | measured us/op | model us/op | measured/model |\n|---:|---:|---:|---:|")
    for nbytes in sizes:
        n = int(nbytes) // torch.tensor([], dtype=dtype).element_size()
        x, y = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
        out = torch.empty_like(x)
        moved = 3 * nbytes
        seconds = _per_call(lambda x=x, y=y, out=out: torch.add(x, y, out=out), sync, 50)
        points.append((moved, seconds))
        model = KERNEL_SECONDS + moved / (profile.elementwise_gbps * 1e9) if profile else None
        print(f"| {moved / MB:.0f} MB | {seconds * 1e6:.1f} | {_us(model)} | {_ratio(seconds, model)} |")
        del x, y, out
    slope, intercept = _line(points)
    model_gbps = f"{profile.elementwise_gbps:.0f}" if profile else "-"
    print(f"fit: {intercept * 1e6:.1f} us a kernel + bytes at {1 / slope / 1e9:.0f} GB/s "
          f"(model: {KERNEL_SECONDS * 1e6:.0f} us + bytes at {model_gbps} GB/s)\n", flush=True)


def dispatch(torch, device, dtype, profile, sync) -> None:
    x = torch.randn(1024, device=device, dtype=dtype)

    def chain(x=x):
        for _ in range(2000):
            x = x * 1.0001
        return x

    seconds = _per_call(chain, sync, 3) / 2000
    model = f"{profile.op_seconds * 1e6:.0f} us host, 3 us kernel" if profile else "-"
    print(f"dispatch: {seconds * 1e6:.1f} us an op over a chain of 2,000 small ops (model: {model})\n", flush=True)


def attention(torch, device, dtype, profile, sync, small: bool) -> None:
    from dm_cli.planning.time.gpu_rates import attention_tflops
    from dm_cli.planning.trace.gpu_kernels import COMPUTE_CAPABILITY, AttentionCall, kernel_head_dim

    tokens, channels = (256, 160) if small else (4096, 1280)
    model = attention_tflops(_peak(profile), COMPUTE_CAPABILITY.get(profile.name, (8, 0))) if profile else None
    print("| attention, head dim | TFLOP/s at its head dim | at the kernel's width | model TFLOP/s |\n"
          "|---:|---:|---:|---:|")
    for head_dim in (40, 64, 80, 128):
        heads = channels // head_dim
        q, k, v = (torch.randn(2, heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(3))
        seconds = _per_call(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v), sync, 10)
        width = kernel_head_dim(AttentionCall(2 * heads, tokens, tokens, head_dim, head_dim, "bfloat16"), "flash")
        own = 4 * 2 * heads * tokens * tokens * head_dim
        print(f"| {head_dim} | {own / seconds / 1e12:.3g} | {own * width / head_dim / seconds / 1e12:.3g} | "
              f"{f'{model:.0f}' if model else '-'} |")
    print(flush=True)


def matmuls(torch, device, dtype, profile, sync, small: bool) -> None:
    shapes = {"FLUX.1 qkv (4608x3072x3072)": (4608, 3072, 3072), "FLUX.1 mlp (4608x3072x12288)": (4608, 3072, 12288),
              "SD3 qkv (8192x1536x1536)": (8192, 1536, 1536), "SD3 mlp (8192x1536x6144)": (8192, 1536, 6144),
              "SD3 text (666x1536x1536)": (666, 1536, 1536)}
    print("| matmul | measured TFLOP/s | model TFLOP/s | measured/model |\n|---|---:|---:|---:|")
    for name, (m, k, n) in shapes.items():
        if small:
            m, k, n = m // 16, k // 16, n // 16
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        flops = 2 * m * k * n
        seconds = _per_call(lambda a=a, b=b: a @ b, sync, 20)
        model = profile.rate_at("matmul", "bfloat16", flops) if profile else None
        print(f"| {name} | {flops / seconds / 1e12:.3g} | {f'{model:.0f}' if model else '-'} | "
              f"{_ratio(flops / seconds / 1e12, model)} |")
    print(flush=True)


def sd3_transformer(args, torch, device, table: str | None, sync) -> None:
    """SD3 Medium's transformer, one call under CFG at 1024x1024, against the plan's predicted step."""
    from diffusers import SD3Transformer2DModel

    preset = "tiny-sd3" if args.small else "sd3-medium"
    config = json.loads((REPO / "dm_cli" / "presets" / preset / "transformer" / "config.json").read_text())
    dtype = torch.float32 if args.small else torch.float16
    size = 64 if args.small else 1024
    with torch.device(device):
        model = SD3Transformer2DModel.from_config(config).to(dtype).eval()
    latent = size // 8
    inputs = {"hidden_states": torch.randn(2, config["in_channels"], latent, latent, device=device, dtype=dtype),
              "encoder_hidden_states": torch.randn(2, 333, config["joint_attention_dim"], device=device, dtype=dtype),
              "pooled_projections": torch.randn(2, config["pooled_projection_dim"], device=device, dtype=dtype),
              "timestep": torch.tensor([500.0, 500.0], device=device)}
    with torch.inference_mode():
        seconds = statistics.median(_per_call(lambda: model(**inputs), sync, 1) for _ in range(5))
    predicted = "-"
    if table:
        import dm_cli

        plan = dm_cli.plan("sd3-medium", max_memory="0=80GB", height=size, width=size, dtype="float16", mode="resident",
                           check=False, profile=f"table:{table}", steps=28)
        predicted = f"{plan.predicted_time['step_s']:.4f} s"
    print(f"SD3 Medium's transformer ({preset}), {size}x{size}, batch 2 (CFG): {seconds:.4f} s a call measured, "
          f"{predicted} predicted (table:{table}); the record's SD3 images give about 0.17 s (A100) and 0.075 s (H100) a step\n", flush=True)


def _peak(profile) -> float:
    return profile.matmul_tflops["bfloat16"]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (slope, intercept) of seconds over bytes."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x


def _us(seconds: float | None) -> str:
    return f"{seconds * 1e6:.1f}" if seconds else "-"


def _ratio(measured: float | None, model: float | None) -> str:
    return f"{measured / model:.2f}" if measured and model else "-"

"""Compare dmap's meta-device activation estimate with a real CPU measurement.

Builds a reduced-width SD 1.5 UNet (random weights, fp32), runs one denoiser call as the SD 1.5
pipeline does (batch 2 for classifier-free guidance, 77 text tokens) on the CPU under
torch.profiler with profile_memory=True, and walks the allocation events in start-time order
(allocations are charged to the op that made them, frees are "[memory]" events with negative size);
the running maximum is the measured activation peak (weights are allocated before profiling starts,
inputs inside it, as in the estimate). The estimate is `dm_cli.planning.trace.trace.trace_component` on meta.

    .venv/bin/python scripts/measure_activations.py [--sizes 256,512] [--widths 160,320,640,640]
    .venv/bin/python scripts/measure_activations.py --model flux2 [--heads 8]
    .venv/bin/python scripts/measure_activations.py --model qwen-image [--sizes 256,512] [--heads 6 --layers 4]
    .venv/bin/python scripts/measure_activations.py --model wan-transformer --sizes 128,256 --frames 9,17
    .venv/bin/python scripts/measure_activations.py --model wan-vae --sizes 128 --frames 9,17
    .venv/bin/python scripts/measure_activations.py --model wan-vae-tiled --sizes 320 --frames 5 --base-dim 24

`--model flux2` does the same for a reduced-width FLUX.2 transformer (FLUX.2 [dev]'s block layout
and 128-wide heads, fewer heads and blocks), called as Flux2Pipeline calls it: packed latents of
(H/16)*(W/16) tokens, 512 text tokens, guidance embedded, batch 1 (guidance-distilled: no CFG).

`--model qwen-image` does the same for a reduced-width Qwen-Image transformer (the real config with
fewer heads and layers), fed exactly what dmap's Qwen-Image family says the pipeline feeds it (512
text tokens, batch 1: true CFG calls it twice, one call at a time).

Wan: a reduced-width WanTransformer3DModel (Wan 2.1 1.3B width, 1536 = 12 heads x 128, 2 blocks,
512 text tokens of 4096, one call of batch 1 as each of the pipeline's two CFG calls is) and the
Wan 2.2 VAE at full width decoding (B, 16, (F-1)/4+1, H/8, W/8) latents, both fp32.

`--model wan-vae-tiled`: the same decode with diffusers' tiling on (`vae.enable_tiling()`, 256 px tiles
every 192 px: a frame above 256 px is decoded tile by tile and blended), measured and traced
(`trace_component(..., tiled=True)`, what `dmap plan` charges a tiled decode); `--base-dim` narrows
the VAE (96 is Wan 2.2's) so the CPU run takes minutes, not hours. The untiled estimate is printed too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SD15_UNET = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}


WAN_TRANSFORMER = {
    "_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
    "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": None, "in_channels": 16,
    "num_attention_heads": 12, "num_layers": 2, "out_channels": 16, "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096,
}
WAN_VAE = {  # wan2.2-t2v-a14b/vae/config.json (scale factors are the class defaults, 4 and 8)
    "_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
    "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16,
}
WAN_TOKENS = 512


def reduced_unet_config(widths: tuple[int, ...], cross_attention_dim: int = 768) -> dict:
    config = dict(SD15_UNET)
    config["block_out_channels"] = list(widths)
    config["cross_attention_dim"] = cross_attention_dim
    return config


def unet_component(config: dict):
    from dm_cli.model.sources import ComponentSource

    return ComponentSource("unet", "diffusers", "UNet2DConditionModel", config, None, None)


def measured_peak(config: dict, size: int, batch: int = 2, tokens: int = 77, threads: int | None = 1) -> int:
    """Peak live bytes the CPU allocator sees during one UNet call (weights excluded, inputs included)."""
    import torch

    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # one thread: no oversubscription on a shared machine
    try:
        return _measure(config, size, batch, tokens)
    finally:
        torch.set_num_threads(previous_threads)


def _measure(config: dict, size: int, batch: int, tokens: int) -> int:
    import torch
    from diffusers import UNet2DConditionModel
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = UNet2DConditionModel.from_config(config).eval()
    latent = size // 8
    with torch.no_grad():
        # warm-up outside the profiler: one-time allocations (oneDNN caches) are not activations
        model(torch.randn(batch, 4, latent, latent), torch.tensor(10.0),
              encoder_hidden_states=torch.randn(batch, tokens, config["cross_attention_dim"]), return_dict=False)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            sample = torch.randn(batch, 4, latent, latent)
            text = torch.randn(batch, tokens, config["cross_attention_dim"])
            out = model(sample, torch.tensor(10.0), encoder_hidden_states=text, return_dict=False)
            del out, sample, text
    return profile_peak(prof)


def spec_inputs(value):
    """Tensors for a call spec's TensorSpecs (dm_cli.families.calls): random floats, zeros for integer inputs."""
    import torch

    from dm_cli.families.calls import TensorSpec

    if isinstance(value, TensorSpec):
        if value.kind == "long":
            return torch.zeros(value.shape, dtype=torch.long)
        return torch.rand(value.shape) if value.shape and len(value.shape) == 1 else torch.randn(value.shape)
    if isinstance(value, dict):
        return {k: spec_inputs(v) for k, v in value.items()}
    return value


def profiled_call_peak(method, spec_kwargs: dict, make=spec_inputs, threads: int | None = 1) -> int:
    """The CPU profiler's activation peak of `method(**make(spec_kwargs))`, on `threads` torch threads, after a
    warm-up call outside the profiler (one-time allocations, oneDNN caches, are not activations)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            method(**make(spec_kwargs))
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                kwargs = make(spec_kwargs)
                out = method(**kwargs)
                del out, kwargs
    finally:
        torch.set_num_threads(previous)
    return profile_peak(prof)


def profile_peak(prof) -> int:
    """Running maximum of self-allocated bytes over the profiler's events in start-time order."""
    events = [e for e in prof.events() if e.self_cpu_memory_usage]
    events.sort(key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def estimated_peak(config: dict, size: int, batch_size: int = 1) -> int:
    from dm_cli.inputs import InputSpec
    from dm_cli.planning.trace.trace import trace_component

    trace = trace_component(unet_component(config), "StableDiffusionPipeline", InputSpec(size, size, batch_size),
                            "float32", use_cache=False)
    return trace.activation_peak


def naive_peak(config: dict, size: int, batch_size: int = 1) -> int:
    """The same meta trace without the fused-attention rule: what a plain meta forward would claim."""
    from dm_cli.inputs import InputSpec
    from dm_cli.planning.trace import trace

    comp = unet_component(config)
    model = trace._meta_model(comp, "float32")
    spec = trace._resolve_call(model, comp, "StableDiffusionPipeline", InputSpec(size, size, batch_size))
    session = trace._Session(model, track_memory=True, replace_sdpa=False)
    trace._run(model, spec, "float32", session)
    return session.memory.peak[trace._META]


# --- any denoiser a family knows: inputs from the family's call spec ------------------------------

QWEN_IMAGE_TRANSFORMER = {
    "_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
    "num_layers": 60, "out_channels": 16, "patch_size": 2,
}


def reduced_qwenimage_config(heads: int, layers: int) -> dict:
    return dict(QWEN_IMAGE_TRANSFORMER, num_attention_heads=heads, num_layers=layers)


def family_call_peaks(cls: str, config: dict, pipeline_class: str, size: int, threads: int | None = 1,
                      inputs=None) -> tuple[int, int]:
    """(measured, estimated) activation peak of one denoiser call with the inputs the family specifies for
    `inputs` (an InputSpec; None: `size` x `size`, the family's defaults otherwise)."""
    import torch

    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.models import build_model
    from dm_cli.model.sources import ComponentSource
    from dm_cli.planning.trace.trace import trace_component

    comp = ComponentSource("transformer", "diffusers", cls, config, None, None)
    inputs = InputSpec(size, size) if inputs is None else inputs
    spec = call_spec(comp, pipeline_class, inputs)
    torch.manual_seed(0)
    model = build_model("diffusers", cls, config).eval()
    measured = profiled_call_peak(model, spec.kwargs, threads=threads)
    del model
    estimated = trace_component(comp, pipeline_class, inputs, "float32", use_cache=False).activation_peak
    return measured, estimated


def main_qwenimage(args) -> int:
    config = reduced_qwenimage_config(args.heads, args.layers)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        start = time.perf_counter()
        measured, estimate = family_call_peaks("QwenImageTransformer2DModel", config, "QwenImagePipeline", size,
                                               args.threads)
        rows.append((size, measured, estimate, estimate / measured, time.perf_counter() - start))
    width = args.heads * QWEN_IMAGE_TRANSFORMER["attention_head_dim"]
    print(f"Qwen-Image transformer, {args.layers} blocks, {width} wide ({args.heads} heads), fp32, batch 1, "
          "512 text tokens, CPU")
    print(f"{'resolution':>10} {'measured':>12} {'estimated':>12} {'ratio':>7} {'seconds':>8}")
    for size, measured, estimate, ratio, seconds in rows:
        print(f"{str(size) + '²':>10} {measured / 1e6:>9.2f} MB {estimate / 1e6:>9.2f} MB {ratio:>7.3f} {seconds:>8.1f}")
    worst = max(abs(r[3] - 1) for r in rows)
    print(f"worst deviation: {worst:.1%} ({'within' if worst <= 0.2 else 'OUTSIDE'} ±20%)")
    return 0 if worst <= 0.2 else 1


FLUX2_TRANSFORMER = {  # FLUX.2 [dev]'s transformer config with fewer heads and blocks
    "_class_name": "Flux2Transformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-06, "in_channels": 128, "mlp_ratio": 3.0, "num_layers": 2, "num_single_layers": 4,
    "patch_size": 1, "rope_theta": 2000, "timestep_guidance_channels": 256, "guidance_embeds": True,
}
FLUX2_TEXT_TOKENS = 512


def reduced_flux2_config(heads: int) -> dict:
    return dict(FLUX2_TRANSFORMER, num_attention_heads=heads, joint_attention_dim=3 * heads * 128)


def flux2_measured_peak(config: dict, size: int, threads: int | None = 1) -> int:
    """Peak live bytes the CPU allocator sees during one FLUX.2 transformer call, inputs included."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from torch.profiler import ProfilerActivity, profile

    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    tokens, text = (size // 16) ** 2, FLUX2_TEXT_TOKENS

    def inputs():
        return {"hidden_states": torch.randn(1, tokens, config["in_channels"]),
                "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"]),
                "timestep": torch.tensor([0.5]), "guidance": torch.tensor([4.0]),
                "img_ids": torch.zeros(1, tokens, 4, dtype=torch.long), "txt_ids": torch.zeros(1, text, 4, dtype=torch.long),
                "return_dict": False}

    try:
        torch.manual_seed(0)
        model = Flux2Transformer2DModel.from_config(config).eval()
        with torch.no_grad():
            model(**inputs())  # warm-up outside the profiler
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = model(**inputs())
                del out
        return profile_peak(prof)
    finally:
        torch.set_num_threads(previous_threads)


def flux2_estimated_peak(config: dict, size: int) -> int:
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import ComponentSource
    from dm_cli.planning.trace.trace import trace_component

    comp = ComponentSource("transformer", "diffusers", "Flux2Transformer2DModel", config, None, None)
    inputs = InputSpec(size, size, max_sequence_length=FLUX2_TEXT_TOKENS)
    return trace_component(comp, "Flux2Pipeline", inputs, "float32", use_cache=False).activation_peak


def main_flux2(args) -> int:
    config = reduced_flux2_config(args.heads)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        measured = flux2_measured_peak(config, size, threads=args.threads)
        estimate = flux2_estimated_peak(config, size)
        rows.append((size, measured, estimate, estimate / measured))
    print(f"FLUX.2 transformer, {args.heads} heads x 128 ({args.heads * 128} wide), 2 double + 4 single blocks, "
          f"fp32, batch 1, {FLUX2_TEXT_TOKENS} text tokens, CPU")
    print(f"{'resolution':>10} {'image tokens':>12} {'measured':>12} {'estimated':>12} {'ratio':>7}")
    for size, measured, estimate, ratio in rows:
        print(f"{str(size) + '²':>10} {(size // 16) ** 2:>12} {measured / 1e6:>9.2f} MB {estimate / 1e6:>9.2f} MB {ratio:>7.3f}")
    worst = max(abs(r[3] - 1) for r in rows)
    print(f"worst deviation: {worst:.1%} ({'within' if worst <= 0.2 else 'OUTSIDE'} ±20%)")
    return 0 if worst <= 0.2 else 1


def wan_component(config: dict):
    from dm_cli.model.sources import ComponentSource

    name = "vae" if config["_class_name"] == "AutoencoderKLWan" else "transformer"
    return ComponentSource(name, "diffusers", config["_class_name"], config, None, None)


def wan_measured_peak(config: dict, frames: int, size: int, threads: int | None = 1, tiled: bool = False) -> int:
    """Peak live bytes during one Wan transformer call or one VAE decode (tiled: with enable_tiling()), as
    WanPipeline makes them."""
    import diffusers
    import torch
    from torch.profiler import ProfilerActivity, profile

    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = getattr(diffusers, config["_class_name"]).from_config(config).eval()
        shape = (1, 16, (frames - 1) // 4 + 1, size // 8, size // 8)
        vae = config["_class_name"] == "AutoencoderKLWan"
        if tiled:
            model.enable_tiling()

        def call():
            latents = torch.randn(shape)
            if vae:
                out = model.decode(latents, return_dict=False)
            else:
                text = torch.randn(1, WAN_TOKENS, config["text_dim"])
                out = model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                            return_dict=False)
            del out, latents

        with torch.no_grad():
            call()  # warm-up outside the profiler
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                call()
        return profile_peak(prof)
    finally:
        torch.set_num_threads(previous_threads)


def wan_estimated_peak(config: dict, frames: int, size: int, tiled: bool = False) -> int:
    from dm_cli.inputs import InputSpec
    from dm_cli.planning.trace.trace import trace_component

    inputs = InputSpec(size, size, num_frames=frames, max_sequence_length=WAN_TOKENS)
    trace = trace_component(wan_component(config), "WanPipeline", inputs, "float32", use_cache=False, tiled=tiled)
    if trace.fallback_warning:
        raise SystemExit(trace.fallback_warning)
    return trace.activation_peak


def wan_tiled_main(args) -> int:
    config = dict(WAN_VAE, base_dim=args.base_dim)
    rows = []
    for frames in (int(f) for f in args.frames.split(",")):
        for size in (int(s) for s in args.sizes.split(",")):
            start = time.perf_counter()
            measured = wan_measured_peak(config, frames, size, threads=args.threads, tiled=True)
            measure_s = time.perf_counter() - start
            start = time.perf_counter()
            estimate = wan_estimated_peak(config, frames, size, tiled=True)
            estimate_s = time.perf_counter() - start
            untiled = wan_estimated_peak(config, frames, size)
            rows.append((frames, size, measured, estimate, estimate / measured, untiled, measure_s, estimate_s))
            print(f"  {frames} frames {size}²: measured {measured}, estimated {estimate}, untiled estimate {untiled}",
                  file=sys.stderr, flush=True)
    print(f"AutoencoderKLWan (Wan 2.2 VAE, base_dim {args.base_dim}), tiled decode (enable_tiling(): 256 px tiles, "
          "stride 192), batch 1, fp32, CPU")
    print(f"{'frames':>6} {'size':>6} {'measured':>12} {'estimated':>12} {'ratio':>7} {'untiled est.':>13} "
          f"{'measure s':>10} {'trace s':>8}")
    for frames, size, measured, estimate, ratio, untiled, measure_s, estimate_s in rows:
        print(f"{frames:>6} {str(size) + '²':>6} {measured / 1e6:>9.2f} MB {estimate / 1e6:>9.2f} MB {ratio:>7.3f} "
              f"{untiled / 1e6:>10.2f} MB {measure_s:>10.1f} {estimate_s:>8.1f}")
    worst = max(abs(r[4] - 1) for r in rows)
    print(f"worst deviation: {worst:.1%} ({'within' if worst <= 0.2 else 'OUTSIDE'} ±20%)")
    return 0 if worst <= 0.2 else 1


def wan_main(args) -> int:
    config = WAN_TRANSFORMER if args.model == "wan-transformer" else WAN_VAE
    rows = []
    for frames in (int(f) for f in args.frames.split(",")):
        for size in (int(s) for s in args.sizes.split(",")):
            start = time.perf_counter()
            measured = wan_measured_peak(config, frames, size, threads=args.threads)
            measure_s = time.perf_counter() - start
            start = time.perf_counter()
            estimate = wan_estimated_peak(config, frames, size)
            rows.append((frames, size, measured, estimate, estimate / measured, measure_s, time.perf_counter() - start))
            print(f"  {frames} frames {size}²: measured {measured}, estimated {estimate}", file=sys.stderr, flush=True)
    what = ("WanTransformer3DModel, 1536 wide (12x128), 2 blocks, 512 text tokens, one call, batch 1"
            if args.model == "wan-transformer" else "AutoencoderKLWan (Wan 2.2 VAE, full width), decode, batch 1")
    print(f"{what}, fp32, CPU")
    print(f"{'frames':>6} {'size':>6} {'measured':>12} {'estimated':>12} {'ratio':>7} {'measure s':>10} {'trace s':>8}")
    for frames, size, measured, estimate, ratio, measure_s, estimate_s in rows:
        print(f"{frames:>6} {str(size) + '²':>6} {measured / 1e6:>9.2f} MB {estimate / 1e6:>9.2f} MB {ratio:>7.3f} "
              f"{measure_s:>10.1f} {estimate_s:>8.1f}")
    worst = max(abs(r[4] - 1) for r in rows)
    print(f"worst deviation: {worst:.1%} ({'within' if worst <= 0.2 else 'OUTSIDE'} ±20%)")
    return 0 if worst <= 0.2 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("sd15", "flux2", "qwen-image", "wan-transformer", "wan-vae", "wan-vae-tiled"),
                        default="sd15")
    parser.add_argument("--sizes", default="256,512")
    parser.add_argument("--widths", default="160,320,640,640", help="UNet block widths (sd15)")
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads of 128 (flux2: default 8, [dev] has 48; qwen-image: default 6, of 24)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (qwen-image)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for the measured run")
    parser.add_argument("--frames", default="9,17", help="Wan: frames (4k+1)")
    parser.add_argument("--base-dim", type=int, default=24, help="wan-vae-tiled: the VAE's base_dim (Wan 2.2: 96)")
    args = parser.parse_args(argv)
    if args.heads is None:
        args.heads = {"flux2": 8, "qwen-image": 6}.get(args.model)
    if args.model == "flux2":
        return main_flux2(args)
    if args.model == "qwen-image":
        return main_qwenimage(args)
    if args.model == "wan-vae-tiled":
        return wan_tiled_main(args)
    if args.model.startswith("wan"):
        return wan_main(args)
    widths = tuple(int(w) for w in args.widths.split(","))
    config = reduced_unet_config(widths)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        start = time.perf_counter()
        measured = measured_peak(config, size, threads=args.threads)
        measure_s = time.perf_counter() - start
        start = time.perf_counter()
        estimate = estimated_peak(config, size)
        estimate_s = time.perf_counter() - start
        naive = naive_peak(config, size)
        rows.append((size, measured, estimate, estimate / measured, measure_s, estimate_s, naive))
    print(f"SD 1.5 UNet, block_out_channels {widths}, fp32, batch 2 (CFG), 77 tokens, CPU")
    print(f"{'resolution':>10} {'measured':>12} {'estimated':>12} {'ratio':>7} {'naive meta':>12} "
          f"{'measure s':>10} {'trace s':>8}")
    for size, measured, estimate, ratio, measure_s, estimate_s, naive in rows:
        print(f"{str(size) + '²':>10} {measured / 1e6:>9.2f} MB {estimate / 1e6:>9.2f} MB {ratio:>7.3f} "
              f"{naive / 1e6:>9.1f} MB {measure_s:>10.1f} {estimate_s:>8.1f}")
    print("(bytes: " + "; ".join(f"{r[0]}²: measured {r[1]}, estimated {r[2]}" for r in rows) + ")")
    worst = max(abs(r[3] - 1) for r in rows)
    print(f"worst deviation: {worst:.1%} ({'within' if worst <= 0.2 else 'OUTSIDE'} ±20%)")
    return 0 if worst <= 0.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())

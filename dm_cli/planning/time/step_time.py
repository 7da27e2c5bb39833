"""How long will it take: the denoising step's predicted seconds for a plan, on a device profile (profiles.py).

The work of one denoiser call is what its meta trace counted (trace_session.py `_Session.work`, at the planned
inputs): matmul and convolution FLOPs (torch's own formulas), attention FLOPs, the bytes the other ops read and
write, and the ops dispatched. One call takes

    matmul FLOPs / matmul rate + convolution FLOPs / convolution rate
    + attention scores x seconds per score + attention query rows x seconds per row + attention FLOPs / attention rate
    + other bytes / elementwise rate + weights / memory rate + ops x seconds per op

at the plan's dtype, the matmul, convolution and attention rates read off the profile's measured curves at the call's
mean FLOPs per op (a small model's matmuls and few-channel convolutions run far below the device's peak); a step is the family's calls per step (2 under separate CFG) of that, plus what the plan moves
per call: its offloaded weights at the profile's host rate (dmap streams them from the checkpoint, then copies them),
the hidden states at each hop between devices (the same hop bytes parallel.py counts for the split), and accelerate's
hook around each module of a split or offloaded denoiser. An image is `steps` steps over the images one call makes (batch x images
per prompt); a queue of N is N prompts one after another. With --world-size, each layout's time is this step scaled by
parallel.py's time model (its step seconds for the layout over its seconds for the split), which compares the
layouts' FLOPs per rank and link traffic on the same profile. The encoders and the decoder are predicted on the same
terms from their own traces (`pipeline_s`: one whole call). On a GPU (a table or calibrated GPU profile) matmuls run at
their own size's rate, and the host's seconds per op count only where they exceed the device's work: eager PyTorch
launches each kernel while the GPU runs earlier ones. Weights stored in fp8, int8 or NF4 add the bytes of their
upcast each call (`cast_bytes`): eager runs it as its own kernel. Offload the plan overlaps (overlap.py) costs only
the transfer the compute before each block does not hide (`offload_seconds`: max(compute, transfer) per block, the
call's compute spread evenly over its blocks); under --compile the elementwise ops between matmuls move and launch as
a compiler fuses them (`compiled`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dm_cli.planning.modes import CompileMode
from dm_cli.planning.time.profiles import DeviceProfile

# An empty CUDA kernel occupies the GPU about 3 us: at best 334,000 back-to-back launches a second (M. Boyer, "CUDA
# Kernel Overhead", University of Virginia): what each eager op costs the device beyond its work.
KERNEL_SECONDS = 3e-6


@dataclass(frozen=True)
class CallWork:
    """One denoiser call's work, as the meta trace counted it, and the weights it reads."""

    matmul_flops: float
    attention_flops: float
    other_bytes: float
    ops: int
    weight_bytes: int
    matmul_ops: int = 0
    attention_ops: int = 0
    attention_scores: float = 0.0  # query-key pairs over every head and sample
    attention_rows: float = 0.0  # query rows over every head and sample
    conv_flops: float = 0.0  # the convolutions' share of matmul_flops
    conv_ops: int = 0
    # the part of ops, matmul_flops and other_bytes outside the block lists (embedders, output layers)
    outside_ops: int = 0
    outside_flops: float = 0.0
    outside_bytes: float = 0.0
    # bytes moved each call to upcast weights stored in fp8/int8/GGUF before their matmuls (the compute copy
    # written, then read by the matmul), and int8's scale applied to each output: eager runs these as kernels
    cast_bytes: float = 0.0

    # FLOPs by the size of their op: ((log2 of an op's FLOPs, FLOPs of the ops of that size), ...), matmuls and
    # convolutions apart (the trace's `matmul_flops_at_2^N` and `conv_flops_at_2^N`)
    matmul_sizes: tuple = ()
    conv_sizes: tuple = ()
    # the elementwise ops as a compiler fuses them (trace_session.py `count_fused`): the runs between matmuls as one
    # kernel each, the bytes they read and write once; the part outside the block lists apart
    fused_bytes: float = 0.0
    fused_kernels: int = 0
    outside_fused_bytes: float = 0.0
    outside_fused_kernels: int = 0
    # attention's FLOPs at the head dim the GPU's kernel is built for (flash computes a head dim of 40 as 64): what a
    # GPU's attention takes; 0 in traces made before it was counted (attention_flops stands in)
    attention_kernel_flops: float = 0.0

    @classmethod
    def of(cls, work: dict, weight_bytes: int) -> "CallWork":
        return cls(float(work.get("matmul_flops", 0)), float(work.get("attention_flops", 0)),
                   float(work.get("other_bytes", 0)), int(work.get("ops", 0)), int(weight_bytes),
                   int(work.get("matmul_ops", 0)), int(work.get("attention_ops", 0)),
                   float(work.get("attention_scores", 0)), float(work.get("attention_rows", 0)),
                   float(work.get("conv_flops", 0)), int(work.get("conv_ops", 0)), int(work.get("outside_ops", 0)),
                   float(work.get("outside_flops", 0)), float(work.get("outside_bytes", 0)),
                   float(work.get("cast_bytes", 0)), _sizes(work, "matmul"), _sizes(work, "conv"),
                   float(work.get("fused_bytes", 0)), int(work.get("fused_kernels", 0)),
                   float(work.get("outside_fused_bytes", 0)), int(work.get("outside_fused_kernels", 0)),
                   float(work.get("attention_kernel_flops", 0)))


def compiled(work: CallWork, mode: CompileMode) -> CallWork:
    """One call as `--compile` runs it: each run of elementwise ops between two matmuls (or attentions) one kernel
    that reads and writes its tensors once (the trace's `fused_*`), where eager runs every op as its own kernel and
    writes every intermediate; matmuls, convolutions and attention as eager runs them. "regional" compiles the
    repeated blocks (the block lists) and leaves the modules outside them eager; a model without block lists dmap
    knows compiles whole, as "full" (diffusers compiles the whole model where it declares no repeated blocks). A
    trace without the fused counts (none of its ops elementwise) is eager's."""
    if not work.fused_kernels:
        return work
    heavy = work.matmul_ops + work.attention_ops
    if mode is CompileMode.FULL or work.outside_ops >= work.ops:
        return replace(work, other_bytes=work.fused_bytes, ops=heavy + work.fused_kernels,
                       outside_bytes=work.outside_fused_bytes, outside_ops=work.outside_fused_kernels)
    blocks_bytes = work.fused_bytes - work.outside_fused_bytes
    blocks_kernels = work.fused_kernels - work.outside_fused_kernels
    return replace(work, other_bytes=blocks_bytes + work.outside_bytes, ops=heavy + blocks_kernels + work.outside_ops)


@dataclass(frozen=True)
class Traffic:
    """What the plan moves per denoiser call: offloaded weights streamed in, and the hidden states at each hop."""

    offloaded_bytes: int = 0
    hops: int = 0
    hop_bytes: int = 0
    hooked_modules: int = 0  # modules accelerate wraps in a hook (a split or offloaded denoiser's)
    # the component's blocks in execution order, each (bytes streamed in for it each call, whether that copy is
    # prefetched on a second stream: overlapped offload, whether it is a block of the lists a pipeline cuts): with an
    # overlapped one, the offload term is the transfer its compute does not hide (`unhidden_seconds`)
    streams: tuple = ()


def call_terms(work: CallWork, profile: DeviceProfile, dtype: str, traffic: Traffic) -> dict[str, float]:
    """The seconds of one denoiser call, term by term (see the module's doc): its compute, then what the plan moves."""
    compute = compute_terms(work, profile, dtype)
    return {
        **compute,
        "offload": offload_seconds(work, compute, profile, dtype, traffic),
        "hops": traffic.hops * traffic.hop_bytes / (profile.link_gbps * 1e9),
        "hooks": traffic.hooked_modules * profile.hook_seconds,
    }


def compute_terms(work: CallWork, profile: DeviceProfile, dtype: str) -> dict[str, float]:
    """The compute of one call, term by term. On a GPU the host launches each op while the device runs earlier ones:
    the ops' host seconds count only where they exceed the device's work."""
    dense_flops, dense_ops = work.matmul_flops - work.conv_flops, work.matmul_ops - work.conv_ops
    matmul = profile.rate_at("matmul", dtype, dense_flops / max(1, dense_ops))
    conv = profile.rate_at("conv", dtype, work.conv_flops / max(1, work.conv_ops))
    if profile.kind == "gpu" and work.matmul_sizes:  # each size at its own rate: big and small ops mix on a GPU
        matmul = _sized_rate(profile, "matmul", dtype, work.matmul_sizes, dense_flops) or matmul
        conv = _sized_rate(profile, "conv", dtype, work.conv_sizes, work.conv_flops) or conv
    score = _per_dtype(profile.score_seconds, dtype)
    if score and work.attention_scores:  # the softmax per score, each query row's fixed work, the two matmuls per FLOP
        attention = work.attention_scores * score + work.attention_rows * _per_dtype(profile.row_seconds, dtype) \
            + work.attention_flops / (profile.rate(profile.attention_tflops, dtype) * 1e12)
    else:  # a GPU's kernel computes at its built head dim (gpu_kernels.py `kernel_head_dim`)
        flops = work.attention_kernel_flops if profile.kind == "gpu" and work.attention_kernel_flops \
            else work.attention_flops
        rate = profile.rate_at("attention", dtype, flops / max(1, work.attention_ops))
        attention = flops / (rate * 1e12)
    elementwise = (profile.elementwise_gbps or profile.memory_gbps) * 1e9
    device = {
        "matmul": dense_flops / (matmul * 1e12),
        "conv": work.conv_flops / (conv * 1e12),
        "attention": attention,
        "memory": work.other_bytes / elementwise + work.weight_bytes / (profile.memory_gbps * 1e9),
        "cast": work.cast_bytes / elementwise,
    }
    if profile.kind == "gpu":  # each kernel holds the GPU a moment however little it does
        device["launch"] = work.ops * KERNEL_SECONDS
    host = work.ops * profile.op_seconds
    return {**device, "ops": max(0.0, host - sum(device.values())) if profile.kind == "gpu" else host}


def offload_seconds(work: CallWork, compute: dict[str, float], profile: DeviceProfile, dtype: str,
                    traffic: Traffic) -> float:
    """What streaming the offloaded blocks adds to a call: every byte at the host rate when each block is copied in
    its turn (synchronous); with overlapped blocks, only the transfer the compute before each does not hide. The
    call's compute (`compute`) divides evenly over the blocks of the lists, the work outside them (the trace's
    `outside_*`: embedders, output layers) over the other blocks."""
    rate = profile.host_gbps * 1e9
    if not any(overlapped for _, overlapped, _ in traffic.streams):
        return traffic.offloaded_bytes / rate
    total = sum(compute.values())
    outside = replace(work, matmul_flops=work.outside_flops, other_bytes=work.outside_bytes, ops=work.outside_ops,
                      attention_flops=0.0, attention_kernel_flops=0.0, attention_scores=0.0, attention_rows=0.0,
                      conv_flops=0.0, conv_ops=0, matmul_ops=0, attention_ops=0, weight_bytes=0, cast_bytes=0.0, matmul_sizes=(), conv_sizes=())
    outside_s = min(total, sum(compute_terms(outside, profile, dtype).values()))
    listed = sum(1 for _, _, in_list in traffic.streams if in_list)
    others = len(traffic.streams) - listed
    per_block = (total - outside_s) / listed if listed else 0.0
    per_other = (outside_s if listed else total) / others if others else 0.0
    return unhidden_seconds(tuple((nbytes / rate, overlapped, per_block if in_list else per_other)
                                  for nbytes, overlapped, in_list in traffic.streams))


def unhidden_seconds(blocks: tuple) -> float:
    """Seconds the transfers add to the compute of `blocks` ((transfer s, overlapped, compute s) in execution order),
    as dmap runs them (run/load/prefetch.py): a synchronous block waits for its whole copy on the compute stream; an
    overlapped block's copy runs on a second stream, issued as the overlapped block before it starts computing (the
    first: as the call starts) and after that block's copy, and holds its block back only until it arrives. Uniform
    blocks cost max(compute, transfer) each, not their sum."""
    clock = copy_clock = issued = 0.0
    for transfer, overlapped, seconds in blocks:
        if overlapped:
            copy_clock = max(copy_clock, issued) + transfer
            start = max(clock, copy_clock)
            issued = start
        else:
            start = clock + transfer
        clock = start + seconds
    return max(0.0, clock - sum(seconds for _, _, seconds in blocks))


@dataclass(frozen=True, eq=False)
class RankCompute:
    """The detailed model of one denoiser call (`call_terms` at no traffic) on one rank that computes a share of it,
    for `--parallel`'s time model (parallel.py): the layouts' compute on the same terms as the prediction's step.
    A share keeps what does not divide: under cfg and context every rank dispatches every op of the call (its
    host cost, and matmuls of a share of the tokens run at the smaller op's rate) and reads every weight; a pipeline
    slice runs its share of the ops and reads its share of the weights."""

    work: CallWork
    profile: DeviceProfile
    dtype: str

    def call_s(self, share: float = 1.0, divide_ops: bool = False) -> float:
        """Seconds of `share` of one call: of its samples or tokens (cfg, context: every op, every weight), or with
        `divide_ops` of its blocks (a pipeline slice: that share of the blocks' ops and weights, and every op outside
        the block lists, which each rank runs: the embedders before its first block, the output layers)."""
        work = self.work
        part = replace(work, matmul_flops=work.matmul_flops * share, attention_flops=work.attention_flops * share,
                       attention_kernel_flops=work.attention_kernel_flops * share, other_bytes=work.other_bytes * share, attention_scores=work.attention_scores * share,
                       attention_rows=work.attention_rows * share, conv_flops=work.conv_flops * share)
        if divide_ops:  # the blocks' share, every op outside them; the ops and weights divide too
            def part_of(total: float, outside: float) -> float:
                return (total - outside) * share + outside

            part = replace(part, matmul_flops=part_of(work.matmul_flops, work.outside_flops),
                           other_bytes=part_of(work.other_bytes, work.outside_bytes),
                           ops=round(part_of(work.ops, work.outside_ops)), weight_bytes=round(work.weight_bytes * share),
                           matmul_ops=round(work.matmul_ops * share), attention_ops=round(work.attention_ops * share),
                           conv_ops=round(work.conv_ops * share))
        return sum(call_terms(part, self.profile, self.dtype, Traffic()).values())

    def ops_s(self, ops: int) -> float:
        """Seconds the host spends dispatching `ops` more ops (a layout's own: the all-to-alls' reshapes)."""
        return ops * self.profile.op_seconds

    def copy_s(self, moved_bytes: float) -> float:
        """Seconds to read and write `moved_bytes` at the elementwise rate (a layout's reshuffles of activations)."""
        return moved_bytes / ((self.profile.elementwise_gbps or self.profile.memory_gbps) * 1e9)


def predict(work: CallWork, traffic: Traffic, profile: DeviceProfile, dtype: str, calls: int, steps: int,
            images_per_call: int, queue: int, layout_steps: dict[str, float] | None = None,
            origin: str = "default", encode_s: float = 0.0, decode_s: float = 0.0) -> dict:
    """The plan's `predicted_time`: seconds per step, per image and per queue of `queue` prompts, the terms of one
    step, and (with `layout_steps`, parallel.py's step seconds per layout) the same for each layout considered.
    With the encoders' and the decoder's seconds (`encode_s`, `decode_s`: one prompt's), `pipeline_s`: one whole
    pipeline call (encode, every step, decode), what a published "seconds per image" measures."""
    terms = call_terms(work, profile, dtype, traffic)
    step = calls * sum(terms.values())

    def times(step_s: float) -> dict[str, float]:
        prompt = steps * step_s
        return {"step_s": _round(step_s), "image_s": _round(prompt / max(1, images_per_call)),
                "queue_s": _round(prompt * queue)}

    result = {"profile": profile.name, "profile_origin": origin, "profile_source": profile.source, "dtype": dtype,
              "steps": steps, "calls_per_step": calls, "images_per_call": images_per_call, "queue": queue,
              **times(step), "step_terms_s": {k: _round(calls * v) for k, v in terms.items()}}
    if any(overlapped for _, overlapped, _ in traffic.streams):  # what the same plan would take copying in turn
        synchronous = calls * sum(call_terms(work, profile, dtype, replace(traffic, streams=())).values())
        result["offload_overlap"] = {"synchronous_step_s": _round(synchronous),
                                     "transfer_s": _round(calls * traffic.offloaded_bytes / (profile.host_gbps * 1e9))}
    if encode_s or decode_s:
        result.update(encode_s=_round(encode_s), decode_s=_round(decode_s),
                      pipeline_s=_round(encode_s + steps * step + decode_s))
    if layout_steps and layout_steps.get("split"):
        base = layout_steps["split"]
        result["layouts"] = {name: times(step * seconds / base) for name, seconds in layout_steps.items()}
    return result


def _sizes(work: dict, kind: str) -> tuple:
    """((log2 of an op's FLOPs, FLOPs), ...) of `kind` ("matmul" or "conv") from a trace's work."""
    prefix = f"{kind}_flops_at_2^"
    return tuple(sorted((int(key[len(prefix):]), float(value)) for key, value in work.items()
                        if key.startswith(prefix) and key[len(prefix):].isdigit()))


def _sized_rate(profile: DeviceProfile, kind: str, dtype: str, sizes: tuple, total: float) -> float:
    """The TFLOP/s that takes as long for `total` FLOPs as each size's FLOPs at that size's rate (0: none)."""
    seconds = sum(flops / profile.rate_at(kind, dtype, 2.0 ** (power + 0.5)) for power, flops in sizes)
    return total / seconds if seconds > 0 and total > 0 else 0.0


def _per_dtype(table: dict[str, float], dtype: str) -> float:
    """A profile's seconds at `dtype` (float16 read as bfloat16 when only that was measured); 0 when not measured."""
    return table.get(dtype) or table.get("bfloat16" if dtype == "float16" else "") or 0.0


def _round(value: float) -> float:
    """Four significant figures: a prediction is not more precise than that, and the JSON stays readable."""
    return float(f"{value:.4g}")

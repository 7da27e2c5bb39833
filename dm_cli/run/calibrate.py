"""`dmap calibrate`: measure this machine's device (the first GPU, else the CPU) into a profile (planning/profiles.py)
that `dmap plan` predicts step times with.

Each rate is the median of a few timed repeats after a warm-up:
- matmul: square matmuls at each dtype (float32 always; bfloat16 and float16 on a GPU, bfloat16 on a CPU);
- attention: scaled_dot_product_attention at a denoiser's shape (heads of 64, a few thousand tokens), fit as seconds
  per score plus FLOPs (two head dimensions) plus seconds per query row (a cross-attention to 77 text tokens);
- convolutions: 3x3 convolutions of a few to a few hundred channels (a small one runs far below the matmul rate);
- memory: a large tensor added to itself (read twice, written once);
- host and link: pinned host -> GPU copies, GPU -> GPU copies when there are two; on a CPU the link between two
  processes (gloo over loopback, what CPU ranks under torchrun exchange over): its rate and latency per message;
- op_seconds: the time of one tiny op, which is what each of a small model's thousands of ops costs the host.
On a CPU with one torch thread the clock is the thread's CPU time (a busy machine's other processes do not count);
else the wall clock.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import platform
import socket
import tempfile
import time
from dataclasses import dataclass

from dm_cli.planning.profiles import DeviceProfile


@dataclass(frozen=True)
class CalibrationSizes:
    """The sizes measured: `quick` for tests (seconds), the default for a profile worth predicting with."""

    matmul: tuple[int, ...] = (64, 128, 256, 512, 1024)  # square matmuls: the rate curve by the size of one op
    tokens: tuple[int, ...] = (256, 1024, 2048)  # attention over this many tokens, 8 heads of 64
    conv_channels: tuple[int, ...] = (4, 16, 64, 256)  # 3x3 convolutions of this many channels, 64x64 pixels
    conv_pixels: int = 64
    memory_mib: int = 256
    elementwise_mib: int = 4  # a denoiser's activations: a few MiB each
    repeats: int = 5
    link_mib: int = 16  # on a CPU: the message between two processes (gloo) timed for the link's rate; 0: none
    link_rounds: int = 20  # round trips timed for each of its two sizes (the median kept)

    @classmethod
    def quick(cls) -> "CalibrationSizes":
        return cls(matmul=(64, 128), tokens=(64, 128), conv_channels=(4, 16), conv_pixels=16, memory_mib=8,
                   elementwise_mib=1, repeats=2, link_mib=0, link_rounds=3)  # no gloo pair: the link at memory


def _best(run, repeats: int, sync, clock=time.perf_counter) -> float:
    """The median of `repeats` timed calls of `run` (after one warm-up), on `clock`: an op as a model meets it again
    and again, not its luckiest run (the fastest of 5 put the bench's predictions 15% under)."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        sync()
        times.append(clock() - start)
    return max(sorted(times)[len(times) // 2], 1e-9)


def _attention_fit(torch, target, dtype, tokens: int, timed, repeats: int, sync) -> tuple[float, float]:
    """(seconds per query-key score, TFLOP/s of the rest) of attention at `dtype`: timed at head dimensions 8 and 64
    over `tokens` tokens, 8 heads; time = scores x seconds per score + FLOPs / rate (4 x head dim FLOPs a score).
    The small end is 8, not 16: the cost is not linear in the head dimension below 16 (on this CPU, a line through 16
    and 64 put heads of 8 some 15% under); through 8 and 64 it is right from 8 up and over below (1: ~30%)."""
    scores = 8 * tokens * tokens
    seconds = {}
    small, large = 8, 64
    for dim in (small, large):
        q = torch.randn(1, 8, tokens, dim, device=target, dtype=dtype)
        seconds[dim] = timed(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q), repeats, sync)
    extra = seconds[large] - seconds[small]
    rate = 4 * scores * (large - small) / extra / 1e12 if extra > 0 else 1e6  # the FLOPs the larger heads add
    per_score = max(seconds[small] - 4 * scores * small / (rate * 1e12), seconds[small] * 0.05) / scores
    return round(per_score, 15), round(min(rate, 1e6), 6)


def _row_seconds(torch, target, dtype, tokens: int, per_score: float, rate: float, timed, repeats: int, sync) -> float:
    """Seconds per query row of attention at `dtype`: `tokens` queries over 77 keys (a cross-attention to CLIP's
    text), 8 heads of 16, less what its scores and FLOPs cost at the self-attention fit (`_attention_fit`)."""
    keys = 77
    q = torch.randn(1, 8, tokens, 16, device=target, dtype=dtype)
    k = torch.randn(1, 8, keys, 16, device=target, dtype=dtype)
    seconds = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k), repeats, sync)
    rows, scores = 8 * tokens, 8 * tokens * keys
    rest = seconds - scores * per_score - 4 * scores * 16 / (rate * 1e12)
    return round(max(rest, 0.0) / rows, 15) or 1e-15


def _attention_curve(torch, target, dtype, sizes: "CalibrationSizes", timed, sync) -> list:
    """[[FLOPs of one attention, TFLOP/s], ...]: self-attention over each of `sizes.tokens` tokens, 8 heads of 64."""
    curve = []
    for tokens in sizes.tokens:
        q = torch.randn(1, 8, tokens, 64, device=target, dtype=dtype)
        flops = 4 * 8 * tokens**2 * 64
        seconds = timed(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, q, q), sizes.repeats, sync)
        curve.append([flops, round(flops / seconds / 1e12, 6)])
    return curve


def _conv_curve(torch, target, dtype, sizes: "CalibrationSizes", timed, sync) -> list:
    """[[FLOPs of one conv, TFLOP/s], ...]: 3x3 convolutions (padding 1) of each of `sizes.conv_channels` channels in
    and out over conv_pixels x conv_pixels, a UNet's resnet convolutions at the sizes a small one has."""
    curve = []
    side = sizes.conv_pixels
    for channels in sizes.conv_channels:
        x = torch.randn(1, channels, side, side, device=target, dtype=dtype)
        w = torch.randn(channels, channels, 3, 3, device=target, dtype=dtype)
        flops = 2 * side * side * channels * channels * 9
        seconds = timed(lambda x=x, w=w: torch.nn.functional.conv2d(x, w, padding=1), sizes.repeats, sync)
        curve.append([flops, round(flops / seconds / 1e12, 6)])
    return curve


def _op_seconds(torch, target, timed, repeats: int, sync) -> float:
    """The host's cost of one op inside a model: tiny resnet and transformer blocks (modules, their Python, the
    dispatch; kernels of a few elements) timed, over the ops they dispatch as the planner's trace counts them (every
    op but views)."""
    from torch.utils._python_dispatch import TorchDispatchMode  # lazy: torch (heavy, off start-up)

    nn = torch.nn
    conv = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                         nn.Conv2d(4, 4, 3, padding=1)).to(target)
    mlp = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8)).to(target)
    image, tokens = torch.randn(1, 4, 4, 4, device=target), torch.randn(1, 4, 8, device=target)

    def blocks():
        for _ in range(20):
            conv(image) + image, mlp(tokens) + tokens

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += not getattr(func, "is_view", False)
            return func(*args, **(kwargs or {}))

    with Count():
        blocks()
    return timed(blocks, repeats, sync) / max(1, Count.ops)


def _hook_seconds(torch, target, timed, repeats: int, sync) -> float:
    """What accelerate's AlignDevicesHook adds to one module call (a split or offloaded denoiser has one per module)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module  # lazy: accelerate (heavy, off start-up)

    calls = 200
    layer, x = torch.nn.Linear(8, 8).to(target), torch.randn(1, 8, device=target)
    plain = timed(lambda: [layer(x) for _ in range(calls)], repeats, sync)
    add_hook_to_module(layer, AlignDevicesHook(execution_device=target, io_same_device=True))
    hooked = timed(lambda: [layer(x) for _ in range(calls)], repeats, sync)
    return max(hooked - plain, 0.0) / calls or 1e-9


def _stream_gbps(torch, sizes: "CalibrationSizes", timed) -> float:
    """GB/s at which offloaded weights come back each step: dmap reads them from the checkpoint's safetensors (in the
    page cache after the first step) and casts them (run/loading.py `_load_streamed`), tensor by tensor."""
    from safetensors import safe_open  # lazy: safetensors (heavy, off start-up)
    from safetensors.torch import save_file  # lazy: safetensors (heavy, off start-up)

    count, size = (8, 2**14) if sizes.memory_mib < 64 else (64, 2**18)  # float32 tensors of 64 KiB / 1 MiB
    tensors = {f"layer.{i}.weight": torch.randn(size) for i in range(count)}
    with tempfile.TemporaryDirectory(prefix="dmap-calibrate-") as folder:
        path = f"{folder}/weights.safetensors"
        save_file(tensors, path)

        def read() -> None:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in tensors:
                    handle.get_tensor(name).to(torch.bfloat16)

        return count * size * 4 / timed(read, sizes.repeats, lambda: None) / 1e9


def _gloo_peer(port: int, mib: int, rounds: int) -> None:
    """Rank 1 of `_gloo_link`'s pair (a spawned process): echo each message back to rank 0, then join its
    all-to-alls."""
    import torch  # lazy: torch (heavy, off start-up)
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        for size in (1, mib * 2**20 // 4):
            buffer = torch.empty(size)
            for _ in range(rounds + 1):
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
        for floats in ALL_TO_ALL_FLOATS:
            _all_to_alls(torch, rounds, floats)
    finally:
        dist.destroy_process_group()


ALL_TO_ALL_FLOATS = (2, 2**18)  # the two all-to-alls timed: two floats (its fixed cost), then 1 MiB (its rate)


def _all_to_alls(torch, rounds: int, floats: int):
    """A function making one all-to-all of `floats` floats over the default group, as diffusers' Ulysses attention
    makes them (functional collectives, then a wait), to time `rounds` times after a warm-up (`_best`); the peer
    (rank 1) makes its `rounds` + 1 at once. (Timed after a millisecond of matmuls on both ranks, to count each rank's
    jitter as the other's wait, one all-to-all measured 0.55 to 3.2 ms in five calibrations a minute apart: too
    unsteady to predict with; back to back, 0.39 to 0.46 ms.)"""
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)
    import torch.distributed._functional_collectives as funcol  # lazy: torch (heavy, off start-up)

    tensor = torch.ones(floats)

    def all_to_all():
        funcol.wait_tensor(funcol.all_to_all_single(tensor, None, None, dist.group.WORLD))

    if dist.get_rank() == 1:
        for _ in range(rounds + 1):
            all_to_all()
    return all_to_all


@dataclass(frozen=True)
class GlooLink:
    """What `_gloo_link` measured (zeros: not measured)."""

    gbps: float = 0.0
    latency_s: float = 0.0  # a point-to-point message's fixed cost
    collective_latency_s: float = 0.0  # an all-to-all's fixed cost
    collective_gbps: float = 0.0  # an all-to-all's rate: the bytes a rank sends the other over its extra seconds


def _gloo_link(torch, sizes: "CalibrationSizes") -> GlooLink:
    """Gloo between two processes of this machine (loopback TCP): what CPU ranks under torchrun exchange over (a
    pipeline's hops, a layout's halves and all-to-alls). A spawned peer echoes messages back through
    torch.distributed's own calls (as `run/pipeline_links.py` sends): a round trip of one float is two latencies, one
    of `link_mib` MiB two latencies and twice its bytes. Then all-to-alls as diffusers' Ulysses makes them
    (functional collectives and a wait): of two floats, several times a message's cost, and of 1 MiB, whose extra
    seconds over the half a rank sends give their rate.
    Medians, wall clock (the exchange waits on the other process). Not measured in a process that already belongs to a process group (calibrate under torchrun)."""
    import torch.distributed as dist  # lazy: torch (heavy, off start-up)

    if dist.is_initialized():
        return GlooLink()
    with socket.socket() as probe:  # a free port for the pair's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    peer = multiprocessing.get_context("spawn").Process(target=_gloo_peer, args=(port, sizes.link_mib, sizes.link_rounds),
                                                        daemon=True)
    peer.start()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=60))
        try:
            times = []
            for size in (1, sizes.link_mib * 2**20 // 4):
                buffer = torch.ones(size)

                def round_trip(buffer=buffer):
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)

                times.append(_best(round_trip, sizes.link_rounds, lambda: None))
            small, large = (_best(_all_to_alls(torch, sizes.link_rounds, floats), sizes.link_rounds, lambda: None)
                            for floats in ALL_TO_ALL_FLOATS)
        finally:
            dist.destroy_process_group()
        moved = 2 * sizes.link_mib * 2**20
        sent = ALL_TO_ALL_FLOATS[1] * 4 / 2  # half of each rank's tensor goes to the other
        return GlooLink(moved / max(times[1] - times[0], times[1] / 10) / 1e9, times[0] / 2, small,  # a noisy small
                        sent / max(large - small, large / 10) / 1e9)  # one: at most 10x
    finally:
        peer.join(timeout=30)
        if peer.is_alive():
            peer.kill()


def _cpu_link(torch, sizes: "CalibrationSizes", memory: float, gpu: bool, say) -> tuple[str, GlooLink]:
    """(in words, what was measured) of the link between two ranks of this machine: CPU ranks (torchrun, one CPU
    standing for each GPU of a plan) exchange over gloo; otherwise the memory for now (a GPU's link is measured
    after)."""
    if not gpu and sizes.link_mib:
        say(f"Measuring gloo between two processes ({sizes.link_mib} MiB and one-float messages, all-to-alls)")
        link = _gloo_link(torch, sizes)
        if link.gbps:
            return "gloo between two processes of this machine (loopback)", link
    return "one device: its memory", GlooLink(memory)


def calibrate(sizes: CalibrationSizes | None = None, device: str | None = None,
              on_progress=None) -> DeviceProfile:
    """Measure the device (`device`: "cpu", "cuda:0"; None: the first GPU, else the CPU) into a profile."""
    import torch  # lazy: torch (heavy, off start-up)

    sizes = sizes or CalibrationSizes()
    say = on_progress or (lambda message: None)
    target = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    gpu = target.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(target)) if gpu else (lambda: None)
    if not gpu and torch.get_num_threads() == 1:  # the thread does all the work: its CPU clock, which the machine's
        def timed(run, repeats, sync):  # other load does not inflate (a wall clock there counts the others' turns)
            return _best(run, repeats, sync, time.thread_time)
    else:
        timed = _best
    dtypes = ("float32", "bfloat16", "float16") if gpu else ("float32", "bfloat16")
    matmul, attention, matmul_curve, attention_curve, scores = {}, {}, {}, {}, {}
    rows, conv_curve = {}, {}
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name)
            say(f"Measuring matmuls of {', '.join(map(str, sizes.matmul))} in {name}")
            curve = []
            for n in sizes.matmul:
                a, b = torch.randn(n, n, device=target, dtype=dtype), torch.randn(n, n, device=target, dtype=dtype)
                seconds = timed(lambda a=a, b=b: torch.mm(a, b), sizes.repeats, sync)
                curve.append([2 * n**3, round(2 * n**3 / seconds / 1e12, 6)])
            matmul_curve[name], matmul[name] = curve, max(rate for _, rate in curve)
            say(f"Measuring attention over {', '.join(map(str, sizes.tokens))} tokens in {name}")
            attention_curve[name] = _attention_curve(torch, target, dtype, sizes, timed, sync)
            scores[name], attention[name] = _attention_fit(torch, target, dtype, max(sizes.tokens), timed,
                                                           sizes.repeats, sync)
            rows[name] = _row_seconds(torch, target, dtype, max(sizes.tokens), scores[name], attention[name], timed,
                                      sizes.repeats, sync)
            say(f"Measuring 3x3 convolutions of {', '.join(map(str, sizes.conv_channels))} channels in {name}")
            conv_curve[name] = _conv_curve(torch, target, dtype, sizes, timed, sync)
        say(f"Measuring a denoiser's elementwise ops over {sizes.elementwise_mib} MiB tensors")
        y = torch.randn(sizes.elementwise_mib * 2**20 // 4 // 512, 512, device=target)
        moved = y.nbytes * (3 + 3 + 2 + 2 + 2 + 4)  # bytes read and written by the mix below

        def mix():
            torch.add(y, y), torch.mul(y, y), torch.nn.functional.gelu(y, approximate="tanh")
            torch.nn.functional.silu(y), torch.nn.functional.layer_norm(y, (512,)), torch.cat([y, y])

        elementwise = moved / timed(mix, sizes.repeats, sync) / 1e9
        say(f"Measuring memory bandwidth over {sizes.memory_mib} MiB")
        elements = sizes.memory_mib * 2**20 // 4
        x = torch.ones(elements, device=target)
        out = torch.empty_like(x)
        memory = 3 * x.nbytes / timed(lambda: torch.add(x, x, out=out), sizes.repeats, sync) / 1e9
        op_seconds = _op_seconds(torch, target, timed, sizes.repeats, sync)
        hook = _hook_seconds(torch, target, timed, sizes.repeats, sync)
        say("Measuring offloaded weights read back from a safetensors file")
        stream = _stream_gbps(torch, sizes, timed)
        host, (words, gloo) = stream, _cpu_link(torch, sizes, memory, gpu, say)
        link = gloo.gbps
        if gpu:
            say("Measuring host -> GPU copies")
            pinned = torch.ones(elements, pin_memory=True)
            copy = x.nbytes / timed(lambda: x.copy_(pinned, non_blocking=True), sizes.repeats, sync) / 1e9
            host = 1 / (1 / stream + 1 / copy)  # dmap streams offloaded blocks from the checkpoint, then copies them
            link, words = copy, "one GPU: host copies"
            if torch.cuda.device_count() > 1:
                other = torch.empty(elements, device="cuda:1")
                link = x.nbytes / timed(lambda: other.copy_(x), sizes.repeats,
                                        lambda: (torch.cuda.synchronize(0), torch.cuda.synchronize(1))) / 1e9
                words = "GPU 0 -> GPU 1 copies"
    name = torch.cuda.get_device_name(target) if gpu else (platform.processor() or platform.machine() or "cpu")
    threads = torch.get_num_threads()
    where = f"{name}, {threads} torch thread(s)" if not gpu else name
    source = (f"measured by dmap calibrate on {platform.node() or 'this machine'} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} ({where}; load average "
              f"{os.getloadavg()[0]:.1f}; {'thread CPU' if timed is not _best else 'wall'} clock; sizes: matmuls up to {max(sizes.matmul)}, up to {max(sizes.tokens)} tokens, {sizes.memory_mib} MiB)")
    return DeviceProfile(where, "gpu" if gpu else "cpu", {k: round(v, 4) for k, v in matmul.items()},
                         {k: round(v, 4) for k, v in attention.items()}, round(memory, 3), round(host, 3),
                         round(link, 3), words, round(op_seconds, 9), source, True, matmul_curve, attention_curve,
                         round(elementwise, 3), round(hook, 9) or 1e-9, scores, rows, conv_curve,
                         round(gloo.latency_s, 9), round(gloo.collective_latency_s, 9), round(gloo.collective_gbps, 3))

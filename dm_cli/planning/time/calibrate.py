"""`dmap calibrate`: measure this machine's device (the first GPU, else the CPU) into a profile (planning/time/profiles.py)
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
else the wall clock. The device and the output are checked before anything is measured (`check_device`,
`check_profile_output`); how busy the machine was (`MachineLoad`: its load average, the spread of the repeats) decides
whether the figures may become this machine's default profile (cli/calibrate.py).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import platform
import re
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.io.atomic import check_writable_file, refuse_existing
from dm_cli.planning.time.profiles import TFLOPS_BOUNDS, DeviceProfile
from dm_cli.units import format_figure, shorten


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


def _best(run, repeats: int, sync, clock=time.perf_counter, spreads: list | None = None) -> float:
    """The median of `repeats` timed calls of `run` (after one warm-up), on `clock`: an op as a model meets it again
    and again, not its luckiest run (the fastest of 5 put the bench's predictions 15% under). Appends the slowest
    over the fastest to `spreads` (how steady the machine was)."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        sync()
        times.append(clock() - start)
    if spreads is not None and min(times) > 0:
        spreads.append(max(times) / min(times))
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
    top = TFLOPS_BOUNDS[1]  # no difference measured: the fastest a device can be (planning/time/profiles.py)
    rate = min(4 * scores * (large - small) / extra / 1e12, top) if extra > 0 else top  # the FLOPs the larger heads add
    per_score = max(seconds[small] - 4 * scores * small / (rate * 1e12), seconds[small] * 0.05) / scores
    return round(per_score, 15), round(rate, 6)


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
        curve.append([flops, round(min(flops / seconds / 1e12, TFLOPS_BOUNDS[1]), 6)])
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
        curve.append([flops, round(min(flops / seconds / 1e12, TFLOPS_BOUNDS[1]), 6)])
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
    page cache after the first step) and casts them (run/load/loading.py `_load_streamed`), tensor by tensor."""
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
    torch.distributed's own calls (as `run/ranks/pipeline_links.py` sends): a round trip of one float is two latencies, one
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


def check_device(device: str | None) -> str:
    """The device to measure ("cpu", "cuda:N"; None: the first GPU, else the CPU), checked before anything is
    measured: cuda:N in ASCII digits, and a GPU this machine has (UsageError, one sentence)."""
    if device is not None and device != "cpu" and not re.fullmatch(r"cuda:[0-9]{1,4}", device):
        raise UsageError(f"--device must be cpu or cuda:N (N a GPU's number in digits 0-9), not "
                         f"{shorten(device, quote=True)}.")
    import torch  # lazy: torch (heavy, off start-up)

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        return "cuda:0" if count else "cpu"
    if device.startswith("cuda:") and int(device[5:]) >= count:
        has = "no CUDA GPU" if not count else f"{count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
        raise UsageError(f"--device {device}: this machine has {has}; measure another or the CPU (--device cpu).")
    return device


def check_profile_output(output: str, overwrite: bool) -> Path:
    """The profile's file (-o), checked before anything is measured: not a folder, in a folder that exists and
    takes files, an existing one replaced only with --overwrite (io/atomic.py's policy)."""
    path = Path(output).expanduser()
    check_writable_file(path, "-o", "profile.json")
    refuse_existing([path], overwrite)
    return path


BUSY_LOAD_PER_CORE = 0.5  # a load average above half the cores: others' work takes turns with the measurements
BUSY_SPREAD = 1.5  # repeated measurements whose slowest runs 1.5x the fastest (the median over all measured)


@dataclass(frozen=True)
class MachineLoad:
    """How busy the machine was: its load average before measuring against its cores, and the spread of repeated
    measurements (the median of slowest / fastest; 0: not measured yet)."""

    load: float | None  # None: no load average here (Windows)
    cores: int
    spread: float = 0.0

    @property
    def busy(self) -> bool:
        return (self.load is not None and self.load > BUSY_LOAD_PER_CORE * self.cores) or self.spread > BUSY_SPREAD

    def words(self) -> str:
        load = f"load average {format_figure(self.load, 3)} on {self.cores} core(s)" if self.load is not None else ""
        spread = f"repeated measurements {format_figure(self.spread, 3)}x apart" if self.spread else ""
        return "; ".join(part for part in (load, spread) if part)

    def to_json(self) -> dict:
        return {"load_average": self.load, "cores": self.cores, "spread": self.spread, "busy": self.busy}


def machine_load() -> MachineLoad:
    """The 1-minute load average now against the cores (before measuring: calibrate's own threads not counted)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return MachineLoad(load, os.cpu_count() or 1)


@dataclass(frozen=True)
class Calibration:
    """What `measure` found: the profile and the spread of its repeated measurements."""

    profile: DeviceProfile
    spread: float  # the median over the measurements of slowest / fastest repeat


class _Steps:
    """Progress as "what (step k of n)": each phase of the measurement says what it measures and how far it is."""

    def __init__(self, total: int, on_progress):
        self.total, self.done, self.on_progress = total, 0, on_progress or (lambda message: None)

    def __call__(self, what: str) -> None:
        self.done += 1
        self.on_progress(f"{what} (step {self.done} of {self.total})")


def calibrate(sizes: CalibrationSizes | None = None, device: str | None = None,
              on_progress=None) -> DeviceProfile:
    """Measure the device (`device`: "cpu", "cuda:0"; None: the first GPU, else the CPU) into a profile."""
    return measure(sizes, device, on_progress).profile


def measure(sizes: CalibrationSizes | None = None, device: str | None = None, on_progress=None) -> Calibration:
    """Measure the device (checked: `check_device`) into a profile, with the spread of its repeats; UsageError when a
    figure is not a device's (planning/time/profiles.py's bounds: a machine too busy to measure)."""
    import torch  # lazy: torch (heavy, off start-up)

    sizes = sizes or CalibrationSizes()
    target = torch.device(check_device(device))
    gpu = target.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(target)) if gpu else (lambda: None)
    clock = time.thread_time if not gpu and torch.get_num_threads() == 1 else time.perf_counter
    spreads: list[float] = []  # the thread does all the work on one thread: its CPU clock, which the machine's

    def timed(run, repeats, sync):  # other load does not inflate (a wall clock there counts the others' turns)
        return _best(run, repeats, sync, clock, spreads)

    dtypes = ("float32", "bfloat16", "float16") if gpu else ("float32", "bfloat16")
    say = _Steps(3 * len(dtypes) + 4 + (gpu or bool(sizes.link_mib)), on_progress)
    with torch.inference_mode():
        rates = {name: _dtype_rates(torch, target, getattr(torch, name), name, sizes, timed, sync, say)
                 for name in dtypes}
        device_rates = _device_rates(torch, target, gpu, sizes, timed, sync, say)
    name = torch.cuda.get_device_name(target) if gpu else (platform.processor() or platform.machine() or "cpu")
    where = f"{name}, {torch.get_num_threads()} torch thread(s)" if not gpu else name
    spread = round(statistics.median(spreads), 3) if spreads else 0.0
    source = (f"measured by dmap calibrate on {platform.node() or 'this machine'} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} ({where}; load average "
              f"{machine_load().load or 0:.1f}; repeats {spread:.2f}x apart; "
              f"{'thread CPU' if clock is time.thread_time else 'wall'} clock; sizes: matmuls up to "
              f"{max(sizes.matmul)}, up to {max(sizes.tokens)} tokens, {sizes.memory_mib} MiB)")
    profile = _profile(where, gpu, rates, device_rates, source)
    try:
        DeviceProfile.from_json(profile.to_json())  # within a device's bounds, as dmap plan will read it
    except ValueError as error:
        raise UsageError(f"The measured figures are not a device's ({error}): the machine was too busy to measure; "
                         "run dmap calibrate again when it is quiet.") from None
    return Calibration(profile, spread)


def _dtype_rates(torch, target, dtype, name: str, sizes: CalibrationSizes, timed, sync, say) -> dict:
    """One dtype's matmul curve and rate, attention curve, fit and rows, and conv curve."""
    say(f"Measuring matmuls of {', '.join(map(str, sizes.matmul))} in {name}")
    curve = []
    for n in sizes.matmul:
        a, b = torch.randn(n, n, device=target, dtype=dtype), torch.randn(n, n, device=target, dtype=dtype)
        seconds = timed(lambda a=a, b=b: torch.mm(a, b), sizes.repeats, sync)
        curve.append([2 * n**3, round(min(2 * n**3 / seconds / 1e12, TFLOPS_BOUNDS[1]), 6)])
    say(f"Measuring attention over {', '.join(map(str, sizes.tokens))} tokens in {name}")
    attention_curve = _attention_curve(torch, target, dtype, sizes, timed, sync)
    score, attention = _attention_fit(torch, target, dtype, max(sizes.tokens), timed, sizes.repeats, sync)
    row = _row_seconds(torch, target, dtype, max(sizes.tokens), score, attention, timed, sizes.repeats, sync)
    say(f"Measuring 3x3 convolutions of {', '.join(map(str, sizes.conv_channels))} channels in {name}")
    return {"matmul_curve": curve, "matmul": max(rate for _, rate in curve), "attention_curve": attention_curve,
            "score": score, "attention": attention, "row": row,
            "conv_curve": _conv_curve(torch, target, dtype, sizes, timed, sync)}


def _device_rates(torch, target, gpu: bool, sizes: CalibrationSizes, timed, sync, say) -> dict:
    """The rates that are the device's whatever the dtype: elementwise, memory, fixed costs, host and link."""
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
    say("Measuring the fixed cost of one op and of accelerate's hook around a module")
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
    return {"elementwise": elementwise, "memory": memory, "op_seconds": op_seconds, "hook": hook, "host": host,
            "link": link, "words": words, "gloo": gloo}


def _profile(where: str, gpu: bool, rates: dict, device: dict, source: str) -> DeviceProfile:
    """The measured figures as a profile, rounded as the profile file keeps them."""
    def per_dtype(key: str, digits: int | None = None):
        return {k: (round(v[key], digits) if digits is not None else v[key]) for k, v in rates.items()}

    gloo = device["gloo"]
    return DeviceProfile(where, "gpu" if gpu else "cpu", per_dtype("matmul", 4), per_dtype("attention", 4),
                         round(device["memory"], 3), round(device["host"], 3), round(device["link"], 3),
                         device["words"], round(device["op_seconds"], 9), source, True, per_dtype("matmul_curve"),
                         per_dtype("attention_curve"), round(device["elementwise"], 3),
                         round(device["hook"], 9) or 1e-9, per_dtype("score"), per_dtype("row"),
                         per_dtype("conv_curve"), round(gloo.latency_s, 9), round(gloo.collective_latency_s, 9),
                         round(gloo.collective_gbps, 3))

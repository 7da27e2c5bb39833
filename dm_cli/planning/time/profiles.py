"""Device profiles: the rates the step-time prediction (`step_time.py`) divides the work of a step by.

A profile is what `dmap calibrate` measured on this machine (written as JSON; `read_profile` checks it, a
profile file being input like any other) or one row of `GPU_TABLE`: the vendors' published peaks, dense (no
sparsity), with the datasheet each figure comes from. Published peaks are upper bounds: a denoiser's matmuls
reach perhaps 50-70% of them, which is why a measured profile is the better basis. Pure but for the file read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.io.cache import cache_dir
from dm_cli.planning.time import gpu_rates
from dm_cli.planning.trace.gpu_kernels import COMPUTE_CAPABILITY
from dm_cli.units import shorten

PROFILE_FORMAT = "dmap-device-profile"
PROFILE_VERSION = 1
PROFILE_DTYPES = ("float32", "bfloat16", "float16")
MAX_PROFILE_BYTES = 1_000_000
# What a device can be (outside, not a device: a rate of 5e-324 TFLOP/s made every predicted second infinite). The
# slowest CPU thread still runs a megaFLOP a second; the fastest accelerator runs under 10 PFLOP/s dense; memory,
# copies and links run from 1 MB/s (a disk under load) to 100 TB/s; a fixed cost per op or message is under a second.
TFLOPS_BOUNDS = (1e-6, 1e4)
GBPS_BOUNDS = (1e-3, 1e5)
SECONDS_BOUNDS = (0.0, 1.0)
FLOPS_PER_OP_BOUNDS = (1.0, 1e18)


@dataclass(frozen=True)
class DeviceProfile:
    """One device's rates: matmul and attention TFLOP/s per dtype, memory GB/s, host->device and device->device
    GB/s (the link between two of them), a fixed seconds per dispatched op (the host's cost of each kernel or CPU
    op: what dominates a small model), and where the figures come from."""

    name: str
    kind: str  # "gpu" or "cpu"
    matmul_tflops: dict[str, float]
    attention_tflops: dict[str, float]
    memory_gbps: float
    host_gbps: float  # offloaded weights streamed in each step: read from the checkpoint (and copied to the GPU)
    link_gbps: float  # device <-> device (a split's hops, the parallel layouts' exchanges)
    link: str = ""  # the link, in words ("NVLink 4, 900 GB/s", "PCIe 5 x16")
    op_seconds: float = 0.0
    source: str = ""  # "measured by dmap calibrate on HOST at DATE" or the datasheets
    measured: bool = False
    # measured only: the rate by the size of one op, dtype -> [[FLOPs of one op, TFLOP/s], ...] ascending (a small
    # matmul runs far below the peak), and GB/s of a denoiser's elementwise mix (add, mul, GELU, SiLU, norms, cat)
    matmul_curve: dict[str, list] = field(default_factory=dict)
    attention_curve: dict[str, list] = field(default_factory=dict)
    elementwise_gbps: float = 0.0
    hook_seconds: float = 0.0  # accelerate's hook around each module of a split or offloaded denoiser, per call
    # measured only: attention = scores x seconds per score + FLOPs / attention_tflops (dtype -> seconds per query-key
    # score: the softmax's share, which a small head dimension does not shrink)
    score_seconds: dict[str, float] = field(default_factory=dict)
    # measured only: seconds per query row of attention (dtype -> seconds: the kernel's fixed work per row, which a
    # short key length, a cross-attention's 77 text tokens, does not spread over many scores)
    row_seconds: dict[str, float] = field(default_factory=dict)
    # measured only: the convolutions' rate by the size of one op (a conv of a few channels runs far below a matmul
    # of the same FLOPs); none: convolutions at the matmul curve
    conv_curve: dict[str, list] = field(default_factory=dict)
    # seconds per message on the link (its fixed cost, what a small exchange pays whatever its bytes): measured
    # between two CPU ranks (gloo over loopback); 0 for the table's GPU links and older profiles (bytes alone)
    link_latency_s: float = 0.0
    # seconds per collective between two CPU ranks beyond its bytes (an all-to-all of two floats as diffusers' Ulysses
    # attention makes it: functional collectives and a wait, several messages' cost); 0: the link's latency
    collective_latency_s: float = 0.0
    collective_gbps: float = 0.0  # that all-to-all's rate (the bytes a rank sends over its extra seconds); 0: link_gbps

    def rate(self, table: dict[str, float], dtype: str) -> float:
        """TFLOP/s at `dtype`, else at the nearest dtype measured (half precision for half, else float32)."""
        for candidate in (dtype, "bfloat16" if dtype == "float16" else "float16", "float32", *table):
            if candidate in table:
                return table[candidate]
        raise ValueError(f"profile {self.name!r} has no rates")

    def rate_at(self, kind: str, dtype: str, flops_per_op: float) -> float:
        """TFLOP/s of one `kind` ("matmul", "conv" or "attention") op of `flops_per_op` FLOPs at `dtype`: interpolated on the
        measured curve (log-log, held at its ends), else the flat rate."""
        curve = getattr(self, f"{kind}_curve").get(dtype) or (getattr(self, f"{kind}_curve").get(
            "bfloat16" if dtype == "float16" else dtype))
        if kind == "conv" and (not curve or flops_per_op <= 0):  # none measured: the matmul curve
            return self.rate_at("matmul", dtype, flops_per_op)
        if not curve or flops_per_op <= 0:
            return self.rate(getattr(self, f"{kind}_tflops"), dtype)
        if flops_per_op <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
            if flops_per_op <= x1:
                t = math.log(flops_per_op / x0) / math.log(x1 / x0)
                return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
        return curve[-1][1]

    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name, "kind": self.kind,
                "matmul_tflops": dict(self.matmul_tflops), "attention_tflops": dict(self.attention_tflops),
                "memory_gbps": self.memory_gbps, "host_gbps": self.host_gbps, "link_gbps": self.link_gbps,
                "link": self.link, "op_seconds": self.op_seconds, "source": self.source, "measured": self.measured,
                **({"matmul_curve": self.matmul_curve, "attention_curve": self.attention_curve}
                   if self.matmul_curve or self.attention_curve else {}),
                **({"elementwise_gbps": self.elementwise_gbps} if self.elementwise_gbps else {}),
                **({"hook_seconds": self.hook_seconds} if self.hook_seconds else {}),
                **({"score_seconds": dict(self.score_seconds)} if self.score_seconds else {}),
                **({"row_seconds": dict(self.row_seconds)} if self.row_seconds else {}),
                **({"conv_curve": self.conv_curve} if self.conv_curve else {}),
                **({"link_latency_s": self.link_latency_s} if self.link_latency_s else {}),
                **({"collective_latency_s": self.collective_latency_s} if self.collective_latency_s else {}),
                **({"collective_gbps": self.collective_gbps} if self.collective_gbps else {})}

    @classmethod
    def from_json(cls, data) -> "DeviceProfile":
        """A profile document, every field checked (ValueError, one sentence)."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"it is not a {PROFILE_FORMAT} v{PROFILE_VERSION} document (write one with dmap calibrate)")
        rates = {}
        for key in ("matmul_tflops", "attention_tflops"):
            table = data.get(key)
            if not isinstance(table, dict) or not table or not set(table) <= set(PROFILE_DTYPES):
                raise ValueError(f"its {key} must map some of {', '.join(PROFILE_DTYPES)} to TFLOP/s")
            rates[key] = {k: _rate(v, f"its {key} {k}", TFLOPS) for k, v in table.items()}
        kind = data.get("kind")
        if kind not in ("gpu", "cpu"):
            raise ValueError(f"its kind must be \"gpu\" or \"cpu\", found {shorten(kind, quote=True)}")
        op_seconds = data.get("op_seconds", 0.0)
        if isinstance(op_seconds, bool) or not isinstance(op_seconds, (int, float)) or not 0 <= op_seconds <= 1:
            raise ValueError(f"its op_seconds must be a number from 0 to 1, found {shorten(op_seconds, quote=True)}")
        gbps = {key: _rate(data[key], f"its {key}", GBPS) if key in data else 0.0
                for key in ("elementwise_gbps", "collective_gbps")}
        seconds = {key: _rate(data[key], f"its {key}", SECONDS) if key in data else 0.0
                   for key in ("hook_seconds", "link_latency_s", "collective_latency_s")}
        return cls(_text(data.get("name"), "name"), kind, rates["matmul_tflops"], rates["attention_tflops"],
                   _rate(data.get("memory_gbps"), "its memory_gbps", GBPS),
                   _rate(data.get("host_gbps"), "its host_gbps", GBPS),
                   _rate(data.get("link_gbps"), "its link_gbps", GBPS), _text(data.get("link", ""), "link"),
                   float(op_seconds), _text(data.get("source", ""), "source"), data.get("measured") is True,
                   _curves(data.get("matmul_curve", {}), "matmul_curve"),
                   _curves(data.get("attention_curve", {}), "attention_curve"),
                   gbps["elementwise_gbps"], seconds["hook_seconds"],
                   _seconds_table(data.get("score_seconds", {}), "score_seconds"),
                   _seconds_table(data.get("row_seconds", {}), "row_seconds"),
                   _curves(data.get("conv_curve", {}), "conv_curve"),
                   seconds["link_latency_s"], seconds["collective_latency_s"], gbps["collective_gbps"])


def _seconds_table(value, what: str) -> dict[str, float]:
    if not isinstance(value, dict) or not set(value) <= set(PROFILE_DTYPES):
        raise ValueError(f"its {what} must map some of {', '.join(PROFILE_DTYPES)} to seconds")
    return {k: _rate(v, f"its {what} {k}", SECONDS) for k, v in value.items()}


def _curves(value, what: str) -> dict[str, list]:
    """A profile's rate curves: dtype -> ascending [[FLOPs per op, TFLOP/s], ...] (ValueError, one sentence)."""
    if not isinstance(value, dict) or not set(value) <= set(PROFILE_DTYPES):
        raise ValueError(f"its {what} must map some of {', '.join(PROFILE_DTYPES)} to [[FLOPs, TFLOP/s], ...]")
    out = {}
    for dtype, points in value.items():
        if not isinstance(points, list) or not 1 <= len(points) <= 64 or not all(
                isinstance(p, list) and len(p) == 2 for p in points):
            raise ValueError(f"its {what} {dtype} must be a list of 1 to 64 [FLOPs, TFLOP/s] pairs")
        pairs = [[_rate(x, f"its {what} {dtype} FLOPs", FLOPS_PER_OP), _rate(y, f"its {what} {dtype} TFLOP/s", TFLOPS)]
                 for x, y in points]
        if any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:])):
            raise ValueError(f"its {what} {dtype} must list FLOPs in ascending order")
        out[dtype] = pairs
    return out


TFLOPS = (TFLOPS_BOUNDS, "TFLOP/s")
GBPS = (GBPS_BOUNDS, "GB/s")
SECONDS = (SECONDS_BOUNDS, "seconds")
FLOPS_PER_OP = (FLOPS_PER_OP_BOUNDS, "FLOPs")


def _rate(value, what: str, kind: tuple) -> float:
    """A number within `kind`'s bounds (above the low one when it is 0), ValueError (one sentence) else: a figure
    outside them is not a device's, and would make a predicted time infinite or zero."""
    (low, high), unit = kind
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if low == 0 else low <= value) or not value <= high:
        bound = f"above 0 and at most {high:g}" if low == 0 else f"from {low:g} to {high:g}"
        raise ValueError(f"{what} must be {bound} {unit} (outside that it is not a device's), found "
                         f"{shorten(value, quote=True)}")
    return float(value)


def _text(value, what: str) -> str:
    if not isinstance(value, str) or len(value) > 500:
        raise ValueError(f"its {what} must be a string of at most 500 characters")
    return value


# Dense bf16/fp16 tensor-core peaks (TFLOP/s, without sparsity), memory bandwidth and the GPU-to-GPU link, as
# published. Attention runs near the matmul rate in flash kernels; the table gives it the same peak.
_NVLINK_NOTE = "NVLink bandwidth is the total of both directions per GPU"
GPU_TABLE: dict[str, dict] = {
    "h100-sxm": {"tflops": 989.0, "memory_gbps": 3350.0, "link_gbps": 450.0, "link": "NVLink 4, 900 GB/s both ways",
                     "source": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)"},
    "h100-pcie": {"tflops": 756.0, "memory_gbps": 2000.0, "link_gbps": 64.0, "link": "PCIe 5 x16 (NVLink bridge: 600 GB/s)",
                      "source": "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column)"},
    "h200-sxm": {"tflops": 989.0, "memory_gbps": 4800.0, "link_gbps": 450.0, "link": "NVLink 4, 900 GB/s both ways",
                     "source": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)"},
    "h200-nvl": {"tflops": 835.0, "memory_gbps": 4800.0, "link_gbps": 64.0, "link": "PCIe 5 x16 (2/4-way NVLink bridge)",
                     "source": "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL column)"},
    "a100-40gb": {"tflops": 312.0, "memory_gbps": 1555.0, "link_gbps": 300.0, "link": "NVLink 3, 600 GB/s both ways (SXM)",
                      "source": "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM)"},
    "a100-80gb": {"tflops": 312.0, "memory_gbps": 2039.0, "link_gbps": 300.0, "link": "NVLink 3, 600 GB/s both ways (SXM)",
                      "source": "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)"},
    "l40s": {"tflops": 362.0, "memory_gbps": 864.0, "link_gbps": 32.0, "link": "PCIe 4 x16, no NVLink",
                 "source": "NVIDIA L40S datasheet (733 TFLOPS with sparsity, half dense)"},
    "rtx-4090": {"tflops": 165.2, "memory_gbps": 1008.0, "link_gbps": 32.0, "link": "PCIe 4 x16, no NVLink",
                     "source": "NVIDIA Ada GPU architecture whitepaper (RTX 4090, FP16 tensor with FP32 accumulate 165.2)"},
    "rtx-5090": {"tflops": 209.5, "memory_gbps": 1792.0, "link_gbps": 64.0, "link": "PCIe 5 x16, no NVLink",
                     "source": "NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090, dense FP16 tensor)"},
    "l4": {"tflops": 121.0, "memory_gbps": 300.0, "link_gbps": 32.0, "link": "PCIe 4 x16, no NVLink",
               "source": "NVIDIA L4 Tensor Core GPU datasheet (242 TFLOPS FP16 tensor with sparsity, half dense)"},
    "l20": {"tflops": 119.5, "memory_gbps": 864.0, "link_gbps": 32.0, "link": "PCIe 4 x16, no NVLink",
                "source": "NVIDIA L20 product brief (119.5 TFLOPS FP16 tensor dense, 48 GB GDDR6 at 864 GB/s)"},
    "a10g": {"tflops": 125.0, "memory_gbps": 600.0, "link_gbps": 32.0, "link": "PCIe 4 x16, no NVLink",
                 "source": "NVIDIA A10 Tensor Core GPU datasheet (125 TFLOPS FP16 tensor dense, 600 GB/s); AWS's A10G "
                        "(g5 instances) is its variant with the same memory: its tensor peak is not published apart"},
    "rtx-3090": {"tflops": 71.0, "memory_gbps": 936.0, "link_gbps": 32.0, "link": "PCIe 4 x16 (NVLink bridge: 112.5 GB/s)",
                     "source": "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090, FP16 tensor with FP16 "
                            "accumulate 142 dense; 71 with FP32 accumulate, as PyTorch runs it)"},
}
HOOK_SECONDS = 2e-5  # accelerate's AlignDevicesHook around one module call: Python, about 14 us measured on this CPU
GPU_HOST_GBPS = {"PCIe 4": 25.0, "PCIe 5": 50.0}  # pinned host -> device copies, about 80% of the bus


def table_profile(name: str) -> DeviceProfile:
    """The profile of one row of `GPU_TABLE` (UsageError naming the rows when it has none)."""
    row = GPU_TABLE.get(name.lower())
    if row is None:
        raise UsageError(f"dmap has no published figures for {shorten(name, quote=True)}: use one of "
                         f"{', '.join(GPU_TABLE)}, or measure this machine with dmap calibrate.")
    host = GPU_HOST_GBPS["PCIe 5"] if name.startswith(("h1", "h2", "rtx-5")) else GPU_HOST_GBPS["PCIe 4"]
    half = {"bfloat16": row["tflops"], "float16": row["tflops"]}
    capability = COMPUTE_CAPABILITY.get(name.lower(), (8, 0))  # sustained rates by the kernels' rules (gpu_rates.py)
    curve = gpu_rates.matmul_curve(row["tflops"], capability)
    flash = gpu_rates.attention_tflops(row["tflops"], capability)
    fp32 = gpu_rates.FP32_TFLOPS.get(name.lower(), row["tflops"] / 2)
    return DeviceProfile(name, "gpu", {**half, "float32": fp32}, {"bfloat16": flash, "float16": flash},
                         row["memory_gbps"], host, row["link_gbps"], row["link"], 5e-6,
                         row["source"] + f"; {_NVLINK_NOTE}; sustained rates from {gpu_rates.RATE_SOURCES}",
                         matmul_curve={"bfloat16": curve, "float16": curve},
                         elementwise_gbps=gpu_rates.stream_gbps(row["memory_gbps"]), hook_seconds=HOOK_SECONDS)


# The profile a plan uses when given none and none is cached: the time model's old defaults (100 TFLOP/s sustained,
# a PCIe 4 x16 link), so that a plan without a profile predicts as it always did.
DEFAULT_PROFILE = DeviceProfile("default", "gpu", {"bfloat16": 100.0, "float16": 100.0, "float32": 50.0},
                                {"bfloat16": 100.0, "float16": 100.0, "float32": 50.0}, 1000.0, 25.0, 25.0,
                                "PCIe 4 x16", 5e-6, "dmap's defaults (--device-tflops 100, --link-gbps 25): no profile "
                                "given and none calibrated (dmap calibrate)", hook_seconds=HOOK_SECONDS)


def default_profile_path() -> Path:
    """Where `dmap calibrate` writes this machine's profile, and where `dmap plan` looks for it."""
    return cache_dir() / "profiles" / "device.json"


def read_profile(path: str | Path) -> DeviceProfile:
    """A profile file, or a row of GPU_TABLE by name (`table:h100-sxm`); UsageError (one sentence) when it is
    missing, not a regular file, too large, nested too deeply, not JSON or not a valid profile."""
    text = str(path)
    if text.startswith("table:"):
        return table_profile(text[len("table:"):])
    try:
        return _profile_file(Path(text).expanduser())
    except _Unusable as error:
        raise UsageError(f"The device profile {text} cannot be used: {error}.") from None


class _Unusable(Exception):
    """Why a profile file cannot be used, as a clause."""


def _profile_file(file: Path) -> DeviceProfile:
    """The profile in `file`, read as hostile input: a regular file only, refused before opening otherwise (a FIFO
    would block the open, /dev/zero never ends), read up to MAX_PROFILE_BYTES (st_size says 0 for both), any decoding
    error (RecursionError included: json's C scanner recurses once per "[") one clause."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):
            raise _Unusable("it is not a regular file (a folder, a device or a FIFO)")
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # swapped for a FIFO since: no wait
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise _Unusable("it is not a regular file (a folder, a device or a FIFO)")
            data = handle.read(MAX_PROFILE_BYTES + 1)
    except FileNotFoundError:
        raise _Unusable("it does not exist (write one with dmap calibrate)") from None
    except OSError as error:
        raise _Unusable(f"it cannot be read ({error.strerror or error})") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise _Unusable(f"it is larger than {MAX_PROFILE_BYTES:,} bytes, which no profile dmap calibrate writes is")
    try:
        document = json.loads(data.decode("utf-8"))
        return DeviceProfile.from_json(document)
    except RecursionError:
        raise _Unusable("it is nested too deeply to be a profile dmap calibrate wrote") from None
    except UnicodeDecodeError:
        raise _Unusable("it cannot be read as JSON (write one with dmap calibrate)") from None
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError):
            raise _Unusable("it cannot be read as JSON (write one with dmap calibrate)") from None
        raise _Unusable(str(error)) from None


def cached_profile() -> DeviceProfile | None:
    """This machine's calibrated profile when `dmap calibrate` wrote one and it still reads, else None: a damaged
    one never stops a plan (`cached_profile_problem` says why it was ignored)."""
    path = default_profile_path()
    if not os.path.lexists(path):
        return None
    try:
        return _profile_file(path)
    except _Unusable:
        return None


def cached_profile_problem() -> str | None:
    """One sentence when this machine's calibrated profile exists but cannot be used (None when it reads or there
    is none), naming the file and the command that writes it again."""
    path = default_profile_path()
    if not os.path.lexists(path):
        return None
    try:
        _profile_file(path)
    except _Unusable as error:
        why = str(error).replace(" (write one with dmap calibrate)", "")
        return f"The calibrated device profile {path} was ignored ({why}): dmap calibrate measures this machine again."
    return None


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a plan predicts with and why that one."""

    profile: DeviceProfile = DEFAULT_PROFILE
    origin: str = "default"  # "file", "cached" or "default"
    path: str = ""
    extra: dict = field(default_factory=dict)

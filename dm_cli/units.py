"""Sizes, dtypes and device specs: the small vocabulary every command shares.

Pure Python, no torch: `dmap --help` and the planner import this.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from dm_cli.devices import device_key, device_rank
from dm_cli.errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# No device, file or checkpoint holds more than 1 EiB: a larger size is a typo (or 400 nines, which
# float() makes infinite). Every size dmap reads (--max-memory, --overhead, --max-shard-size,
# --chunk-memory, plan files, index total_size) is refused above it.
MAX_SIZE_BYTES = 2**60
MAX_SIZE_TEXT = "1 EiB"
# Larger GPU indices name no GPU any machine has (--max-memory, plan files).
MAX_GPU_INDEX = 1023


def parse_size(text: str | int) -> int:
    """`16GB` = 16e9, `16GiB` = 16*2**30, case-insensitive (unlike accelerate, `gb` is never bits).

    Exact decimal arithmetic (no float: it overflows to inf and rounds large sizes), at most 1 EiB."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"Size {text} is negative.")
        return check_size_bound(text, "Size " + shorten(text))
    match = _SIZE_RE.match(str(text))
    if not match:
        if str(text).strip().startswith("-"):
            raise UsageError(f"Size '{text}' is negative: sizes must be zero or more.")
        raise UsageError(f"Cannot read size '{text}': use a number with a unit such as 500MB, 16GB or 16GiB.")
    number, unit = match.groups()
    unit = unit.upper()
    if unit not in _UNITS:
        raise UsageError(f"Unknown unit '{match.group(2)}' in size '{text}': use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB.")
    if len(number.partition(".")[0].lstrip("0")) > 40:  # 40 digits before the point: refused before arithmetic
        raise UsageError(f"Size '{shorten(text)}' is more than {MAX_SIZE_TEXT}: no device or file is that large.")
    value = int((Decimal(number) * _UNITS[unit]).to_integral_value())  # round half even, as round() did
    return check_size_bound(value, f"Size '{shorten(text)}'")


def check_size_bound(value: int, what: str) -> int:
    """`value` when it is at most 1 EiB, else a UsageError saying `what` is too large."""
    if value > MAX_SIZE_BYTES:
        raise UsageError(f"{what} is more than {MAX_SIZE_TEXT}: no device or file is that large.")
    return value


def shorten(text, limit: int = 40, quote: bool = False) -> str:
    """Text (or an int of any size) for a message, at most about `limit` characters; `quote`: as repr()."""
    if isinstance(text, int) and text.bit_length() > 4 * limit:
        return f"a number of about {int(text.bit_length() * 0.30103)} digits"
    text = repr(text) if quote else str(text).strip()
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-8:]}"


def format_size(num_bytes: int | float, binary: bool = False) -> str:
    """Decimal units by default, as the Hub and diffusers print them."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "KB", "MB", "GB", "TB"])
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in units:
        if value < base or unit == units[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def format_figure(value: float, digits: int = 4) -> str:
    """A measured or predicted figure for people, at most `digits` significant digits: 2,000 not 2e+03, 0.0935 not
    0.09351234, 123,500 not 123456.7; an exponent only below 0.001 or from 10^15 up (1.235e+15, never 300 digits)."""
    if not math.isfinite(value) or value == 0:
        return "0" if value == 0 else str(value)
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude < -3 or magnitude >= 15:
        return f"{value:.{digits}g}"
    decimals = digits - 1 - magnitude
    rounded = round(value, decimals)
    if decimals <= 0:
        return f"{rounded:,.0f}"
    return f"{rounded:.{decimals}f}".rstrip("0").rstrip(".")


def numel(shape) -> int:
    """Elements of a tensor of this shape (1 for a scalar)."""
    count = 1
    for dim in shape:
        count *= dim
    return count


# dtype names as torch spells them, with the sizes the planner needs without importing torch.
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e8m0fnu": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex64": 8,
}
FLOATING_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}

# safetensors header spellings <-> torch spellings
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
# Sub-byte dtypes safetensors knows (bits per element): valid in a header, but dmap cannot size them.
SUBBYTE_DTYPES = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

DTYPE_ALIASES = {  # what --dtype (and a plain dtype in --weights) accepts
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def parse_dtype(text: str) -> str:
    """`bf16|fp16|fp32` (or torch spellings) -> torch dtype name. Callers test `is not None`, never
    truthiness: an empty --dtype is an unknown dtype, not the default."""
    name = DTYPE_ALIASES.get(str(text).strip().lower()) if isinstance(text, str) else None
    if name is None:
        raise UsageError(f"Unknown dtype '{shorten(text)}': use bf16, fp16 or fp32.")
    return name


# A plain number below this in --max-memory is almost surely a forgotten unit (0=16 meaning 16GB).
MIN_PLAIN_DEVICE_BYTES = 10**6


@dataclass(frozen=True)
class DeviceBudget:
    """One device of the target machine and the bytes dmap may use on it."""

    device: int | str  # GPU index, "cpu", "mps" or "disk"
    capacity_bytes: int | None  # None: unlimited (disk only)

    @property
    def key(self) -> str:
        return str(self.device)

    @property
    def is_gpu(self) -> bool:
        return isinstance(self.device, int) or self.device == "mps"


def _parse_device_name(name: str) -> int | str:
    try:
        device = device_key(name)
    except ValueError:
        raise UsageError(f"Unknown device '{shorten(name.strip().lower())}' in --max-memory: use a GPU index (0), "
                         "cuda:N, cpu, mps or disk.") from None
    if isinstance(device, int) and device > MAX_GPU_INDEX:
        raise UsageError(f"GPU index {shorten(device)} in --max-memory is above {MAX_GPU_INDEX}: no machine has it.")
    return device


def parse_device_spec(spec: str) -> list[DeviceBudget]:
    """`0=16GB,1=16GB,cpu=64GB,disk` -> budgets in placement order: GPUs, mps, cpu, disk."""
    budgets: dict[int | str, DeviceBudget] = {}
    if not spec or not spec.strip():
        raise UsageError("--max-memory is empty: give devices like 0=16GB,1=16GB,cpu=64GB.")
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"Empty entry in --max-memory '{spec}'.")
        name, equals, size_text = item.partition("=")
        if not equals and name.strip().lower() != "disk" and _SIZE_RE.match(name):
            raise UsageError(
                f"--max-memory entry '{name.strip()}' names no device: write 0={name.strip()} for GPU 0 "
                f"(0={name.strip()},1={name.strip()} for two) or cpu={name.strip()}."
            )
        device = _parse_device_name(name)
        if device in budgets:
            raise UsageError(f"Device '{name.strip()}' appears twice in --max-memory '{spec}'.")
        if not size_text.strip():
            if device != "disk":
                raise UsageError(f"Device '{name.strip()}' has no size in --max-memory: write it as {name.strip()}=16GB.")
            capacity = None
        else:
            capacity = parse_size(size_text)
            if size_text.strip().isdigit() and device != "disk" and 0 < capacity < MIN_PLAIN_DEVICE_BYTES:
                raise UsageError(
                    f"'{item}' in --max-memory is {capacity} bytes: give a unit, e.g. {name.strip()}={size_text.strip()}GB "
                    f"(plain numbers are bytes; write {name.strip()}={size_text.strip()}B if you really mean bytes)."
                )
            if device == "disk" and capacity == 0:
                raise UsageError("disk=0 in --max-memory: leave the size out (disk) for unlimited, or drop disk.")
        budgets[device] = DeviceBudget(device, capacity)
    return sorted(budgets.values(), key=_device_rank)


def _device_rank(budget: DeviceBudget) -> tuple[int, int]:
    return device_rank(budget.device)

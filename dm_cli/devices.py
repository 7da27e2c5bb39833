"""Device names and device maps, answered once for dmap: what a device name means, which device_map
entry places a tensor or module, and where a component computes.

No torch at import (plans and reports use this module); `torch_device` imports it when called.
"""

from __future__ import annotations

NAMED_DEVICES = ("cpu", "mps", "disk")


def device_key(value) -> int | str:
    """0, "0", "cuda:0" -> 0; "cpu", "mps", "disk" as they are. Anything else: ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"not a device: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"not a device: {value!r}")
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text in NAMED_DEVICES:
        return text
    raise ValueError(f"not a device: {value!r}")


def device_rank(value) -> tuple[int, int]:
    """GPUs by index, then mps, cpu, disk: the order plans and tables list devices in."""
    key = device_key(value)
    return (0, key) if isinstance(key, int) else ({"mps": 1, "cpu": 2, "disk": 3}[key], 0)


def is_gpu(key) -> bool:
    return isinstance(key, int) or key == "mps"


def is_cuda(key) -> bool:
    """A CUDA GPU index (int, or its string form as plans and reports key devices)."""
    return isinstance(key, int) or str(key).isdigit()


def device_label(key) -> str:
    """How reports name a device: "GPU 0", "cpu", "mps", "disk"."""
    return f"GPU {key}" if is_cuda(key) else str(key)


def covers(entry: str, name: str) -> bool:
    """Whether the device_map entry `entry` places `name` (itself, anything under it, or everything for "")."""
    return entry == "" or name == entry or name.startswith(entry + ".")


def normalise_map(device_map: dict) -> dict:
    """A device_map with every device as `device_key` gives it (ints for GPUs)."""
    return {str(k): device_key(v) for k, v in device_map.items()}


def map_entry(name: str, device_map: dict):
    """The device_map key that places `name` (a tensor or module name), as accelerate matches them:
    the longest dotted prefix present, "" for the whole model; None when nothing covers it."""
    candidate = name
    while True:
        if candidate in device_map:
            return candidate
        if not candidate:
            return None
        candidate = candidate.rpartition(".")[0]


def device_of(name: str, device_map: dict, default=None):
    """The device the map gives `name`, or `default` when no entry covers it."""
    entry = map_entry(name, device_map)
    return default if entry is None else device_map[entry]


def streams_blocks(device_map: dict) -> bool:
    """Whether a run streams blocks of this component from cpu or disk to its execution device for each forward
    (accelerate's offload hooks, the weights on the meta device between calls): some sit there, and not all of it
    sits on the cpu (which then just runs it)."""
    where = {device_key(v) for v in device_map.values()}
    return bool(where & {"cpu", "disk"}) and where != {"cpu"}


def execution_device_key(device_map: dict):
    """Where a component computes: its first GPU (or mps) in map order, else the CPU."""
    for value in device_map.values():
        key = device_key(value)
        if is_gpu(key):
            return key
    return "cpu"


def torch_device(key, simulate: bool = False):
    """The torch.device of a device key; every device is the CPU under --simulate (disk runs on cpu)."""
    import torch  # lazy: torch (heavy, off start-up)

    if simulate or key in ("cpu", "disk"):
        return torch.device("cpu")
    if key == "mps":
        return torch.device("mps")
    return torch.device("cuda", int(key))

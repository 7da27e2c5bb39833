"""The devices a plan targets when no --max-memory is given (each local GPU's free memory, the available RAM),
this machine's RAM, and each device's overhead (--overhead)."""

from __future__ import annotations

import os

from dm_cli.devices import device_key
from dm_cli.errors import UsageError
from dm_cli.units import DeviceBudget, parse_size

# CUDA context (~300-600 MB) plus cuBLAS workspaces and caching-allocator slack, per GPU.
DEFAULT_GPU_OVERHEAD = 600 * 10**6


def local_devices() -> list[DeviceBudget]:
    """Free memory of each local GPU and the available RAM: the target when no --max-memory is given."""
    budgets: list[DeviceBudget] = []
    try:
        import torch  # here only: a plan for given --max-memory, and `dmap --help`, stay torch-free

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                free, _total = torch.cuda.mem_get_info(index)
                budgets.append(DeviceBudget(index, int(free)))
    except Exception:  # a broken CUDA install plans for cpu only
        budgets = []
    budgets.append(DeviceBudget("cpu", available_ram()))
    return budgets


def available_ram() -> int:
    try:
        import psutil  # optional: sysconf when it is missing

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def parse_overhead(spec: str | None, budgets: list[DeviceBudget], weights_only: bool) -> dict[str, int]:
    """Per-device overhead: 600 MB per GPU by default (0 for weights-only plans), 0 for cpu and disk."""
    default = 0 if weights_only and spec is None else DEFAULT_GPU_OVERHEAD
    overhead = {b.key: (default if b.is_gpu else 0) for b in budgets}
    if spec is not None:
        for item in spec.split(","):
            name, sep, size = item.strip().partition("=")
            if not sep or not size.strip():
                raise UsageError(f"--overhead entry '{item.strip()}' needs a size, like 0=600MB.")
            try:
                key = str(device_key(name))
            except ValueError:
                key = None
            if key not in overhead:
                raise UsageError(f"--overhead names device '{name.strip()}', which is not in --max-memory.")
            overhead[key] = parse_size(size.strip())
    return overhead


def total_ram() -> int | None:
    """This machine's physical memory (None when it cannot be read)."""
    try:
        import psutil  # optional: sysconf when it is missing

        return int(psutil.virtual_memory().total)
    except ImportError:
        try:
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None

"""What `dmap run` checks before it loads or plans anything: its outputs, its seed, its plan file.

A generation can take minutes; an output that cannot be written, a seed torch refuses or a broken
plan file must be reported at once (exit 2), not after the last denoising step.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError
from .planner import STRATEGIES

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def check_seed(seed: int, where: str) -> int:
    """One seed range for `--seed`, queue items and the API: what torch.Generator.manual_seed accepts."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise UsageError(f"{where} {seed} is out of range: use a whole number from {low} to {high}.")
    return seed


def check_run_request(output: str | None, save_latents: str | None, num_images: int | None, seed: int,
                      device_map: str) -> None:
    """Raise UsageError for anything about the outputs, seed or plan file that would fail later."""
    from .runner import image_paths

    check_seed(seed, "--seed")
    targets = [(path, "--output") for path in (image_paths(output, num_images or 1) if output else [])]
    if save_latents:
        targets.append((Path(save_latents), "--save-latents"))
    seen: dict[Path, str] = {}
    for path, option in targets:
        _check_writable_file(path, option)
        resolved = path.resolve()
        if resolved in seen:
            raise UsageError(f"{option} {path} is also the {seen[resolved]} file: give different names.")
        seen[resolved] = option
    if device_map not in STRATEGIES:
        if not device_map.endswith(".json") and not os.path.lexists(device_map):
            raise UsageError(device_map_refusal(device_map))
        from .plans import load_plan

        load_plan(device_map)  # a FIFO, /dev/zero or a broken plan: refused here, read boundedly


def device_map_refusal(device_map: str) -> str:
    return f"--device-map must be {', '.join(STRATEGIES)} or a plan JSON file, not '{device_map}'."


def _check_writable_file(path: Path, option: str) -> None:
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder: give a file name such as {path / 'image.png'}.")
    if path.exists() and not path.is_file():
        raise UsageError(f"{option} {path} exists and is not a regular file.")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"Cannot write {option} {path}: folder {parent} does not exist.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"Cannot write {option} {path}: folder {parent} is not writable.")

"""What `dmap run` checks before it loads or plans anything: its outputs, its seed, its plan file.

A generation can take minutes; an output that cannot be written, a seed torch refuses or a broken
plan file must be reported at once (exit 2), not after the last denoising step.
"""

from __future__ import annotations

import os
from pathlib import Path

from dm_cli.errors import UsageError
from dm_cli.planning.modes import Strategy

# torch.Generator.manual_seed's unsigned range. It also takes negative seeds, but wraps them (-1 is the
# same generator as 2**64 - 2): two seeds, one image, and -1 does not mean "random" as elsewhere.
SEED_RANGE = (0, 2**64 - 1)


def check_seed(seed: int, where: str) -> int:
    """One seed range for `--seed`, queue items and the API (SEED_RANGE)."""
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise UsageError(f"{where} {seed} is out of range: use a whole number from {low} to {high}.")
    return seed


# The most digits a whole number in a request's JSON (a queue line, a `dmap serve` body) may have: a seed, the
# largest number a request takes, has at most 20. Past Python's int-string limit (4300 digits) json.loads raises a
# ValueError, which would read as "not JSON"; such a number is refused as what it is, out of range.
MAX_JSON_DIGITS = 100


def load_json(text: str, where: str):
    """`json.loads(text)`; a whole number of more than MAX_JSON_DIGITS digits is a UsageError naming `where`
    (other malformed JSON raises ValueError, as json.loads does)."""
    import json

    def whole_number(digits: str) -> int:
        count = len(digits.lstrip("-"))
        if count > MAX_JSON_DIGITS:
            low, high = SEED_RANGE
            raise UsageError(f"{where} holds a whole number of {count:,} digits, which is out of range: a number here "
                             f"has at most {MAX_JSON_DIGITS} digits (a seed is from {low} to {high}).")
        return int(digits)

    return json.loads(text, parse_int=whole_number)


def check_run_request(output: str | None, save_latents: str | None, num_images: int | None, seed: int,
                      device_map: str) -> None:
    """Raise UsageError for anything about the outputs, seed or plan file that would fail later."""
    from dm_cli.io.images import check_image_output, image_paths
    from dm_cli.io.video import names_folder

    check_seed(seed, "--seed")
    if num_images is not None:  # inputs.LIMITS, before a name is made for each image
        from dm_cli.inputs import check_count

        check_count("num_images", num_images)
    images = image_paths(output, num_images or 1) if output else []
    if output and names_folder(output):  # a video's frames folder: its parent must take it (the writer checks the rest)
        parent = Path(output.rstrip("/" + os.sep)).parent
        if not parent.is_dir():
            raise UsageError(f"Cannot write --output {output}: folder {parent} does not exist.")
        targets = []
    elif output:  # the folder is the same for every image: checked once, then only the names that exist (one scan)
        check_image_output(output, len(images), videos=True)
        targets = [(path, "--output") for path in dict.fromkeys([images[0], *images.existing()])]
    else:
        targets = []
    if save_latents:
        targets.append((Path(save_latents), "--save-latents"))
    for path, option in targets:
        _check_writable_file(path, option)
    if save_latents and output and images.contains(save_latents):
        raise UsageError(f"--save-latents {save_latents} is also the --output file: give different names.")
    if device_map not in Strategy.words():
        if not device_map.endswith(".json") and not os.path.lexists(device_map):
            raise UsageError(device_map_refusal(device_map))
        from dm_cli.planning.plan_file import load_plan

        load_plan(device_map)  # a FIFO, /dev/zero or a broken plan: refused here, read boundedly


def device_map_refusal(device_map: str) -> str:
    return f"--device-map must be {', '.join(Strategy.words())} or a plan JSON file, not '{device_map}'."


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

"""A queue of prompts: the prompts file, per-item seeds and output names, resume, the manifest.

Plain data and file handling, no torch. The generation itself is the runner's stage loop
(`dm_cli.api`); this module decides WHAT to generate and records what was generated:

- `read_prompts` parses a text file (one prompt a line) or JSONL (one object a line) into
  `QueueItem`s: item i gets seed `base_seed + i` unless its line gives one, and the file name
  `00000.png`, `00001.png`, ... unless its line gives `output` (.png, .jpg, .jpeg or .webp: the format
  written; .png added to any other name); every name is checked against the file system's
  limits when the file is read, with `output_dir` (`check_output_names`);
- `resume_keys` are the metadata keys that `dm_cli.io.outputs.is_complete` compares to say whether an
  item's output exists, decodes, and was made for this item (the same prompt, seed, steps, guidance,
  size, source and family settings), so a restarted run skips exactly the finished items;
- `append_record` adds one line to a manifest with a single O_APPEND write and an fsync, so a
  killed run leaves whole lines (a torn last line is ignored on reading); `write_manifest` writes
  the merged, ordered manifest atomically at the end.
"""

from __future__ import annotations

import errno
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import CheckpointError, UsageError
from dm_cli.families import all_settings
from dm_cli.inputs import Generation, check_count, check_scale, check_text, lora_choices, read_through
from dm_cli.io.atomic import atomic_write
from dm_cli.io.checkpoint import open_regular
from dm_cli.io.images import DEFAULT_IMAGE_SUFFIX, IMAGE_FORMATS, check_file_name, check_metadata_room, name_limits
from dm_cli.io.outputs import MATCHED_METADATA
from dm_cli.io.strict_json import json_text
from dm_cli.planning.step_cache import parse_cache
from dm_cli.run.entry_checks import check_seed, load_json
from dm_cli.run.options import queue_keys
from dm_cli.run.request import input_images, last_input_image

MANIFEST = "manifest.jsonl"
MAX_PROMPTS_BYTES = 1 << 30  # millions of prompts; never a whole disk
JSONL_KEYS = queue_keys()  # the options a queue item takes (dm_cli.run.options: prompt, seed, steps, ...)


@dataclass(frozen=True)
class QueueItem:
    """One prompt of the queue: its prompt, seed and file, and the settings its line gives. `given` is a Generation
    of what the line sets (negative prompt, steps, guidance, the family's settings, input images, a last frame, a
    step cache); a field left at its default is the run's (`Generation.given_over`). `loras` are choices among the
    adapters the run loaded, not adapters, so they stand beside it; None: the run's."""

    index: int
    prompt: str
    seed: int
    output: str  # file name inside the output folder
    given: Generation = Generation()
    # the adapters loaded at start it chooses (dm_cli.inputs.LoraChoice), from the JSONL key "lora"; None: the run's
    loras: tuple | None = None

    negative_prompt = read_through("given", "negative_prompt")
    steps = read_through("given", "steps")
    guidance_scale = read_through("given", "guidance_scale")
    settings = read_through("given", "settings")  # the family's own (dm_cli.families.Setting), from its JSONL keys
    images = read_through("given", "images")  # from the JSONL key "image"; (): the run's
    last_image = read_through("given", "last_image")  # from the JSONL key "last_image"; None: the run's
    cache = read_through("given", "cache")  # from the JSONL key "cache"; None: the run's

    def to_json(self) -> dict:
        last = self.last_image.to_json() if self.last_image is not None else None
        loras = [choice.label for choice in self.loras] if self.loras is not None else None
        return {"index": self.index, "prompt": self.prompt, "seed": self.seed, "output": self.output,
                "negative_prompt": self.negative_prompt, "steps": self.steps, "guidance_scale": self.guidance_scale,
                "settings": dict(self.settings), "images": [image.to_json() for image in self.images],
                "last_image": last, "loras": loras, "cache": self.cache}


def default_output_name(index: int) -> str:
    return f"{index:05d}{DEFAULT_IMAGE_SUFFIX}"


def read_prompts(path: str | os.PathLike, base_seed: int = 0,
                 output_dir: str | os.PathLike | None = None) -> list[QueueItem]:
    """The queue in a prompts file: JSONL when it ends in .jsonl or its first line is an object, else text.

    Blank lines are skipped and do not count as items. Every problem is a UsageError naming the line.
    With `output_dir`, every item's file there is checked too (`check_output_names`).
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise UsageError(f"Prompts file {path} does not exist.")
    try:
        handle, _ = open_regular(path, "prompts file", MAX_PROMPTS_BYTES)  # never a FIFO or /dev/zero
        with handle:
            raw = handle.read(MAX_PROMPTS_BYTES + 1)
    except (CheckpointError, OSError) as error:
        raise UsageError(f"Cannot read prompts file {error}" if isinstance(error, CheckpointError)
                         else f"Cannot read prompts file {path}: {error.strerror or error}.") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UsageError(f"Prompts file {path} is not UTF-8 text (byte {error.start}): save it as UTF-8.") from None
    check_seed(base_seed, "--seed")
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"Prompts file {path} has no prompts: write one prompt per line (or one JSON object per line).")
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson") or lines[0][1].startswith("{")
    items = []
    for index, (number, line) in enumerate(lines):
        where = f"{path}, line {number}"
        if jsonl:
            items.append(_jsonl_item(line, index, base_seed, where))
        else:
            items.append(QueueItem(index, line, check_seed(base_seed + index, f"{where}: the seed"), default_output_name(index)))
    seen: dict[str, int] = {}
    for item in items:
        if item.output in seen:
            raise UsageError(
                f"Items {seen[item.output]} and {item.index} of {path} both write {item.output}: give each a different 'output'."
            )
        seen[item.output] = item.index
    if output_dir is not None:
        check_output_names(items, output_dir, path, {item.index: number for item, (number, _) in zip(items, lines)})
    return items


def _jsonl_item(line: str, index: int, base_seed: int, where: str) -> QueueItem:
    try:
        data = load_json(line, where)
    except ValueError as error:
        raise UsageError(f"{where} is not a JSON object ({error}).") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where} is not a JSON object: write {{\"prompt\": \"...\"}}.")
    return queue_item(data, index, base_seed, where)


def queue_item(data: dict, index: int, base_seed: int, where: str) -> QueueItem:
    """One item from a JSON object: a JSONL line's, or a `dmap serve` request's (dm_cli.serve.requests), checked
    key by key, each problem one sentence starting with `where`."""
    declared = all_settings()  # the families' own settings are keys too (true_cfg_scale, guidance_scale_2, ...)
    unknown = sorted(set(data) - JSONL_KEYS - set(declared))
    if unknown:
        raise UsageError(f"{where} has unknown key(s) {', '.join(unknown)}: use "
                         f"{', '.join(sorted(JSONL_KEYS | set(declared)))}.")
    settings = tuple(sorted((name, declared[name].check(data[name], f"{where}: '{name}'"))
                            for name in data if name in declared and data[name] is not None))
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where} needs a non-empty string 'prompt'.")
    check_text(prompt, f"{where}: 'prompt'")
    negative = data.get("negative_prompt")
    if negative is not None:
        check_text(negative, f"{where}: 'negative_prompt'")
    seed = data.get("seed", base_seed + index)
    if not _is_int(seed):
        raise UsageError(f"{where}: 'seed' must be an integer.")
    steps = data.get("steps")
    if steps is not None:  # --steps' bound, the line named
        check_count("steps", steps, f"{where}: 'steps'")
    guidance = data.get("guidance_scale")
    if guidance is not None:
        guidance = check_scale(guidance, f"{where}: 'guidance_scale'")
    output = data.get("output")
    output = default_output_name(index) if output is None else _output_name(output, where)
    given = Generation(negative_prompt=negative or None, steps=steps, guidance_scale=guidance, settings=settings,
                       images=_item_images(data.get("image"), where), last_image=_item_last_image(data.get("last_image"), where),
                       cache=_item_cache(data.get("cache"), where))
    return QueueItem(index, prompt.strip(), check_seed(seed, f"{where}: the seed"), output, given,
                     _item_loras(data.get("lora"), where))


def _item_cache(value, where: str):
    """A JSONL item's "cache": NAME[:KEY=VALUE,...] as --cache takes it (dm_cli.planning.step_cache.parse_cache)."""
    if value is None:
        return None

    return parse_cache(value, f"{where}: 'cache'")


def _item_loras(value, where: str) -> tuple | None:
    """A JSONL item's "lora": "[COMPONENT=]NAME[:SCALE]" or a list of them, chosen among the adapters the run loaded
    (`--lora`; `Session.chosen_loras` finds them), as a served request's "lora" (dm_cli.inputs.lora_choices); [] or
    "none": no LoRA; None: the run's."""
    if value is None:
        return None
    return lora_choices(value, f"{where}: 'lora'")


def _item_images(value, where: str) -> tuple:
    """A JSONL item's "image": a path or a list of paths (relative to the current folder, as --image), each read
    as hostile input before anything loads."""
    if value is None:
        return ()
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise UsageError(f"{where}: 'image' must be a path or a list of paths.")

    return input_images(paths, f"{where}: 'image'")


def _item_last_image(value, where: str):
    """A JSONL item's "last_image": one path (as --last-image), read as hostile input before anything loads."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: 'last_image' must be a path.")

    return last_input_image(value, f"{where}: 'last_image'")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _output_name(value, where: str) -> str:
    """A plain file name inside the output folder: no folders, no '..', no hidden files; its suffix names the
    format (.png, .jpg, .jpeg, .webp), and .png is added to any other name."""
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: 'output' must be a file name.")
    name = value.strip()
    if "/" in name or "\\" in name or name in (".", "..") or name.startswith(".") or "\x00" in name:
        raise UsageError(f"{where}: 'output' must be a plain file name inside the output folder, not '{value}'.")
    if name == MANIFEST or name.startswith("manifest-rank"):
        raise UsageError(f"{where}: 'output' may not be named {name} (the manifest's name).")

    if Path(name).suffix.lower() not in IMAGE_FORMATS:
        name += DEFAULT_IMAGE_SUFFIX  # as before .jpg/.webp were written: shot.001 and x.v2 stay PNGs named shot.001.png
    return name


def check_output_names(items: list[QueueItem], folder: str | os.PathLike, path: str | os.PathLike,
                       numbers: dict[int, int] | None = None) -> None:
    """Every item's file in `folder` is a name (and path) the file system takes, with room for its temporary
    name, and a JPEG's metadata fits: checked when the queue is read, before anything loads."""
    folder = Path(folder)
    limits = name_limits(folder)  # one file system for every item
    for item in items:
        where = f"{path}, line {numbers[item.index]}" if numbers else f"{path}, item {item.index}"
        check_file_name(folder / item.output, f"{where}: 'output'", limits)
        check_metadata_room(item.output, item.prompt, item.negative_prompt, f"{where}: 'output'")


def items_for_rank(items: list[QueueItem], rank: int, world_size: int) -> list[QueueItem]:
    """Rank r of W takes items i with i % W == r: results never depend on the world size."""
    return [item for item in items if item.index % world_size == rank]


# --- resume -------------------------------------------------------------------------------------


def resume_keys() -> tuple[str, ...]:
    """The metadata keys an item's finished output must agree on (`dm_cli.io.outputs.is_complete`): those every
    output has (MATCHED_METADATA) and every family's own settings, which change pixels too."""
    return (*MATCHED_METADATA, "last_image", *all_settings())  # last_image: Wan's first-last-frame video


def remove_stale_temporaries(folder: Path, item: QueueItem) -> None:
    """Temporary files a killed writer left for this item (atomic_write's `.NAME.*.tmp`)."""
    for stale in folder.glob(f".{glob.escape(item.output)}.*.tmp"):  # a name may hold [ or *
        try:
            stale.unlink()
        except OSError:
            pass


# --- manifest -----------------------------------------------------------------------------------


def rank_manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.jsonl"


def append_record(path: Path, record: dict) -> None:
    """One whole line with one O_APPEND write, then fsync: readers never see half a record."""
    data = (json_text(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        written = os.write(fd, data)
        if written != len(data):  # a full disk; the line is torn and will be ignored on reading
            raise OSError(errno.ENOSPC, "No space left on device (a short write)", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: Path) -> list[dict]:
    """Records of a manifest; torn or foreign lines (a killed writer, a hand edit) are skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _is_int(record.get("item")) and isinstance(record.get("file"), str):
            records.append(record)
    return records


def previous_records(folder: Path) -> dict[int, dict]:
    """The last record per item in the folder's manifest and any per-rank manifests a killed run left."""
    found: dict[int, dict] = {}
    for path in [folder / MANIFEST, *sorted(folder.glob("manifest-rank*.jsonl"))]:
        for record in read_records(path):
            found[record["item"]] = record
    return found


def merge_records(items: list[QueueItem], records: dict[int, dict], previous: dict[int, dict]) -> list[dict]:
    """One record per finished item, in queue order.

    `records` are this run's: items generated now, and items skipped as complete (marked
    `"resumed": true`); a skipped item keeps the earlier run's record when one names the same file,
    prompt and seed (it has the real seconds and rank).
    """
    merged = []
    for item in items:
        record = records.get(item.index)
        if record is None:
            continue
        old = previous.get(item.index)
        if record.get("resumed") and old is not None and not old.get("resumed") and old.get("file") == item.output \
                and old.get("prompt") == item.prompt and old.get("seed") == item.seed:
            record = old
        merged.append(record)
    return merged


def write_manifest(folder: Path, records: list[dict]) -> Path:
    """The merged manifest, written atomically; per-rank manifests it replaces are removed."""
    path = folder / MANIFEST
    text = "".join(json_text(r, sort_keys=True) + "\n" for r in records)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    for part in folder.glob("manifest-rank*.jsonl"):
        try:
            part.unlink()
        except OSError:
            pass
    return path


# --- chunks -------------------------------------------------------------------------------------


def chunk_size_for(budget_bytes: int, per_item_bytes: int, items: int) -> int:
    """How many items' embeddings and latents fit the RAM budget at once (at least 1, at most all)."""
    if items <= 0:
        return 1
    if per_item_bytes <= 0:
        return items
    return max(1, min(items, budget_bytes // per_item_bytes))


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]

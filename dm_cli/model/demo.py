"""The embedded default pipeline: a small FLUX-architecture model with RANDOM weights.

`dmap run --prompt ...` without a SOURCE needs something to run offline on a laptop CPU. The demo
is a real FluxPipeline folder (model_index.json, configs, sharded safetensors, tokenizers,
scheduler) whose weights are generated deterministically from a fixed seed on first use and then
loaded like any checkpoint. Its images are noise-like: the weights are random, not trained.

`write_random_pipeline` is also how tests give the tiny-* presets weights, and `write_preset` (`dmap demo
PRESET -o DIR`) is how a user does: the `demo` SOURCE name is this pipeline (`is_demo`).
"""

from __future__ import annotations

import difflib
import fcntl
import json
import os
import shlex
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dm_cli.errors import DmapError, UsageError, disk_full
from dm_cli.io.atomic import _umask, disk_full_error, refuse_existing
from dm_cli.io.cache import cache_dir, cache_key
from dm_cli.io.checkpoint import open_checkpoint, read_json_object
from dm_cli.io.swap import TEMP_MARK, hidden_name, publish, recover
from dm_cli.model.models import build_model, quiet_libraries
from dm_cli.model.sources import DEMO_SOURCE, PRESETS, PRESETS_DIR, resolve_source
from dm_cli.model.tokenizers import write_tokenizer_for

DEMO_SEED = 0
DEMO_SHARD_SIZE = "4MB"  # several shards per big component, as real checkpoints have
DEMO_NOTICE = "The demo pipeline has RANDOM weights (FLUX architecture, untrained): its images are noise, not art."
DEMO_DEFAULTS = {"height": 256, "width": 256, "steps": 4, "guidance_scale": 3.5, "max_sequence_length": 64}

# FLUX.1 architecture at laptop size: same classes and wiring, fewer/narrower layers.
DEMO_CONFIGS: dict[str, dict] = {
    "model_index": {
        "_class_name": "FluxPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    },
    "scheduler": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True,
    },
    "text_encoder": {
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "bos_token_id": 0, "eos_token_id": 2,
        "pad_token_id": 1, "hidden_act": "quick_gelu", "hidden_size": 128, "intermediate_size": 512,
        "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "num_attention_heads": 4, "num_hidden_layers": 2,
        "projection_dim": 128, "vocab_size": 1000,
    },
    "text_encoder_2": {
        "architectures": ["T5EncoderModel"], "model_type": "t5", "d_ff": 512, "d_kv": 32, "d_model": 256,
        "dense_act_fn": "gelu_new", "feed_forward_proj": "gated-gelu", "is_gated_act": True, "num_heads": 8,
        "num_layers": 4, "relative_attention_num_buckets": 32, "vocab_size": 512, "tie_word_embeddings": False,
    },
    "transformer": {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 32, "axes_dims_rope": [8, 12, 12],
        "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 256, "num_attention_heads": 8,
        "num_layers": 2, "num_single_layers": 6, "patch_size": 1, "pooled_projection_dim": 128,
    },
    "vae": {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [32, 32, 64, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 1, "norm_num_groups": 32,
        "sample_size": 256, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_post_quant_conv": False,
        "use_quant_conv": False, "force_upcast": True,
    },
}


def _digest(configs: dict) -> str:
    """The demo's cache key: its configs and seed, the library versions and dmap's code (cache.cache_key)."""
    return cache_key({"configs": configs, "seed": DEMO_SEED})[:16]


def demo_folder() -> Path:
    return cache_dir() / "demo" / f"flux-demo-{_digest(DEMO_CONFIGS)}"


def is_demo(source: str | None) -> bool:
    """None, or the SOURCE name `demo` when no file or folder of that name is here (a path comes first)."""
    return source is None or (source == DEMO_SOURCE and not Path(source).expanduser().exists())


def source_root(source: str | None, status=lambda message: None) -> tuple[str, str, dict]:
    """(name to show, what to resolve, defaults): None (or `demo`) is the demo, generated into the cache on first use."""
    if not is_demo(source):
        return source, source, {}
    return "demo", str(ensure_demo(status)), DEMO_DEFAULTS


def resolve(spec: str):
    """`resolve_source`, with `demo` (when no such path exists) the demo pipeline, generated on first use."""
    if not is_demo(spec):
        return resolve_source(spec)
    source = resolve_source(str(ensure_demo()))
    source.spec = "demo"
    return source


# dmap's record of the demo's files (path: size), written last: a folder that does not match it exactly is damaged
FILES_RECORD = ".dmap-demo-files.json"
LOCK_NAME = ".demo.lock"


def ensure_demo(status=lambda message: None) -> Path:
    """The demo pipeline folder, generated (once, atomically) if the cache lacks it or holds it damaged."""
    folder = demo_folder()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"Cannot create dmap's demo cache folder {folder.parent} "
                         f"({error.strerror or error}): remove it (or set DMAP_CACHE_DIR) and run again.") from None
    # one process at a time checks and writes (torchrun ranks start together): no one reads a folder another removes
    fd = _open_lock(folder.parent / LOCK_NAME)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as error:
            raise UsageError(f"Cannot lock {folder.parent / LOCK_NAME} ({error.strerror or error}): "
                             "remove it (or set DMAP_CACHE_DIR to a local folder) and run again.") from None
        return _ensure_demo_locked(folder, status)
    finally:
        os.close(fd)


def _open_lock(path: Path) -> int:
    """The lock file, opened without following a symlink or waiting on a FIFO; anything but a regular file is
    refused (exit 2, saying what to remove)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    what = None
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as error:
        try:
            what = _kind(os.lstat(path).st_mode)
        except OSError:
            what = None
        if what is None or what == "a regular file":
            raise UsageError(f"Cannot open dmap's lock file {path} ({error.strerror or error}): "
                             "remove it and run again.") from None
    else:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        what = _kind(mode)
    raise UsageError(f"{path} is {what}, not dmap's lock file: remove it and run again.")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device"


def _ensure_demo_locked(folder: Path, status=lambda message: None) -> Path:
    _remove_stale_staging(folder.parent)  # under the lock no one else is writing one
    if _intact(folder):
        return folder
    status("Generating the demo pipeline's random weights again (the cached one is damaged)…"
           if os.path.lexists(folder) else "Generating the demo pipeline's random weights (first run only)…")
    _remove(folder)  # dmap's own cache, damaged (or partly missing): generated again below
    quiet_libraries()  # the libraries' save bars would interleave with dmap's own output
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-demo-"))
    try:
        try:
            write_configs(DEMO_CONFIGS, staging)
            write_random_pipeline(staging, staging, seed=DEMO_SEED, max_shard_size=DEMO_SHARD_SIZE)
            _write_files_record(staging)
        except Exception as error:
            if disk_full(error):  # safetensors says it in a SafetensorError, not an OSError
                raise disk_full_error(folder, cause=error) from error
            if not isinstance(error, OSError):
                raise
            raise UsageError(f"Cannot write the demo pipeline into {folder.parent}: "
                             f"{error.strerror or error}.") from None
        try:
            os.replace(staging, folder)
        except OSError as error:
            raise UsageError(f"Cannot replace the damaged demo pipeline {folder} ({error.strerror or error}): "
                             "remove it and run again.") from None
    finally:
        if os.path.lexists(staging):
            _remove(staging)
    return folder


def _remove(path: Path) -> None:
    """Remove what is at path, never following a symlink (a link is removed, not what it points to)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _remove_stale_staging(parent: Path) -> None:
    """Staging folders a killed generation left behind."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(".tmp-demo-")]
    except OSError:
        return
    for name in names:
        _remove(parent / name)


def _walk(folder: Path) -> dict[str, int] | None:
    """Every regular file under folder (relative path: size), by lstat only; None if anything is not a regular
    file or a folder (a FIFO, a symlink, a socket, a device): nothing is opened, so nothing can block."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
    except OSError:
        return None
    files, pending = {}, [folder]
    while pending:
        current = pending.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            return None
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                return None
            path = Path(entry.path)
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
            elif stat.S_ISREG(info.st_mode):
                files[path.relative_to(folder).as_posix()] = info.st_size
            else:
                return None
            if len(files) + len(pending) > 10_000:  # the demo has a few dozen: this is not dmap's folder
                return None
    return files


def _write_files_record(folder: Path) -> None:
    files = _walk(folder)
    if files is None:
        raise OSError(f"the generated demo in {folder} holds something other than files and folders")
    files.pop(FILES_RECORD, None)
    (folder / FILES_RECORD).write_text(json.dumps({"format": "dmap-demo-files", "files": files}, indent=1,
                                                  sort_keys=True))


def _intact(folder: Path) -> bool:
    """The folder holds exactly the files dmap wrote (regular files, the sizes it recorded), every JSON file is a
    strict JSON object and every component's weights pass the header checks. Checked by lstat before anything is
    opened and read with the bounded readers: a FIFO, a symlink or a huge file is damage, never a wait."""
    files = _walk(folder)
    if files is None or FILES_RECORD not in files:
        return False
    try:
        record = read_json_object(folder / FILES_RECORD, "demo files record")
        recorded = record.get("files")
        files.pop(FILES_RECORD)
        if record.get("format") != "dmap-demo-files" or recorded != files:
            return False
        for name in files:
            if name.endswith(".json"):
                read_json_object(folder / name, "demo file")
        source = resolve_source(str(folder))
        for comp in source.components:
            if comp.weights is None:
                return False
            open_checkpoint(comp.weights, strict=True)
    except (OSError, ValueError, RecursionError, DmapError):
        return False
    return True


def write_configs(configs: dict, root: Path) -> None:
    (root / "model_index.json").write_text(json.dumps(configs["model_index"], indent=2))
    for name, config in configs.items():
        if name == "model_index":
            continue
        (root / name).mkdir(parents=True, exist_ok=True)
        file_name = "scheduler_config.json" if name == "scheduler" else "config.json"
        (root / name / file_name).write_text(json.dumps(config, indent=2))


def write_random_pipeline(
    config_root: str | Path, target: str | Path, seed: int = 0, max_shard_size: str | None = None,
    dtype: str = "float32",
) -> Path:
    """A runnable pipeline folder from configs only: random weights (fixed seed), tokenizers, scheduler.

    `config_root` is a pipeline folder with model_index.json and component configs (a tiny preset,
    or the demo's); `target` receives model_index.json, every component as safetensors, the
    scheduler config and offline tokenizers. Same seed and library versions, same bytes.
    """
    # torch: imported on use, so start-up stays free of torch
    import torch

    config_root, target = Path(config_root), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    index = json.loads((config_root / "model_index.json").read_text())
    if config_root != target:
        (target / "model_index.json").write_text(json.dumps(index, indent=2))
    torch_dtype = getattr(torch, dtype)
    for position, (name, value) in enumerate(sorted((k, v) for k, v in index.items() if not k.startswith("_"))):
        if not isinstance(value, list) or value[0] is None or value[1] is None:
            continue
        library, cls = value
        if "Scheduler" in cls:
            src = config_root / name / "scheduler_config.json"
            (target / name).mkdir(parents=True, exist_ok=True)
            if src.resolve() != (target / name / "scheduler_config.json").resolve():
                shutil.copyfile(src, target / name / "scheduler_config.json")
            continue
        if "Tokenizer" in cls or cls.endswith("Processor"):
            encoder = "text_encoder" + name.removeprefix("tokenizer").removeprefix("processor")  # processor: a VLM's
            encoder_config = json.loads((config_root / encoder / "config.json").read_text())
            write_tokenizer_for(cls, target / name, encoder_config)
            continue
        config = json.loads((config_root / name / "config.json").read_text())
        torch.manual_seed(seed + position)
        model = _build_random(library, cls, config)
        if torch_dtype != torch.float32:
            model = model.to(torch_dtype)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(target / name, **kwargs)
        del model
    return target


def _build_random(library: str, cls: str, config: dict):
    """The class with its own (random) initialisation, on the CPU."""
    return build_model(library, cls, config)


# --- dmap demo PRESET -o DIR ------------------------------------------------------------------------

# what to try next, per tiny preset: sizes its family accepts, small enough for a laptop CPU (tests/test_demo_next.py
# runs every preset's command as printed)
_VIDEO_OPTIONS = "--frames 9 --height 32 --width 32 --steps 4"
NEXT_RUN_OPTIONS = {
    "tiny-wan": _VIDEO_OPTIONS,
    "tiny-wan-i2v": _VIDEO_OPTIONS,
    "tiny-wan-ti2v": _VIDEO_OPTIONS,
    "tiny-ltx2": _VIDEO_OPTIONS,
    "tiny-flux-kontext": "--height 64 --width 64 --max-area 4096 --steps 2",  # Kontext resizes to --max-area
}
DEFAULT_NEXT_RUN_OPTIONS = "--height 64 --width 64 --steps 2"
VIDEO_PRESETS = ("tiny-wan", "tiny-wan-i2v", "tiny-wan-ti2v", "tiny-ltx2")
# the presets whose pipeline cannot run without an input image (their family's min_input_images): `dmap demo` writes
# one beside the weights, so that the printed command runs as it is
NEEDS_INPUT_IMAGE = ("tiny-flux-img2img", "tiny-qwenimage-edit", "tiny-qwenimage-edit-single", "tiny-qwenimage-img2img",
                     "tiny-wan-i2v")
EXAMPLE_IMAGE = "example-input.png"


def tiny_presets() -> list[str]:
    return [name for name in PRESETS if name.startswith("tiny-")]


@dataclass
class WrittenPreset:
    preset: str
    folder: Path
    pipeline_class: str
    seed: int
    files: int
    bytes: int
    notes: list[str]

    def next_command(self) -> str:
        options = NEXT_RUN_OPTIONS.get(self.preset, DEFAULT_NEXT_RUN_OPTIONS)
        if self.preset in NEEDS_INPUT_IMAGE:
            options += f" --image {shlex.quote(str(self.folder / EXAMPLE_IMAGE))}"
        output = f"{self.folder.name}.{'mp4' if self.preset in VIDEO_PRESETS else 'png'}"  # one per demo: none clash
        return f'dmap run {shlex.quote(str(self.folder))} --prompt "a red fox" {options} -o {shlex.quote(output)}'


def _write_example_image(folder: Path) -> None:
    """A small input image for a preset that needs one (a gradient: its outputs are noise anyway)."""
    from PIL import Image  # lazy: PIL (heavy, off start-up)

    image = Image.linear_gradient("L").resize((64, 64)).convert("RGB")
    image.save(folder / EXAMPLE_IMAGE)


def check_preset(preset: str) -> str:
    """The preset `dmap demo` can write (a tiny one), or exit 2 naming them."""
    tiny = tiny_presets()
    if preset in tiny:
        return preset
    if preset in PRESETS:
        raise UsageError(f"'{preset}' is a full-size preset: dmap demo generates only the tiny ones "
                         f"({', '.join(tiny)}), whose random weights take megabytes, not gigabytes.")
    close = difflib.get_close_matches(preset.lower(), tiny, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UsageError(f"Unknown preset '{preset}': {hint}dmap demo generates one of {', '.join(tiny)}.")


def write_preset(preset: str, output: str | Path, seed: int = 0, overwrite: bool = False,
                 status=lambda message: None) -> WrittenPreset:
    """A tiny preset as a runnable pipeline folder with random weights (`seed`), written to a hidden folder
    beside `output` and published there only when complete (swap.publish; `overwrite` replaces an output
    dmap could have written, atomic.refuse_existing)."""
    preset = check_preset(preset)
    if not 0 <= seed < 2**32:
        raise UsageError(f"--seed {seed} is out of range: give 0 to {2**32 - 1}.")
    out = Path(output).expanduser()
    if not out.name or out.name in (".", ".."):
        raise UsageError(f"--output {output} names no folder: give a new folder name, such as {preset}.")
    refuse_existing([out], overwrite)
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"Cannot write {out}: its parent folder {parent} does not exist.")
    notes = recover(out, overwrite)
    quiet_libraries()  # the libraries' save bars would interleave with dmap's own output
    staging = hidden_name(out, TEMP_MARK)  # a kill leaves a folder the next write of this output removes
    try:
        staging.mkdir()
        status(f"Generating {preset}'s random weights (seed {seed})…")
        write_random_pipeline(PRESETS_DIR / PRESETS[preset], staging, seed=seed)
        if preset in NEEDS_INPUT_IMAGE:
            _write_example_image(staging)
        os.chmod(staging, 0o777 & ~_umask())
        files = _walk(staging) or {}
        _fsync_tree(staging)
        publish(staging, out, overwrite)
    except Exception as error:
        if disk_full(error):  # safetensors says it in a SafetensorError, not an OSError
            raise disk_full_error(out, cause=error) from error
        if not isinstance(error, OSError):
            raise
        raise UsageError(f"Cannot write {out}: {error.strerror or error}; nothing was left there.") from None
    finally:
        if os.path.lexists(staging):
            _remove(staging)
    index = json.loads((out / "model_index.json").read_text())
    return WrittenPreset(preset, out, index.get("_class_name", "?"), seed, len(files), sum(files.values()), notes)


def _fsync_tree(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

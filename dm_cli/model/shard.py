"""`dmap shard`: rewrite weights as loader-friendly safetensors shards without loading the model.

Why streaming: the usual recipe (load, `save_pretrained(max_shard_size=...)`) needs the whole model
in RAM. A safetensors tensor is a byte range, so when the dtype does not change each tensor is
copied range to range (in the kernel where the OS allows, else through one small buffer); with
`--dtype` tensors are converted one at a time. Headers and index files are written by us,
deterministically, so the same input always gives byte-identical output.

Safety: everything is written into a hidden temporary folder beside the output, fsynced, re-read
and compared tensor by tensor with the source, and only then renamed into place. The source is
never modified unless `in_place`, and then only after that verification. Byte copies are read back
and compared piece by piece as they are written, while the piece is in the CPU's cache
(`sharding/copying.py`); fsyncs, and the hashing back of converted tensors, run on background threads
while the next tensors are written (`sharding/verification.py`), so they cost little extra wall time.

This module is the command: the options checked, the plan, and the write-verify-publish transaction
(`_write_result`). Its steps live in `dm_cli.model.sharding`: `layout` (shards, names, headers),
`source_weights` (reading the SOURCE), `writing` (one shard file), `copying`, `verification`, and
`to_diffusers` (a single file's tensors for `--to-diffusers`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

from dm_cli.errors import DmapError, SourceError, UsageError
from dm_cli.io.atomic import refuse_existing
from dm_cli.io.swap import (
    MARKS,
    TEMP_MARK,
    SwapFolder,
    finish_swaps,
    fsync_dir,
    hidden_name,
    publish,
    recover,
    swap_in_place,
)
from dm_cli.model.formats.prequantized import quantization_of
from dm_cli.model.formats.weight_formats import FP8_NAMES, KEPT_BY_DEFAULT, STORAGE_DTYPES
from dm_cli.model.sharding.copying import write_small
from dm_cli.model.sharding.layout import (
    CONVERTIBLE,
    ComponentPlan,
    PlannedTensor,
    Progress,
    ShardResult,
    plan_shards,
)
from dm_cli.model.sharding.source_weights import (
    component_weights,
    default_output,
    output_stem,
    resolve_shard_source,
    stem_of,
)
from dm_cli.model.sharding.to_diffusers import check_converted, converted_tensors, to_diffusers_notes
from dm_cli.model.sharding.verification import ShardFinisher, verify_index
from dm_cli.model.sharding.writing import copy_files, write_shard
from dm_cli.model.single_file_weights import GGUF, component_for_file, convert_file, is_single_file
from dm_cli.model.skeleton import load_skeleton
from dm_cli.model.sources import hub_cache_root, is_inside
from dm_cli.units import format_size, parse_dtype, parse_size

MIN_SHARD_SIZE = 10**6  # below 1 MB a "shard" is a mistake, not a choice
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".onnx", ".onnx_data")


def _checked_options(max_shard_size: int | str, dtype: str | None, variant: str | None, in_place: bool,
                     output, min_shard_size: int) -> tuple[int, bool, object]:
    """The options alone, checked before the source is read or anything beside it is touched."""
    limit = parse_size(max_shard_size)
    if 0 < limit < min_shard_size:
        raise UsageError(
            f"--max-shard-size {max_shard_size} is below the {format_size(min_shard_size)} minimum: use 0 for one file, "
            f"or a size such as 500MB or 5GB."
        )
    fp8 = dtype is not None and dtype.strip().lower() in FP8_NAMES
    target_dtype = STORAGE_DTYPES["fp8"] if fp8 else parse_dtype(dtype) if dtype is not None else None
    if variant is not None and not re.fullmatch(r"\w+", variant):
        raise UsageError(f"--variant '{variant}' must be a plain word such as fp16.")
    if in_place and output is not None:
        raise UsageError("Give either --output or --in-place, not both.")
    return limit, fp8, target_dtype


def plan_shard(source_spec: str, max_shard_size: int | str, output: str | os.PathLike | None = None,
               dtype: str | None = None, variant: str | None = None, in_place: bool = False,
               overwrite: bool = False, min_shard_size: int = MIN_SHARD_SIZE) -> tuple[ShardResult, object, dict]:
    """Validate everything and plan the layout; writes nothing. Returns (result, source, legacy dicts)."""
    limit, fp8, target_dtype = _checked_options(max_shard_size, dtype, variant, in_place, output, min_shard_size)
    source = resolve_shard_source(source_spec)
    if source.root is None or not Path(source_spec).expanduser().exists() and source.preset:
        raise SourceError(f"'{source_spec}' is a preset without weights: give a folder or file with weights to shard.")
    if in_place and not Path(source_spec).expanduser().exists():
        raise UsageError(f"--in-place needs a local path; '{source_spec}' was resolved from a cache, which dmap will not modify.")

    components: list[ComponentPlan] = []
    legacy: dict[Path, dict] = {}
    for comp in source.components:
        saved = quantization_of(getattr(comp, "config", None))
        if saved is not None and target_dtype is not None:  # without --dtype its tensors are copied byte for byte
            raise UsageError(f"Component '{comp.name}' was saved quantized ({saved}): --dtype would cast its statistics "
                             "and break it; reshard it without --dtype (its tensors are then copied byte for byte).")
        weights, naming_file = component_weights(comp, variant)
        legacy.update(weights.legacy)
        source_stem, source_variant = stem_of(naming_file)
        out_variant = variant if variant is not None else source_variant
        if source.kind == "weights":
            stem = output_stem(source_stem, None) if source_stem == "pytorch_model" else source_stem
            folder = ""
        else:
            stem = output_stem(source_stem, comp.library)
            folder = "" if source.kind == "component" else comp.name
        planned = []
        converted = 0
        cast = None
        if fp8:  # as --weights fp8: a pipeline's VAE keeps its dtype
            cast = set() if source.kind == "pipeline" and comp.name in KEPT_BY_DEFAULT else _fp8_tensors(comp)
        for st in weights.tensors:
            out = target_dtype if (target_dtype and st.dtype in CONVERTIBLE and (cast is None or st.name in cast)) else st.dtype
            converted += out != st.dtype
            planned.append(PlannedTensor(st, out))
        shards, index_name = plan_shards(planned, limit, stem, out_variant, weights.metadata)
        components.append(ComponentPlan(
            comp.name, comp.library, comp.cls, comp.folder or source.root, weights.files, folder, stem, out_variant,
            shards, index_name, weights.metadata, weights.dropped, converted, bool(weights.legacy),
        ))

    source_path = Path(source_spec).expanduser().resolve() if Path(source_spec).expanduser().exists() else source.root
    if in_place:
        out_path = source.root.resolve()
        _check_in_place(components)
    else:
        if output is None and source.hub_snapshot is not None:
            raise UsageError(f"'{source_spec}' was read from the Hugging Face cache, which dmap never writes into: "
                             "give --output.")
        out_path = Path(output).expanduser().resolve() if output is not None else default_output(source).resolve()
        _check_output_parent(out_path)
        root = source.root.resolve()
        if out_path == root or (source.kind != "weights" and is_inside(out_path, root)):
            raise UsageError(f"The output {out_path} is the source or inside it: choose another --output, or use --in-place.")
        if is_inside(root, out_path) or (source.kind == "weights" and is_inside(source_path, out_path)):
            raise UsageError(f"The output {out_path} contains the source: choose another --output.")
        refuse_existing([out_path], overwrite)
        if out_path.exists() and not out_path.is_dir():
            raise UsageError(f"The output {out_path} exists and is not a folder.")
    result = ShardResult(source_spec, source.kind, out_path, limit, target_dtype, variant, False, in_place, components)
    return result, source, legacy


def _fp8_tensors(comp) -> set[str]:
    """Names (tied aliases included) that layerwise casting stores in fp8: the rest keeps its dtype."""
    if comp.config is None:
        raise UsageError(f"--dtype fp8 needs the config of '{comp.name}' to know which layers stay in high precision: "
                         "shard its folder with config.json.")
    skeleton = load_skeleton(comp.name, comp.library, comp.cls, comp.config)  # the config decides; headers read once
    cast = {t.name for t in skeleton.tensors if "fp8" in t.low_precision}
    return cast | {alias for group in skeleton.tie_groups if group[0] in cast for alias in group[1:]}


def _check_output_parent(out_path: Path) -> None:
    """The output's folder exists, is writable and is not the Hugging Face cache."""
    parent = out_path.parent
    if not parent.is_dir():
        raise UsageError(f"The folder of the output, {parent}, does not exist: create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"Cannot write into {parent}: permission denied.")
    cache = hub_cache_root()
    if cache.is_dir() and is_inside(out_path, cache.resolve()):
        raise UsageError(f"The output {out_path} is inside the Hugging Face cache ({cache}), which dmap never "
                         "writes into: choose another --output.")


def _check_in_place(components: list[ComponentPlan]) -> None:
    """New file names must not hit files that are not being replaced; every old file is in its folder."""
    for comp in components:
        folder = comp.source_folder.resolve()
        old = {p.name for p in comp.source_files}
        for path in comp.source_files:
            if path.parent.resolve() != folder:
                raise UsageError(f"--in-place: {path} is not in {folder}; write the result elsewhere with --output.")
        for name in comp.output_files():
            if name not in old and (folder / name).exists():
                raise UsageError(f"--in-place would write {folder / name}, which exists and is not one of the files "
                                 "being replaced; move it away or use --output.")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--in-place: cannot write into {folder}: permission denied.")


def _copy_plan(source, result: ShardResult) -> list[tuple[Path, str]]:
    """Files carried over unchanged (configs, tokenizer, scheduler...): (source path, relative path)."""
    if source.kind == "weights" or result.in_place:
        return []
    root = source.root
    weighted = {c.source_folder.resolve() for c in result.components}
    read = {f.resolve() for c in result.components for f in c.source_files}
    copies: list[tuple[Path, str]] = []
    for folder, dirs, files in os.walk(root, onerror=_unreadable):
        dirs[:] = sorted(d for d in dirs if not any(m in d for m in MARKS) and d not in (".git", ".cache"))
        here = Path(folder)
        for name in sorted(files):
            path = here / name
            rel = path.relative_to(root).as_posix()
            in_weighted = here.resolve() in weighted
            is_weight = name.endswith(WEIGHT_SUFFIXES) or re.search(r"\.index(\.\w+)?\.json$", name)
            if in_weighted and is_weight:
                if path.resolve() not in read:
                    result.skipped_files.append(rel)
            else:
                _check_copyable(path)
                copies.append((path, rel))
    return copies


def _unreadable(error: OSError) -> None:
    raise SourceError(f"Cannot read {error.filename}: {error.strerror or error}; nothing was written.")


def _check_copyable(path: Path) -> None:
    if path.is_symlink() and not path.exists():
        raise SourceError(f"{path} is a dangling symbolic link: fix or remove it, then shard again.")
    if not path.is_file():
        raise SourceError(f"{path} is not a regular file (a FIFO or a device?): remove it, then shard again.")
    if not os.access(path, os.R_OK):
        raise SourceError(f"{path} cannot be read: permission denied.")


def shard(source_spec: str, max_shard_size: int | str, output: str | os.PathLike | None = None,
          dtype: str | None = None, variant: str | None = None, dry_run: bool = False, overwrite: bool = False,
          in_place: bool = False, verify: bool = True, progress: Progress | None = None,
          min_shard_size: int = MIN_SHARD_SIZE) -> ShardResult:
    """Plan, write into a temporary folder, verify, then move into place (or replace the source)."""
    started = time.perf_counter()
    progress = progress or Progress()
    _checked_options(max_shard_size, dtype, variant, in_place, output, min_shard_size)
    finished = _finish_interrupted_swaps(source_spec) if in_place and not dry_run else []
    result, source, legacy = plan_shard(source_spec, max_shard_size, output, dtype, variant, in_place, overwrite,
                                        min_shard_size)
    result.removed_stale = finished
    copies = _copy_plan(source, result)
    result.copied_files = [rel for _, rel in copies]
    if dry_run:
        result.dry_run = True
        result.seconds = time.perf_counter() - started
        return result

    _write_result(result, copies, legacy, {}, progress, verify, overwrite)
    result.seconds = time.perf_counter() - started
    return result


def shard_to_diffusers(file_spec: str, max_shard_size: int | str = "5GB", output: str | os.PathLike | None = None,
                       dtype: str | None = None, pipeline: str | None = None, dry_run: bool = False,
                       overwrite: bool = False, verify: bool = True, progress: Progress | None = None,
                       min_shard_size: int = MIN_SHARD_SIZE) -> ShardResult:
    """A single file (original-layout .safetensors or GGUF) as the diffusers component folder `from_pretrained`
    loads: config.json from the bundled preset (or --pipeline's) config and diffusers-named shards, renamed by
    diffusers' own `checkpoint_mapping_fn` and written by the shard writer (streamed, verified, renamed into place
    when complete).

    dtypes: a safetensors file's tensors keep their dtype unless `dtype`; GGUF quantized tensors are dequantized
    (diffusers' `dequantize_gguf_tensor`) to `dtype`, bf16 by default, and its other floating tensors converted to it;
    either way the tensors of the model's `_keep_in_fp32_modules` stay float32 (dequantized to it), as both
    of diffusers' loaders keep them."""
    started = time.perf_counter()
    progress = progress or Progress()
    limit = parse_size(max_shard_size)
    if 0 < limit < min_shard_size:
        raise UsageError(f"--max-shard-size {max_shard_size} is below the {format_size(min_shard_size)} minimum: use 0 "
                         "for one file, or a size such as 500MB or 5GB.")
    if dtype is not None and dtype.strip().lower() in FP8_NAMES:
        raise UsageError("--to-diffusers writes bf16, fp16 or fp32 weights; fp8 storage is dmap shard --dtype fp8 of "
                         "the folder it writes.")
    target = parse_dtype(dtype) if dtype is not None else None
    path = Path(file_spec).expanduser()
    if not path.exists():
        raise UsageError(f"{file_spec} does not exist: --to-diffusers converts one single file (.safetensors or .gguf).")
    if not is_single_file(file_spec):
        raise UsageError(f"--to-diffusers converts one single file (an original-layout .safetensors or a .gguf); "
                         f"{file_spec} is not one.")
    comp, where = component_for_file(path, pipeline)  # the file's header checked against the component's config
    out_path = Path(output).expanduser().resolve() if output is not None else path.resolve().parent / (
        f"{path.name.rsplit('.', 1)[0]}-diffusers")
    _check_output_parent(out_path)
    if out_path == path.resolve() or is_inside(path.resolve(), out_path):
        raise UsageError(f"The output {out_path} is the source file or holds it: choose another --output.")
    refuse_existing([out_path], overwrite)
    if out_path.exists() and not out_path.is_dir():
        raise UsageError(f"The output {out_path} exists and is not a folder.")

    converted = convert_file(path, comp)
    if converted.format == GGUF and target is None:
        target = "bfloat16"
    planned, in_memory, changed = converted_tensors(converted, target)
    check_converted(converted, planned)
    stem = "diffusion_pytorch_model"
    shards, index_name = plan_shards(planned, limit, stem, None, {})
    plan = ComponentPlan(comp.name, "diffusers", comp.cls, path.parent, [path], "", stem, None, shards, index_name, {},
                         {}, changed)
    result = ShardResult(file_spec, "to-diffusers", out_path, limit, target, None, dry_run, False, [plan])
    result.notes = to_diffusers_notes(converted, planned, comp, where, target)
    if not dry_run:
        config = json.dumps(dict(sorted(comp.config.items())), indent=2) + "\n"
        _write_result(result, [], {path: in_memory}, {"config.json": config.encode("utf-8")}, progress, verify,
                      overwrite)
    result.seconds = time.perf_counter() - started
    return result


def _write_result(result: ShardResult, copies: list[tuple[Path, str]], legacy: dict, small: dict[str, bytes],
                  progress: Progress, verify: bool, overwrite: bool) -> None:
    """Write every planned shard (and the copies, and `small` files: relative path -> bytes) into a hidden temporary
    folder, verify it, then rename it into place or swap it in (`--in-place`)."""
    out_path = result.output
    parent = out_path.parent
    result.removed_stale += recover(out_path, overwrite or result.in_place)
    copy_bytes = sum(p.stat().st_size for p, _ in copies)
    copy_bytes += sum(len(data) for data in small.values())
    needed = sum(s.file_bytes for c in result.components for s in c.shards) + copy_bytes
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise DmapError(f"Not enough disk space in {parent}: the new files need {format_size(needed)} and "
                        f"{format_size(free)} is free.")

    temp = hidden_name(out_path, TEMP_MARK)
    temp.mkdir()
    try:
        progress.phase("write", needed)
        copy_files(copies, temp, progress)
        for rel, data in small.items():  # files written here, not copied (--to-diffusers: config.json)
            write_small(temp / rel, data)
            progress.advance(len(data))
        finisher = ShardFinisher(verify, progress)
        try:
            for comp in result.components:
                folder = temp / comp.folder
                folder.mkdir(parents=True, exist_ok=True)
                for shard_file in comp.shards:
                    write_shard(folder / shard_file.name, shard_file, legacy, progress, finisher)
                index = comp.index_bytes()
                if index is not None:
                    write_small(folder / comp.index_name, index)
                    if verify:
                        verify_index(folder, comp)
                result.bytes_written += sum(s.file_bytes for s in comp.shards) + len(index or b"")
            if verify:  # what the compare threads have not caught up with yet
                finisher.report_rest_as("verify", result.total_size)
        except BaseException:
            finisher.wait(raise_errors=False)
            raise
        finisher.wait()
        result.bytes_written += copy_bytes
        _fsync_tree(temp)
        result.verified = verify
        if result.in_place:
            swap_in_place(temp, out_path, _swap_folders(temp, result))
        else:
            publish(temp, out_path, overwrite)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)  # gone already once the swap is committed
        if isinstance(error, OSError):
            raise _os_error(error, out_path) from error
        raise


def _finish_interrupted_swaps(source_spec: str) -> list[str]:
    """`--in-place` of the source a killed `--in-place` run left mid-swap finishes that swap first."""
    path = Path(source_spec).expanduser()
    if not path.exists():
        return []
    return finish_swaps(path.resolve() if path.is_dir() else path.resolve().parent)


def _os_error(error: OSError, out_path: Path) -> DmapError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DmapError(f"The disk filled up while writing {out_path}; nothing was left there and the source is "
                         "unchanged: make room and run the same command again.")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DmapError(f"Cannot write {out_path}: {error.strerror}; nothing was left there.")
    return DmapError(f"Writing {out_path} failed ({error.strerror or error}); nothing was left there and the source is unchanged.")


def _fsync_tree(root: Path) -> None:
    for folder, _, _ in os.walk(root):
        fsync_dir(Path(folder))


def _swap_folders(temp: Path, result: ShardResult) -> list[SwapFolder]:
    """What `--in-place` replaces: per component folder, the old weight files and the new ones."""
    return [SwapFolder(comp.source_folder.resolve(), comp.folder, [p.name for p in comp.source_files],
                       comp.output_files()) for comp in result.components]

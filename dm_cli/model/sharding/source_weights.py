"""What `dmap shard` reads: the SOURCE (a folder, a pipeline, one weight file, a legacy `.bin`), each component's
weights as byte ranges of safetensors files or as legacy state dicts, and the names the files carry (stem, variant).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dm_cli.errors import CheckpointError, SourceError
from dm_cli.io.checkpoint import (
    LEGACY_SUFFIXES,
    WEIGHT_STEMS,
    find_component_weights,
    legacy_files_loaded,
    load_legacy_weights,
    open_checkpoint,
)
from dm_cli.model.demo import resolve
from dm_cli.model.sharding.layout import SourceTensor
from dm_cli.model.sources import ComponentSource, Source, read_json

_SHARD_NAME_RE = re.compile(r"^(?P<stem>.+?)(?:\.(?P<variant>\w+))?-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def stem_of(path: Path) -> tuple[str, str | None]:
    """(stem, variant) of an existing weight file or index name."""
    name = path.name
    match = _SHARD_NAME_RE.match(name)
    if match:
        return match["stem"], match["variant"]
    match = re.match(r"^(?P<stem>.+?)\.(?:safetensors|bin)\.index(?:\.(?P<variant>\w+))?\.json$", name)
    if match:
        return match["stem"], match["variant"]
    for suffix in (".safetensors", *LEGACY_SUFFIXES):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            for known in (*WEIGHT_STEMS, "pytorch_model"):
                if base.startswith(known + ".") and "." not in base[len(known) + 1:]:
                    return known, base[len(known) + 1:]
            return base, None
    return path.stem, None


def output_stem(source_stem: str, library: str | None) -> str:
    if source_stem in WEIGHT_STEMS:
        return source_stem
    if source_stem == "pytorch_model" or library == "transformers":
        return "model"
    if library == "diffusers":
        return "diffusion_pytorch_model"
    return source_stem


@dataclass
class SourceWeights:
    """What one component's weights are: files, tensors, carried metadata, legacy state dicts."""

    files: list[Path]
    tensors: list[SourceTensor]
    metadata: dict[str, str]
    dropped: dict[str, str]
    legacy: dict[Path, dict] = field(default_factory=dict)


def _read_safetensors(weights: Path) -> SourceWeights:
    checkpoint = open_checkpoint(weights, strict=True)
    files = {name: weights.parent / name for name in set(checkpoint.tensor_files.values())}
    tensors = [SourceTensor(name, e.dtype, e.shape, files[checkpoint.tensor_files[name]], e.begin, e.end)
               for name, e in checkpoint.tensors.items()]
    metadata: dict[str, str] = {}
    if checkpoint.index is not None:
        for key, value in checkpoint.index.metadata.items():
            if key not in ("total_size", "total_parameters") and isinstance(value, str):
                metadata[key] = value
    else:
        for key, value in next(iter(checkpoint.headers.values())).metadata.items():
            if key != "format":
                metadata[str(key)] = str(value)
    files = list(checkpoint.files) + ([checkpoint.index.path] if checkpoint.index is not None else [])
    return SourceWeights(files, tensors, metadata, {})


def _read_legacy(files: list[Path]) -> SourceWeights:
    """Legacy `.bin`/`.pt` files: tensors sharing storage are written once (huggingface_hub's rule)."""
    legacy: dict[Path, dict] = {}
    tensors: list[SourceTensor] = []
    seen: dict[str, Path] = {}
    groups: dict[tuple, list[str]] = {}
    for path in files:
        state = load_legacy_weights(path)
        legacy[path] = state
        for key, value in state.items():
            if key in seen:
                raise CheckpointError(f"Tensor '{key}' is stored in both {seen[key].name} and {path.name}.")
            seen[key] = path
            if value.numel() > 0:
                identity = (path, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                            tuple(value.stride()), value.dtype)
                groups.setdefault(identity, []).append(key)
    dropped: dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:
            kept, *others = sorted(names)
            for other in others:
                dropped[other] = kept
    for path, state in legacy.items():
        for key, value in state.items():
            if key not in dropped:
                tensors.append(SourceTensor(key, str(value.dtype).removeprefix("torch."), tuple(value.shape), path, legacy=True))
    metadata = dict(dropped)
    return SourceWeights(list(files), tensors, metadata, dropped, legacy)


def component_weights(comp, variant: str | None) -> tuple[SourceWeights, Path]:
    """Read a component's weights (safetensors preferred, as the loaders do); returns (weights, naming file)."""
    weights = comp.weights
    if comp.folder is not None and comp.folder.is_dir() and (variant or weights is None):
        weights = (find_component_weights(comp.folder, variant) if variant else None) or weights
    if weights is not None and weights.suffix in LEGACY_SUFFIXES:
        return _read_legacy([weights]), weights
    if weights is not None:
        return _read_safetensors(weights), weights
    if comp.folder is not None:
        files = legacy_files_loaded(comp.folder, variant, list(comp.legacy_weights)) or (
            legacy_files_loaded(comp.folder, None, list(comp.legacy_weights)) if variant else None
        )
        if files:
            shards = [f for f in files if not f.name.endswith(".json")]
            loaded = _read_legacy(shards)
            loaded.files = files
            return loaded, files[-1] if files[-1].name.endswith(".json") else files[0]
    where = comp.folder if comp.folder is not None else comp.name
    raise SourceError(f"Component '{comp.name}' ({where}) has no weights to shard (no .safetensors or .bin file).")


def resolve_shard_source(spec: str):
    """A Source for SOURCE; legacy `.bin`/`.pt` files are accepted here too."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix in LEGACY_SUFFIXES:
        config_path = path.parent / "config.json"
        library, cls, config = None, "?", None
        if config_path.is_file():
            config = read_json(config_path, "config.json")
            library = "diffusers" if "_class_name" in config else ("transformers" if config.get("architectures") else None)
            cls = str(config.get("_class_name") or (config.get("architectures") or ["?"])[0])
        comp = ComponentSource(stem_of(path)[0], library, cls, config, path.parent, path)
        return Source(spec, "weights", path.parent, components=[comp])
    return resolve(spec)


def default_output(source) -> Path:
    root = source.root
    if source.kind == "weights":
        weights = source.components[0].weights
        return weights.parent / f"{stem_of(weights)[0]}-sharded"
    return root.parent / f"{root.name}-sharded"

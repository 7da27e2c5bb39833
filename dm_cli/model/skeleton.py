"""Skeletons: the planner's view of one component, built once on the meta device and cached.

A skeleton is plain data: the module tree (registration order, classes), every parameter and
buffer with shape and dtype, tie groups and the no-split classes. Sizes at any dtype are computed
from it without torch, so a cached skeleton makes `inspect` and `plan` torch-free. Execution order
and activation peaks depend on the inputs, so they live beside it in the trace cache (trace.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from dm_cli.errors import DmapError, SourceError
from dm_cli.io.cache import cache_key, read_cached, write_cached
from dm_cli.io.checkpoint import legacy_files_loaded, load_legacy_weights, open_checkpoint
from dm_cli.model.formats.prequantized import check_readable, held_bytes
from dm_cli.model.formats.weight_formats import STORAGE_DTYPES, low_precision_bytes, low_precision_tags
from dm_cli.model.models import before_diffusers_import, build_model
from dm_cli.units import DTYPE_BYTES, FLOATING_DTYPES, numel

SKELETON_FORMAT_VERSION = 4  # 4: nf4 tags


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # as built (float32 on meta) or as stored in the checkpoint
    kind: str  # "param", "buffer" (persistent) or "buffer_np" (non-persistent: not in checkpoints)
    fp32_when: tuple[str, ...] = ()  # target dtypes for which this tensor stays float32
    low_precision: tuple[str, ...] = ()  # weight formats that store it in low precision (weight_formats.py)
    quantized_bytes: int = 0  # > 0: a GGUF tensor that stays quantized once loaded (dtype is its ggml type)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def dtype_at(self, target: str | None, weights: str | None = None) -> str:
        """The dtype this tensor has once the component is loaded at `target` (None: as stored),
        with its weights stored as `weights` (fp8, int8; None: in the run dtype)."""
        if self.dtype not in FLOATING_DTYPES:
            return self.dtype  # integer buffers are never cast
        if weights is not None and weights in self.low_precision:
            return STORAGE_DTYPES[weights]
        if target is None:
            return self.dtype
        return "float32" if target in self.fp32_when else target

    def bytes_at(self, target: str | None, weights: str | None = None) -> int:
        if self.quantized_bytes:
            return self.quantized_bytes
        if weights is not None and weights in self.low_precision and self.dtype in FLOATING_DTYPES:
            return low_precision_bytes(weights, self.shape, self.numel)
        return self.numel * DTYPE_BYTES[self.dtype_at(target)]


@dataclass
class ModuleSize:
    name: str
    cls: str
    params: int
    bytes: int
    no_split: bool
    children: list[str]


@dataclass
class Skeleton:
    name: str
    library: str | None
    cls: str
    no_split_modules: list[str]
    modules: list[tuple[str, str]]  # (prefix, class) in registration order; "" is the root
    tensors: list[TensorInfo]  # tied aliases excluded (listed in tie_groups)
    tie_groups: list[list[str]] = field(default_factory=list)  # [kept name, alias, ...]
    stored: bool = False  # True when tensor dtypes come from a checkpoint header
    note: str | None = None  # where the dtypes came from when that is worth saying (legacy weights)

    # --- sizes -----------------------------------------------------------------------------

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind == "param")

    def bytes_at(self, dtype: str | None, weights: str | None = None) -> int:
        return sum(t.bytes_at(dtype, weights) for t in self.tensors)

    def default_dtype(self) -> str | None:
        """Stored dtype for checkpoints (None: as stored), bfloat16 for config-only skeletons and for quantized
        (GGUF) ones, whose plain tensors diffusers casts to the compute dtype."""
        return None if self.stored and not self.quantized else "bfloat16"

    @property
    def quantized(self) -> bool:
        return any(t.quantized_bytes for t in self.tensors)

    def dominant_dtype(self, dtype: str | None, weights: str | None = None) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors:
            if t.kind == "param" and not t.quantized_bytes:
                d = t.dtype_at(dtype, weights)
                counts[d] = counts.get(d, 0) + t.numel
        return max(counts, key=counts.get) if counts else (dtype or "float32")

    def compute_dtype(self) -> str:
        """The dtype an as-stored component runs in: its dominant dtype, not counting fp8 storage."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            if t.kind == "param" and t.dtype in FLOATING_DTYPES and t.dtype not in STORAGE_DTYPES.values():
                counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
        return max(counts, key=counts.get) if counts else "bfloat16"

    def module_sizes(self, dtype: str | None, weights: str | None = None) -> dict[str, ModuleSize]:
        """Every module with the params/bytes of its whole subtree, in registration order.

        Each tensor is added to its nearest module, then totals flow up the tree once: linear in
        modules + tensors (a header with a million tensors has as many modules)."""
        no_split = set(self.no_split_modules)
        sizes = {prefix: ModuleSize(prefix, cls, 0, 0, cls in no_split, []) for prefix, cls in self.modules}
        if "" not in sizes:
            sizes[""] = ModuleSize("", self.cls, 0, 0, False, [])
        parents: dict[str, str] = {}
        for prefix in sizes:
            if prefix:
                parent = self._nearest(prefix.rpartition(".")[0], sizes)
                parents[prefix] = parent
                sizes[parent].children.append(prefix)
        for tensor in self.tensors:
            node = sizes[self._nearest(tensor.name.rpartition(".")[0], sizes)]
            node.bytes += tensor.bytes_at(dtype, weights)
            if tensor.kind == "param":
                node.params += tensor.numel
        order = [""]  # breadth first from the root: reversed, every child comes before its parent
        for prefix in order:
            order.extend(sizes[prefix].children)
        for prefix in reversed(order[1:]):
            node, parent = sizes[prefix], sizes[parents[prefix]]
            parent.params += node.params
            parent.bytes += node.bytes
        return sizes

    @staticmethod
    def _nearest(prefix: str, sizes: dict) -> str:
        while prefix not in sizes:
            prefix = prefix.rpartition(".")[0]
        return prefix

    def blocks(self, dtype: str | None, weights: str | None = None) -> list[ModuleSize]:
        """Top-level no-split blocks: the units a split never cuts through."""
        if not self.no_split_modules:
            return []
        sizes = self.module_sizes(dtype, weights)
        found: list[ModuleSize] = []
        pending = [""]
        while pending:  # depth first, in registration order, without recursion (trees can be deep)
            node = sizes[pending.pop()]
            if node.no_split and node.name:
                found.append(node)
            else:
                pending.extend(reversed(node.children))
        return found

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": "dmap-skeleton",
            "version": SKELETON_FORMAT_VERSION,
            "name": self.name,
            "library": self.library,
            "class": self.cls,
            "no_split_modules": self.no_split_modules,
            "modules": [list(m) for m in self.modules],
            "tensors": [[t.name, list(t.shape), t.dtype, t.kind, list(t.fp32_when), list(t.low_precision)]
                        for t in self.tensors],
            "tie_groups": self.tie_groups,
            "stored": self.stored,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Skeleton":
        if data.get("format") != "dmap-skeleton" or data.get("version") != SKELETON_FORMAT_VERSION:
            raise ValueError("not a current dmap skeleton")
        return cls(
            name=data["name"],
            library=data["library"],
            cls=data["class"],
            no_split_modules=list(data["no_split_modules"]),
            modules=[(m[0], m[1]) for m in data["modules"]],
            tensors=[TensorInfo(t[0], tuple(t[1]), t[2], t[3], tuple(t[4]), tuple(t[5])) for t in data["tensors"]],
            tie_groups=[list(g) for g in data["tie_groups"]],
            stored=bool(data.get("stored")),
        )

    def with_single_file(self, stored: dict) -> "Skeleton":
        """Same skeleton, each tensor as a single file stores it (`single_file_weights.StoredTensor` by diffusers'
        name): a plain dtype, or a GGUF type with its quantized bytes. diffusers' GGUF loader dequantizes the
        tensors of modules kept in float32 (`_keep_in_fp32_modules`) to float32 at load."""
        tensors = []
        for t in self.tensors:
            kept = stored.get(t.name)
            if kept is None:
                tensors.append(t)
            elif kept.quantized_bytes and t.fp32_when:
                tensors.append(replace(t, dtype="float32"))
            else:
                tensors.append(replace(t, dtype=kept.dtype, low_precision=() if kept.quantized_bytes else t.low_precision,
                                       quantized_bytes=kept.quantized_bytes))
        return replace(self, tensors=tensors, stored=True)

    def with_checkpoint_dtypes(self, stored: dict[str, str]) -> "Skeleton":
        """Same skeleton, dtypes as a checkpoint stores them (names it lacks keep the built dtype)."""
        tensors = [
            TensorInfo(t.name, t.shape, stored.get(t.name, t.dtype), t.kind, t.fp32_when, t.low_precision)
            for t in self.tensors
        ]
        return Skeleton(
            self.name, self.library, self.cls, self.no_split_modules, self.modules, tensors, self.tie_groups, stored=True
        )


def skeleton_from_header(name: str, entries: dict) -> Skeleton:
    """A skeleton from safetensors headers alone (no config: classes unknown, no no-split info)."""
    modules: dict[str, str] = {"": "?"}
    tensors = []
    for tensor_name, entry in entries.items():
        new = []
        prefix = tensor_name.rpartition(".")[0]
        while prefix not in modules:  # parents before children, as a model registers them
            new.append(prefix)
            prefix = prefix.rpartition(".")[0]
        for prefix in reversed(new):
            modules[prefix] = "?"
        tensors.append(TensorInfo(tensor_name, tuple(entry.shape), entry.dtype, "param"))
    return Skeleton(name, None, "?", [], list(modules.items()), tensors, stored=True)


# --- building on the meta device (needs torch) --------------------------------------------------


def _fp32_rules(model, library: str) -> list[tuple[str, tuple[str, ...]]]:
    """Module-name patterns kept in float32, and for which target dtypes, as each library loads them."""
    rules = []
    if library == "transformers":
        for pattern in getattr(model, "_keep_in_fp32_modules", None) or []:
            rules.append((pattern, ("float16",)))
        for pattern in getattr(model, "_keep_in_fp32_modules_strict", None) or []:
            rules.append((pattern, ("float16", "bfloat16")))
    else:
        for pattern in getattr(model, "_keep_in_fp32_modules", None) or []:
            rules.append((pattern, ("float16", "bfloat16")))
    return rules


def _fp32_when(tensor_name: str, rules: list[tuple[str, tuple[str, ...]]]) -> tuple[str, ...]:
    parts = tensor_name.split(".")
    when: set[str] = set()
    for pattern, dtypes in rules:
        if pattern in parts or f".{pattern}." in f".{tensor_name}.":
            when.update(dtypes)
    return tuple(sorted(when))


def _no_split_modules(model) -> list[str]:
    """Blocks that must stay on one device; models that declare none (LTX-2's transformer) still name their
    repeated blocks for regional compilation, and those are the units a split may cut between."""
    declared: list[str] = []
    getter = getattr(model, "_get_no_split_modules", None)
    if getter is not None:
        try:
            declared = sorted(getter("auto"))
        except Exception:  # older signatures or models that raise for missing attributes
            declared = []
    declared = declared or sorted(getattr(model, "_no_split_modules", None) or [])
    return declared or sorted(getattr(model, "_repeated_blocks", None) or [])


def skeleton_from_model(name: str, library: str | None, model) -> Skeleton:
    """Read a built (meta) torch module into a Skeleton: tied parameters once, buffers typed."""
    rules = _fp32_rules(model, library or "")
    modules = [(prefix, type(module).__name__) for prefix, module in model.named_modules()]
    tensors: list[TensorInfo] = []
    first_name: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in first_name:
            aliases[first_name[key]].append(param_name)
            continue
        first_name[key] = param_name
        aliases[param_name] = []
        dtype = str(param.dtype).removeprefix("torch.")
        tensors.append(TensorInfo(param_name, tuple(param.shape), dtype, "param", _fp32_when(param_name, rules)))
    for module_prefix, module in model.named_modules():
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is None:
                continue
            full = f"{module_prefix}.{buffer_name}" if module_prefix else buffer_name
            key = id(buffer)
            if key in first_name:
                aliases[first_name[key]].append(full)
                continue
            first_name[key] = full
            aliases[full] = []
            kind = "buffer_np" if buffer_name in non_persistent else "buffer"
            dtype = str(buffer.dtype).removeprefix("torch.")
            tensors.append(TensorInfo(full, tuple(buffer.shape), dtype, kind, _fp32_when(full, rules)))
    tie_groups = [[kept, *names] for kept, names in aliases.items() if names]
    tags = low_precision_tags(model)
    for index, tensor in enumerate(tensors):
        members = [tensor.name, *aliases[tensor.name]]
        formats = {fmt for member in members for fmt in tags.get(member, ())}
        if len(members) > 1:
            formats -= {"int8", "nf4"}  # quantizing one user of a shared weight would untie it
        tensors[index] = replace(tensor, low_precision=tuple(sorted(formats)))
    return Skeleton(name, library, type(model).__name__, _no_split_modules(model), modules, tensors, tie_groups)


MAX_LAYERS = 1000  # the largest diffusion models have < 100 blocks; 1e5 would take hours on meta


def _check_layer_counts(class_name: str, config: dict) -> None:
    """A config asking for an absurd number of layers is refused before building anything."""
    for key, value in config.items():
        if re.search(r"(layers|blocks|depth)(_per_block)?$", key) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value > MAX_LAYERS:
            raise SourceError(f"The config of {class_name} asks for {key}={value!r}, above the {MAX_LAYERS} dmap "
                              "accepts: the config is corrupt or not a diffusion model's.")


def build_on_meta(library: str, class_name: str, config: dict):
    """Instantiate a component class on the meta device from its config dict (dm_cli.model.models).

    A config is input like any other: whatever the class raises on it becomes one sentence."""
    _check_layer_counts(class_name, config)
    try:
        return build_model(library, class_name, config, device="meta")
    except DmapError:
        raise
    except Exception as error:  # noqa: BLE001 - a bad value in a config is bad input, not a bug
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise SourceError(f"Cannot build {class_name} from its config ({type(error).__name__}: {first}).") from error



def guess_library(class_name: str) -> str | None:
    """Which library has `class_name`, for a config.json that does not say."""
    before_diffusers_import()
    # diffusers and transformers: imported on use, so start-up stays free of torch
    import diffusers
    import transformers

    if hasattr(diffusers, class_name):
        return "diffusers"
    if hasattr(transformers, class_name):
        return "transformers"
    return None


# --- cache ----------------------------------------------------------------------------------


def load_skeleton(name: str, library: str | None, class_name: str, config: dict, use_cache: bool = True) -> Skeleton:
    """The skeleton of one component from its config: from the cache, else built on meta and cached."""
    key = cache_key({"library": library, "class": class_name, "config": config, "format": SKELETON_FORMAT_VERSION})
    cached = read_cached("skeletons", key) if use_cache else None
    if cached is not None:
        try:
            skeleton = Skeleton.from_json(cached)
            skeleton.name = name
            return skeleton
        except Exception:  # noqa: BLE001 - a damaged entry of any shape is rebuilt, never an error
            pass  # stale or damaged cache entry: rebuild
    if library is None:
        library = guess_library(class_name)
        if library is None:
            raise SourceError(f"Class '{class_name}' is in neither diffusers nor transformers: dmap cannot build it.")
    model = build_on_meta(library, class_name, config)
    skeleton = skeleton_from_model(name, library, model)
    if use_cache:
        write_cached("skeletons", key, skeleton.to_json())
    return skeleton


OUTPUT_EMBEDDINGS = "lm_head.weight"  # transformers ties it to the input embeddings when tie_word_embeddings


def _output_aliases(skeleton: Skeleton) -> set[str]:
    return {a for g in skeleton.tie_groups for a in g[1:] if a == OUTPUT_EMBEDDINGS or a.endswith("." + OUTPUT_EMBEDDINGS)}


@dataclass
class LoadedComponent:
    """A component as from_pretrained keeps it, with its skeleton and checkpoint read once."""

    comp: object  # the ComponentSource as loaded (its config untied when `note` says so)
    skeleton: Skeleton
    checkpoint: object | None  # the opened safetensors checkpoint, if any
    as_built: Skeleton  # the skeleton its config builds (differs from `skeleton` only when untied)
    note: str | None = None  # why what loads differs from what the config builds


def as_loaded(comp, use_cache: bool = True) -> LoadedComponent:
    """The component as from_pretrained keeps it, and a sentence when that differs from its config.

    transformers ties the output embeddings (lm_head) to the input embeddings when
    `tie_word_embeddings` is true, which Mistral-3's config class assumes when config.json does not
    say; but when the checkpoint stores lm_head beside the embeddings with other values, transformers 5
    keeps both. So: a checkpoint that stores lm_head, or a config-only source whose config.json leaves
    the key unset (the published checkpoints of such models store lm_head), is planned untied
    (`tie_word_embeddings: false`), the count a loader really holds.
    """
    skeleton, checkpoint = skeleton_for_component(comp, use_cache=use_cache)
    as_is = LoadedComponent(comp, skeleton, checkpoint, skeleton)
    config = comp.config or {}
    if comp.library != "transformers" or config.get("tie_word_embeddings") is False:
        return as_is
    aliases = _output_aliases(skeleton)
    if checkpoint is not None:
        aliases &= set(checkpoint.tensors)
    elif "tie_word_embeddings" in config:
        aliases = set()
    if not aliases:
        return as_is
    untied = replace(comp, config={**config, "tie_word_embeddings": False})
    loaded = _skeleton_of(untied, checkpoint, use_cache)
    why = ("its checkpoint stores " + ", ".join(sorted(aliases)) if checkpoint is not None
           else "config.json does not set tie_word_embeddings")
    return LoadedComponent(untied, loaded, checkpoint, skeleton, (
        f"{comp.name} ({skeleton.cls}): {why}; transformers ties {', '.join(sorted(aliases))} to the input "
        f"embeddings when it builds the model from config ({skeleton.params:,} params), but keeps a separately "
        f"stored one untied: planned as loaded untied, {loaded.params:,} params."
    ))


def skeleton_for_component(comp, use_cache: bool = True):
    """(skeleton, checkpoint or None) for a ComponentSource: config on meta, dtypes from headers.

    The entry point `inspect`, `plan` and `run` size a component through (by way of `as_loaded`).
    """
    checkpoint = open_checkpoint(comp.weights, strict=False) if comp.weights is not None else None
    return _skeleton_of(comp, checkpoint, use_cache), checkpoint


def _skeleton_of(comp, checkpoint, use_cache: bool) -> Skeleton:
    if comp.config is not None:
        skeleton = load_skeleton(comp.name, comp.library, comp.cls, comp.config, use_cache=use_cache)
        if getattr(comp, "single_file", None) is not None:
            return skeleton.with_single_file(comp.single_file.tensors)
        if checkpoint is not None:
            skeleton = skeleton.with_checkpoint_dtypes({n: e.dtype for n, e in checkpoint.tensors.items()})
            skeleton = with_prequantized(comp, skeleton, checkpoint)
        elif getattr(comp, "legacy_weights", None) and comp.folder is not None:
            dtypes, note = legacy_dtypes(comp)
            if dtypes is not None:
                skeleton = skeleton.with_checkpoint_dtypes(dtypes)
            skeleton.note = note
        return skeleton
    if checkpoint is not None:
        return skeleton_from_header(comp.name, checkpoint.tensors)
    raise SourceError(f"Component '{comp.name}' has neither a config nor weights.")


def with_prequantized(comp, skeleton: Skeleton, checkpoint) -> Skeleton:
    """A folder saved quantized (`quantization_config`, `formats/prequantized.py`): each quantized weight at the bytes
    it holds with its statistics, kept quantized (never cast); a note names the format. Others: unchanged."""
    fmt = check_readable(comp.name, comp.config)
    if fmt is None:
        return skeleton
    held = held_bytes(checkpoint.tensors, fmt)
    tensors = [replace(t, low_precision=(), quantized_bytes=held[t.name]) if t.name in held else t for t in skeleton.tensors]
    out = replace(skeleton, tensors=tensors)
    out.note = (f"{comp.name}: saved quantized by bitsandbytes ({fmt}): {len(held)} layers as stored, "
                f"{sum(held.values()):,} bytes with their statistics; dmap loads them without re-quantizing.")
    return out


def legacy_dtypes(comp) -> tuple[dict[str, str] | None, str]:
    """Stored dtypes of a component's `.bin`/`.pt` weights, and a note saying how (or why not) they were read.

    `torch.load(weights_only=True, mmap=True)`: no code runs, and tensor data stays on disk.
    """
    try:
        files = [f for f in legacy_files_loaded(comp.folder, None, list(comp.legacy_weights)) or []
                 if not f.name.endswith(".json")]
        if not files:
            return None, f"{comp.name}: no weight file a loader would read: sizes are at the config's default dtype (bf16)."
        dtypes = {}
        for path in files:
            for name, tensor in load_legacy_weights(path).items():
                dtypes[name] = str(tensor.dtype).removeprefix("torch.")
    except DmapError as error:
        return None, f"{comp.name}: dtypes of its legacy weights were not read ({error}) — sizes assume bf16."
    names = ", ".join(f.name for f in files)
    return dtypes, f"{comp.name}: dtypes read from legacy weights {names} (torch.load, weights only, memory-mapped)."

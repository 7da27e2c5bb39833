"""`dmap inspect`: what is in a model and how big each part is, without loading weights."""

from __future__ import annotations

from dataclasses import dataclass, field

from dm_cli.errors import SourceError, UsageError
from dm_cli.model.demo import resolve
from dm_cli.model.formats.gguf_files import module_rows, read_gguf_header, summary, type_summary
from dm_cli.model.formats.single_file_layout import recognize
from dm_cli.model.formats.weight_formats import STORAGE_DTYPES, component_format, parse_weights_spec
from dm_cli.model.skeleton import ModuleSize, Skeleton, as_loaded
from dm_cli.model.sources import GGUF_SUFFIX, Source, gguf_file


@dataclass
class ComponentReport:
    name: str
    library: str | None
    cls: str
    dtype: str  # dominant dtype of the parameters as they would be loaded
    params: int
    bytes: int
    buffers_bytes: int
    num_blocks: int
    largest_block: ModuleSize | None
    no_split_modules: list[str]
    weights: str | None  # path of the index / file, None for config-only
    tree: list[dict] = field(default_factory=list)  # module rows to --depth
    problems: list[str] = field(default_factory=list)
    storage_dtype: str | None = None  # float8_e4m3fn / int8 with --weights (None: as `dtype`)

    def to_json(self) -> dict:
        block = self.largest_block
        return {
            "name": self.name,
            "library": self.library,
            "class": self.cls,
            "dtype": self.dtype,
            "params": self.params,
            "bytes": self.bytes,
            "buffers_bytes": self.buffers_bytes,
            "num_blocks": self.num_blocks,
            "largest_block": None if block is None else {"name": block.name, "class": block.cls, "bytes": block.bytes},
            "no_split_modules": self.no_split_modules,
            "weights": self.weights,
            "storage_dtype": self.storage_dtype,
            "tree": self.tree,
            "problems": self.problems,
        }


@dataclass
class InspectReport:
    source: str
    kind: str
    pipeline_class: str | None
    dtype: str | None  # requested dtype; None = as stored / bf16 for configs
    components: list[ComponentReport]
    notes: list[str] = field(default_factory=list)
    gguf: dict | None = None  # a GGUF file: dm_cli.model.formats.gguf_files.summary (format, metadata, types, tensors)
    single_file: dict | None = None  # an original-layout single file: dm_cli.model.formats.single_file_layout.recognize

    @property
    def total_params(self) -> int:
        return sum(c.params for c in self.components)

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    @property
    def problems(self) -> list[str]:
        return [p for c in self.components for p in c.problems]

    def to_json(self) -> dict:
        document = {
            "source": self.source,
            "kind": self.kind,
            "pipeline_class": self.pipeline_class,
            "dtype": self.dtype,
            "components": [c.to_json() for c in self.components],
            "total": {"params": self.total_params, "bytes": self.total_bytes},
            "problems": self.problems,
            "notes": self.notes,
        }
        if self.gguf is not None:
            document["gguf"] = self.gguf
        if self.single_file is not None:
            document["single_file"] = self.single_file
        return document


def module_tree(skeleton: Skeleton, dtype: str | None, depth: int, weights: str | None = None) -> list[dict]:
    """Rows of the module tree down to `depth` levels below the root, each with its subtree sizes."""
    sizes = skeleton.module_sizes(dtype, weights)
    rows: list[dict] = []

    def walk(prefix: str, level: int) -> None:
        node = sizes[prefix]
        if prefix:
            rows.append({"name": prefix, "class": node.cls, "depth": level, "params": node.params,
                         "bytes": node.bytes, "no_split": node.no_split})
        if level < depth:
            for child in node.children:
                if sizes[child].bytes or sizes[child].children:
                    walk(child, level + 1)

    walk("", 0)
    return rows


def inspect_source(spec: str, dtype: str | None = None, component: str | None = None, depth: int = 0,
                   use_cache: bool = True, weights: str | None = None) -> InspectReport:
    """`weights`: a --weights spec (fp8, int8, transformer=fp8,...): sizes with those tensors in low precision."""
    gguf = gguf_file(spec)
    if gguf is not None:
        return inspect_gguf(spec, gguf, dtype=dtype, component=component, depth=depth, weights=weights)
    source: Source = resolve(spec)
    comps = [source.component(component)] if component else source.components
    formats = parse_weights_spec(weights, [c.name for c in comps])
    reports = []
    notes = list(source.notes)
    single = None
    for comp in comps:
        loaded = as_loaded(comp, use_cache=use_cache)
        checkpoint = loaded.checkpoint
        if loaded.note is not None:  # with weights, what loads; config only, as built (and say what plan counts)
            notes.append(loaded.note)
        if source.kind == "weights" and comp.config is None and checkpoint is not None and checkpoint.index is None:
            single = recognize(checkpoint.tensors)
        comp, skeleton = (loaded.comp, loaded.skeleton) if comp.weights is not None else (comp, loaded.as_built)
        fmt = component_format(formats, comp.name, skeleton)
        if skeleton.note:
            notes.append(skeleton.note)
        effective = dtype if dtype is not None else skeleton.default_dtype()
        blocks = skeleton.blocks(effective, fmt)
        reports.append(
            ComponentReport(
                name=comp.name,
                library=comp.library,
                cls=skeleton.cls if skeleton.cls != "?" else comp.cls,
                dtype=skeleton.dominant_dtype(effective, fmt),
                params=skeleton.params,
                bytes=skeleton.bytes_at(effective, fmt),
                buffers_bytes=sum(t.bytes_at(effective, fmt) for t in skeleton.tensors if t.kind != "param"),
                num_blocks=len(blocks),
                largest_block=max(blocks, key=lambda b: b.bytes) if blocks else None,
                no_split_modules=skeleton.no_split_modules,
                weights=str(comp.weights) if comp.weights else None,
                tree=module_tree(skeleton, effective, depth, fmt) if depth > 0 else [],
                problems=[str(p) for p in checkpoint.problems] if checkpoint else [],
                storage_dtype=STORAGE_DTYPES[fmt] if fmt else None,
            )
        )
    return InspectReport(spec, source.kind, source.pipeline_class, dtype, reports, notes, single_file=single)



def inspect_gguf(spec: str, path, dtype: str | None = None, component: str | None = None, depth: int = 0,
                 weights: str | None = None) -> InspectReport:
    """A GGUF file from its header alone: one component, every tensor as stored (quantized blocks), by ggml type."""
    for option, value in (("--dtype", dtype), ("--weights", weights)):
        if value is not None:
            raise UsageError(f"{option} does not apply to a GGUF file: its tensors are sized as stored, quantized.")
    header = read_gguf_header(path)
    name = path.name[: -len(GGUF_SUFFIX)] or path.name
    if component is not None and component != name:
        raise SourceError(f"{spec} has no component '{component}': it has {name}.")
    types = type_summary(header.tensors)
    params = {t: row["params"] for t, row in types.items()}
    report = ComponentReport(
        name=name, library=None, cls="?", dtype=max(params, key=params.get) if params else "-",
        params=sum(params.values()), bytes=header.data_bytes, buffers_bytes=0, num_blocks=0, largest_block=None,
        no_split_modules=[], weights=str(path), tree=module_rows(header.tensors, depth) if depth > 0 else [],
    )
    return InspectReport(spec, "gguf", None, None, [report], gguf=summary(header))

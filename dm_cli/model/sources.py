"""Resolve a SOURCE (path, preset or Hub repo id) into components with configs and weights.

No torch here: resolution reads JSON files only, so cached skeletons keep `inspect` fast.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dm_cli.errors import CheckpointError, SourceError
from dm_cli.io.checkpoint import find_component_weights, legacy_weight_files, read_json_object
from dm_cli.io.input_images import shown_path
from dm_cli.io.swap import pending_swap

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"

# preset name -> bundled folder under presets/
PRESETS = {
    "flux": "flux.1-dev",
    "flux-dev": "flux.1-dev",
    "flux-schnell": "flux.1-schnell",
    "flux-kontext": "flux.1-kontext-dev",
    "flux-dev-img2img": "flux.1-dev-img2img",
    "sdxl": "sdxl-base-1.0",
    "sd15": "sd-1.5",
    "sd3": "sd3-medium",
    "sd3-medium": "sd3-medium",
    "tiny-flux": "tiny-flux",
    "tiny-flux-kontext": "tiny-flux-kontext",
    "tiny-flux-img2img": "tiny-flux-img2img",
    "tiny-sdxl": "tiny-sdxl",
    "tiny-sd15": "tiny-sd15",
    "tiny-sd3": "tiny-sd3",
    "flux2": "flux.2-dev",
    "flux2-dev": "flux.2-dev",
    "flux2-klein": "flux.2-klein-4b",
    "tiny-flux2": "tiny-flux2",
    "tiny-flux2-klein": "tiny-flux2-klein",
    "wan2.2": "wan2.2-t2v-a14b",
    "wan2.2-t2v-a14b": "wan2.2-t2v-a14b",
    "tiny-wan": "tiny-wan",
    "wan2.2-i2v": "wan2.2-i2v-a14b",
    "wan2.2-i2v-a14b": "wan2.2-i2v-a14b",
    "wan2.2-ti2v": "wan2.2-ti2v-5b",
    "wan2.2-ti2v-5b": "wan2.2-ti2v-5b",
    "tiny-wan-i2v": "tiny-wan-i2v",
    "tiny-wan-ti2v": "tiny-wan-ti2v",
    "qwen-image": "qwen-image",
    "tiny-qwenimage": "tiny-qwenimage",
    "qwen-image-edit": "qwen-image-edit-2511",
    "qwen-image-edit-2511": "qwen-image-edit-2511",
    "tiny-qwenimage-edit": "tiny-qwenimage-edit",
    "tiny-qwenimage-edit-single": "tiny-qwenimage-edit-single",
    "qwen-image-img2img": "qwen-image-img2img",
    "tiny-qwenimage-img2img": "tiny-qwenimage-img2img",
    "z-image": "z-image-turbo",
    "z-image-turbo": "z-image-turbo",
    "tiny-zimage": "tiny-zimage",
    "ltx-2": "ltx-2",
    "tiny-ltx2": "tiny-ltx2",
}

# The bundled random-weight demo pipeline (dm_cli.model.demo), generated into the cache on first use: a SOURCE name like a
# preset, tried after paths (a folder called `demo` here wins).
DEMO_SOURCE = "demo"

# Components that hold no weights: copied, never planned.
WEIGHTLESS_HINTS = ("Tokenizer", "Scheduler", "FeatureExtractor", "ImageProcessor", "Processor")

# Listed by some pipelines but optional at load time (diffusers loads them as None when absent).
OPTIONAL_COMPONENTS = ("safety_checker", "feature_extractor", "image_encoder")

GGUF_SUFFIX = ".gguf"  # llama.cpp's format (quantized community checkpoints): inspect only, header first

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+)?$")
_HUB_PART_RE = re.compile(r"^(?!\.\.?$)[\w.-]+$")  # a plain name: never "." or ".."


@dataclass
class ComponentSource:
    """One component: where its config and weights are (either may be missing)."""

    name: str
    library: str | None
    cls: str
    config: dict | None
    folder: Path | None
    weights: Path | None  # index JSON or single .safetensors file
    legacy_weights: list[Path] = field(default_factory=list)  # .bin/.pt files, for shard
    # `dmap plan FILE --pipeline P`: a single_file_weights.SingleFileWeights, the weights as the file stores them (not
    # imported here: that module resolves sources)
    single_file: object | None = None


@dataclass
class Source:
    spec: str
    kind: str  # "pipeline", "component" or "weights"
    root: Path | None
    pipeline_class: str | None = None
    preset: str | None = None
    model_index: dict | None = None
    components: list[ComponentSource] = field(default_factory=list)  # weighted components
    other_components: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hub_snapshot: Path | None = None  # set when resolved from the Hugging Face cache: never written into

    def component(self, name: str) -> ComponentSource:
        for comp in self.components:
            if comp.name == name:
                return comp
        names = ", ".join(c.name for c in self.components)
        raise SourceError(f"{self.spec} has no component '{name}': it has {names}.")


def accepted_forms() -> str:
    presets = ", ".join(PRESETS)
    return (
        "a pipeline folder (model_index.json), a component folder (config.json), a .safetensors file, "
        f"an *.index.json file, a Hub repo id such as black-forest-labs/FLUX.1-dev, {DEMO_SOURCE} (the random-weight "
        f"demo pipeline), or a preset: {presets}"
    )


def preset_refusal(preset: str) -> str:
    """Why `dmap run PRESET` cannot run a preset (configs only), and how to get a pipeline that can."""
    if preset.startswith("tiny-"):
        return (f"'{preset}' is a preset: dmap bundles its configs, not weights; `dmap demo {preset} -o DIR` writes it "
                f"with random weights, then run `dmap run DIR ...`.")
    return (f"'{preset}' is a preset: dmap bundles its configs for inspect and plan, never weights. Give dmap run a "
            "pipeline folder with weights (or a Hub repo id in the local cache); without SOURCE (or with "
            f"{DEMO_SOURCE}) it runs the random-weight demo, and `dmap demo tiny-... -o DIR` writes a tiny preset "
            "with random weights.")


def read_json(path: Path, what: str) -> dict:
    """A config or model_index.json of a SOURCE, read as the hostile input it may be (checkpoint.read_json_object)."""
    if not os.path.lexists(path):
        raise SourceError(f"{what} is missing: {path}.")
    try:
        return read_json_object(path, what)
    except CheckpointError as error:
        raise SourceError(f"{error} Fix or re-download it.") from None


def is_identifier(name) -> bool:
    """Component names (plain folders of the pipeline, as diffusers requires) and class names.

    Anything else (`../../etc`, `/abs`, `a/b`, an empty name) would make dmap read or write outside
    the source or the output, or name something that is not a class, so it is refused.
    """
    return isinstance(name, str) and name.isascii() and name.isidentifier()


def resolve_source(spec: str) -> Source:
    """SOURCE forms tried in the documented order (docs/CONTRACTS.md): path, preset, Hub repo id."""
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_path(spec, path)
    if spec in PRESETS:
        source = _resolve_path(spec, PRESETS_DIR / PRESETS[spec])
        source.preset = spec
        return source
    if spec == DEMO_SOURCE:  # generated on first use by dm_cli.model.demo.resolve, which callers use for it
        raise SourceError("The demo pipeline is resolved by dm_cli.model.demo.resolve, not here.")
    broken = _broken_link(path)
    if broken:
        raise SourceError(f"SOURCE {spec} {broken}.")
    if looks_like_path(spec):
        raise SourceError(f"No such path: {spec} (SOURCE looks like a file or folder, and nothing is there).")
    parent = path.parent
    if parent != Path(".") and parent.is_dir():  # models/flux with a models/ folder here: a path, not a repo id
        raise SourceError(f"No such path: {spec} (the folder {parent} is here, but has no {path.name}).")
    if _REPO_ID_RE.match(spec):
        return _resolve_hub(spec)
    close = difflib.get_close_matches(spec.lower(), list(PRESETS), n=1, cutoff=0.6)
    if close:
        raise SourceError(f"Unknown SOURCE '{spec}': did you mean '{close[0]}'? Presets: {', '.join(PRESETS)}.")
    raise SourceError(f"Unknown SOURCE '{spec}': give {accepted_forms()}.")


def _broken_link(path: Path) -> str | None:
    """What is at a path that does not exist though a name is there: a symlink loop (stat says ELOOP, on the path
    or a folder above it) or a symlink to nothing; None when nothing is there at all."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a symlink loop (each link leads back to another): point it at a pipeline folder or file"
    except ValueError:  # a NUL byte: no such name
        return None
    if os.path.islink(path):
        return f"is a symlink to {shown_path(os.readlink(path))}, which does not exist"
    return None


def looks_like_path(spec: str) -> bool:
    """./x, ../x, /x, ~/x, or a name ending like a weight or config file: a path, never a preset or repo id."""
    return spec.startswith((".", "/", "~", os.sep)) or spec.endswith(
        (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", GGUF_SUFFIX)) or spec.count("/") > 2


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a SOURCE names (`dmap inspect` reads its header: dm_cli.model.formats.gguf_files), else None.

    Anything at that path but a folder counts: a FIFO or device named `x.gguf` is refused by the reader."""
    path = Path(spec).expanduser()
    return path if path.name.lower().endswith(GGUF_SUFFIX) and path.exists() and not path.is_dir() else None


def _resolve_path(spec: str, path: Path) -> Source:
    swap = pending_swap((path if path.is_dir() else path.parent).resolve())
    if swap is not None:
        raise SourceError(f"An interrupted `dmap shard --in-place` of {spec} left its weights half-swapped; the verified "
                          f"new files and the old ones are in {swap}: run the same dmap shard command again to finish.")
    if path.is_file():
        if path.name.lower().endswith(GGUF_SUFFIX):
            raise SourceError(f"'{spec}' is a GGUF file: `dmap plan` and `dmap run` take it with the rest of its "
                              "pipeline (--pipeline PRESET or FOLDER); `dmap shard` needs safetensors weights.")
        if path.name.endswith(".json") and "index" in path.name:
            return _weights_only(spec, path)
        if path.suffix == ".safetensors":
            return _weights_only(spec, path)
        if path.name == "model_index.json":
            return _pipeline(spec, path.parent)
        if path.name == "config.json":
            return _component_folder(spec, path.parent)
        raise SourceError(f"'{spec}' is a file dmap cannot read: give {accepted_forms()}.")
    if (path / "model_index.json").is_file():
        return _pipeline(spec, path)
    if (path / "config.json").is_file():
        return _component_folder(spec, path)
    weights = find_component_weights(path)
    if weights is not None:
        return _weights_only(spec, weights)
    raise SourceError(f"Folder '{spec}' has no model_index.json, config.json or safetensors weights: give {accepted_forms()}.")


def _class_from_config(config: dict, where: Path) -> tuple[str | None, str]:
    if "_class_name" in config:
        library, cls = "diffusers", config["_class_name"]
    elif isinstance(config.get("architectures"), list) and config["architectures"]:
        library, cls = "transformers", config["architectures"][0]
    else:
        raise SourceError(f"{where} names no model class ('_class_name' or 'architectures'): dmap cannot tell what it is.")
    if not is_identifier(cls):
        raise SourceError(f"{where}: the model class {cls!r} is not a class name.")
    return library, cls


def _component_folder(spec: str, folder: Path, name: str | None = None) -> Source:
    config_path = folder / "config.json"
    config = read_json(config_path, "config.json")
    library, cls = _class_from_config(config, config_path)
    comp = ComponentSource(
        name or folder.name, library, cls, config, folder, find_component_weights(folder), legacy_weight_files(folder)
    )
    return Source(spec, "component", folder, components=[comp])


def _pipeline(spec: str, root: Path) -> Source:
    index_path = root / "model_index.json"
    model_index = read_json(index_path, "model_index.json")
    source = Source(spec, "pipeline", root, pipeline_class=model_index.get("_class_name"), model_index=model_index)
    if not source.pipeline_class:
        raise SourceError(f"{index_path} has no '_class_name': it is not a diffusers pipeline index.")
    if not is_identifier(source.pipeline_class):
        raise SourceError(f"{index_path}: '_class_name' {source.pipeline_class!r} is not a class name.")
    for name, value in model_index.items():
        if name.startswith("_"):
            continue
        if not isinstance(value, list):
            continue  # pipeline flags such as requires_safety_checker
        if not is_identifier(name):
            raise SourceError(f"{index_path}: component {name!r} is not a plain folder name of the pipeline "
                              "(letters, digits and _ only): dmap refuses to read or write outside the source.")
        if len(value) != 2 or not all(v is None or isinstance(v, str) for v in value):
            raise SourceError(f"{index_path}: entry '{name}' should be [library, class], found {value!r}.")
        library, cls = value
        if cls is not None and not is_identifier(cls):
            raise SourceError(f"{index_path}: component '{name}' names class {cls!r}, which is not a class name.")
        if library is None or cls is None:
            source.other_components[name] = (library, cls)
            continue
        if any(hint in cls for hint in WEIGHTLESS_HINTS):
            source.other_components[name] = (library, cls)
            continue
        folder = root / name
        config_path = folder / "config.json"
        if not folder.exists() and name in OPTIONAL_COMPONENTS:
            source.other_components[name] = (library, cls)
            source.notes.append(f"'{name}' ({cls}) is listed in model_index.json but has no folder: left out.")
            continue
        if not config_path.is_file():
            raise SourceError(f"Component '{name}' of {spec} has no config.json ({config_path} is missing).")
        config = read_json(config_path, f"config.json of '{name}'")
        source.components.append(
            ComponentSource(name, library, cls, config, folder, find_component_weights(folder), legacy_weight_files(folder))
        )
    if not source.components:
        raise SourceError(f"{index_path} lists no component with weights.")
    return source


def _weights_only(spec: str, weights: Path) -> Source:
    folder = weights.parent
    config_path = folder / "config.json"
    if config_path.is_file():
        config = read_json(config_path, "config.json")
        library, cls = _class_from_config(config, config_path)
    else:
        config, library, cls = None, None, "?"
    name = weights.name.split(".")[0].split("-0")[0]
    comp = ComponentSource(name, library, cls, config, folder, weights)
    return Source(spec, "weights", folder, components=[comp])


def _resolve_hub(spec: str) -> Source:
    """A repo id: the local HF cache first; the Hub (configs and index files only) when not offline."""
    parts = spec.split("/")
    repo_id, component = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)
    if not all(_HUB_PART_RE.match(part) for part in parts):
        raise SourceError(f"'{spec}' is not a Hub repo id (org/name or org/name/component, no '.' or '..' parts).")
    from huggingface_hub import snapshot_download  # lazy: huggingface_hub (heavy, off start-up)
    from huggingface_hub.errors import LocalEntryNotFoundError  # lazy: huggingface_hub (heavy, off start-up)

    configs_only = ["*.json", "*/*.json", "*.txt", "*/*.txt"]
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=_cache_path()))
    except LocalEntryNotFoundError:
        if _offline():
            raise SourceError(
                f"No file or folder {spec} is here, and as a Hub repo it is not in the local Hugging Face cache "
                f"({_cache_path()}) with HF_HUB_OFFLINE=1: check the path, or download the repo first."
            ) from None
        try:
            folder = Path(snapshot_download(repo_id, allow_patterns=configs_only, cache_dir=_cache_path()))
        except Exception as error:  # network, auth, not found: one sentence of dmap's, never the Hub client's text
            raise SourceError(f"No file or folder {spec} is here (looked from {Path.cwd()}), and as a Hub repo id it "
                              f"is not in the local Hugging Face cache and {_hub_failure(error, repo_id)}: check the "
                              "path, or download the repo first.") from error
    except Exception as error:
        raise SourceError(f"Cannot read '{spec}' from the local Hugging Face cache ({_cache_path()}, "
                          f"{type(error).__name__}); give {accepted_forms()}.") from error
    if component:
        target = folder / component
        if not target.is_dir() or not is_inside(target, folder):
            raise SourceError(f"'{repo_id}' has no folder '{component}'.")
        source = _resolve_path(spec, target)
    else:
        source = _resolve_path(spec, folder)
    source.hub_snapshot = folder
    return source


def _hub_failure(error: Exception, repo_id: str) -> str:
    """Why a Hub repo could not be fetched, in dmap's words (the client's text names internals: ConnectError,
    snapshot folders, revisions)."""
    # lazy: huggingface_hub (heavy, off start-up)
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        return (f"the Hub's {repo_id} is gated: accept its terms on huggingface.co and log in (hf auth login), or "
                "use a local folder")
    if isinstance(error, RepositoryNotFoundError):
        return f"the Hub has no repo {repo_id} (or it is private: log in with hf auth login)"
    if isinstance(error, HfHubHTTPError) and getattr(error, "response", None) is not None:
        return f"the Hub answered HTTP {error.response.status_code} for {repo_id}"
    return "the Hub could not be reached (no network, or HF_ENDPOINT unreachable; HF_HUB_OFFLINE=1 skips it)"


def is_inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or below it once symlinks and '..' are resolved."""
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(folder))
        return True
    except ValueError:
        return False


def hub_cache_root() -> Path:
    """Where huggingface_hub keeps repos: dmap reads there and never writes."""
    return Path(_cache_path()).expanduser()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_path() -> str:
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub"
    )


def config_digest(source: Source) -> str:
    """What a plan is tied to: the pipeline class and every component's class and config."""
    volatile = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash", "torch_dtype", "dtype"}
    blob = {
        "pipeline": source.pipeline_class,
        "components": {c.name: [c.cls, {k: v for k, v in (c.config or {}).items() if k not in volatile}]
                       for c in source.components},
    }
    files = {c.name: [c.single_file.format, c.single_file.path.name, c.single_file.path.stat().st_size]
             for c in source.components if c.single_file is not None}
    if files:  # only then: digests of plans without single files stay what they were
        blob["single_file"] = files
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]

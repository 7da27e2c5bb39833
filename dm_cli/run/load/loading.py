"""Loading components to their planned devices, freeing them, and the pipeline object around them.

- whole-device components and GPU-only splits go through `from_pretrained(device_map=...)`;
- components with cpu/disk blocks are built empty and dispatched with accelerate hooks whose
  weights map points INTO the original safetensors files (no re-saved `.dat` copies);
- the pipeline is built once with tokenizers and scheduler loaded and every model a meta
  placeholder; the stage loop (`dm_cli.run.loops.stages`) swaps real components in and out.

The only part of dmap that loads real weights. No Typer, no Rich.
"""

from __future__ import annotations

import functools
import gc
import inspect as pyinspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from dm_cli.devices import device_of, execution_device_key, normalise_map, streams_blocks, torch_device
from dm_cli.errors import CheckpointError, SourceError
from dm_cli.io.checkpoint import open_checkpoint
from dm_cli.model.formats.nf4 import load_saved_weight, quantize_weight, to_linear4bit
from dm_cli.model.formats.prequantized import quantization_of
from dm_cli.model.formats.weight_formats import CastingWeights, LoadedTensor, apply_fp8, quantize_int8, read_cast
from dm_cli.model.models import build_model, component_class, is_transformers_model
from dm_cli.model.single_file_weights import GGUF
from dm_cli.model.skeleton import as_loaded, build_on_meta
from dm_cli.model.tokenizers import torchvision_free_processor
from dm_cli.run.load.prefetch import attach_prefetch, prefetched_weights

if TYPE_CHECKING:  # annotations only
    from dm_cli.model.sources import ComponentSource


def execution_device(device_map: dict, simulate: bool):
    """The torch.device a component computes on: its first GPU in map order, else the CPU."""
    return torch_device(execution_device_key(device_map), simulate)


def load_component(comp: ComponentSource, device_map: dict, dtype: str | None, simulate: bool, weights: str | None = None,
                   overlap: bool = False):
    """One component on its planned devices. Under simulate every virtual device is the CPU. `overlap` (the plan's
    overlapped offload): its cpu blocks are prefetched one block ahead of their turn (`dm_cli.run.load.prefetch`).

    `weights` (fp8, int8, nf4) stores the tensors `weight_formats` names in low precision: such a
    component is always loaded tensor by tensor (`_load_streamed`), each tensor cast on its way to
    its device, so the run dtype copy of the whole component never exists.
    """
    import torch  # lazy: torch (heavy, off start-up)

    torch_dtype = getattr(torch, dtype) if dtype else None
    device_map = normalise_map(device_map)
    cpu_only = simulate or set(device_map.values()) == {"cpu"}
    try:
        saved = quantization_of(comp.config)  # a folder saved quantized: loaded as it is, never re-quantized
        if comp.single_file is not None:
            model = _from_single_file(comp, {"": "cpu"} if cpu_only else device_map, torch_dtype, overlap)
        elif saved is not None and is_transformers_model(component_class(comp.library, comp.cls)):
            model = _from_pretrained(comp, {"": "cpu"} if cpu_only else device_map, torch_dtype)  # transformers' own
        elif weights is not None or saved is not None:
            model = _load_streamed(comp, device_map, torch_dtype, weights, resident=cpu_only, overlap=overlap)
        elif cpu_only:
            model = _from_pretrained(comp, {"": "cpu"}, torch_dtype)
        elif streams_blocks(device_map):
            model = _load_streamed(comp, device_map, torch_dtype, overlap=overlap)
        else:
            model = _from_pretrained(comp, device_map, torch_dtype)
            if len(set(device_map.values())) == 1:
                # lazy: accelerate (heavy, off start-up)
                from accelerate.hooks import AlignDevicesHook, add_hook_to_module

                # Inputs made on another device (embeddings, latents) follow the component.
                add_hook_to_module(model, AlignDevicesHook(execution_device=execution_device(device_map, False), io_same_device=True))
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise _unloadable(comp, error) from error
    model.eval()
    return model


def _unloadable(comp: ComponentSource, error: Exception) -> Exception:
    """A load that failed: out of GPU memory as it is (the run says what to plan instead), else the checkpoint's fault."""
    import torch  # lazy: torch (heavy, off start-up)

    if isinstance(error, torch.OutOfMemoryError):
        return error
    return CheckpointError(f"Cannot load component '{comp.name}' from {comp.folder}: {error}".rstrip(".") + ".")


def _from_pretrained(comp: ComponentSource, device_map, torch_dtype):
    cls = component_class(comp.library, comp.cls)
    if not is_transformers_model(cls):
        return cls.from_pretrained(comp.folder, torch_dtype=torch_dtype, device_map=device_map)
    return cls.from_pretrained(comp.folder, dtype=torch_dtype if torch_dtype is not None else "auto", device_map=device_map)


def _from_single_file(comp: ComponentSource, device_map: dict, torch_dtype, overlap: bool = False):
    """`from_single_file` with the pipeline's own config for the component, offline: diffusers renames the original
    layout; a GGUF file stays quantized (`GGUFQuantizationConfig`, dequantized per layer at the run dtype)."""
    import torch  # lazy: torch (heavy, off start-up)

    if "disk" in device_map.values():
        raise CheckpointError(f"Component '{comp.name}' comes from the single file {comp.single_file.path.name}, which "
                              "dmap cannot offload to disk: plan with more GPU or CPU memory.")
    kwargs = {}
    if comp.single_file.format == GGUF:
        from diffusers import GGUFQuantizationConfig  # lazy: diffusers (heavy, off start-up)

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=torch_dtype or torch.bfloat16)
    cls = component_class(comp.library, comp.cls)
    model = cls.from_single_file(str(comp.single_file.path), config=str(comp.folder.parent), subfolder=comp.name,
                                 torch_dtype=torch_dtype, local_files_only=True, **kwargs)
    if set(normalise_map(device_map).values()) == {"cpu"}:
        return model
    return dispatch_loaded(model, device_map, overlap)


def dispatch_loaded(model, device_map: dict, overlap: bool = False):
    """A component loaded whole on the cpu put where the plan says (diffusers' `from_single_file` takes a device_map
    but loads everything on one device): blocks mapped to a GPU moved there, blocks mapped to the cpu kept in RAM
    and streamed to the execution device for each forward (`_dispatch`)."""
    _hookable_parameters(model)
    device_map = normalise_map(device_map)
    kept = {name: tensor for name, tensor in model.state_dict().items() if device_of(name, device_map, "cpu") == "cpu"}
    return _dispatch(model, device_map, kept, overlap)


def _dispatch(model, device_map: dict, streamed_weights, overlap: bool = False):
    """accelerate's dispatch_model for a plan's map: blocks on a GPU moved there, blocks on cpu or disk streamed to
    the execution device for each forward from `streamed_weights` (name -> tensor), which accelerate reads as its
    offload state dict (no .dat files are written). `overlap`: the cpu blocks' read through `PrefetchedWeights`,
    each fetched while the block before it computes."""
    from accelerate import dispatch_model  # lazy: accelerate (heavy, off start-up)

    main = execution_device(device_map, False)
    dispatch_map = {key: ("disk" if device in ("cpu", "disk") else device) for key, device in device_map.items()}
    prefetched = prefetched_weights(model, device_map, streamed_weights, main) if overlap else None
    model = dispatch_model(model, dispatch_map, main_device=main.index if main.type == "cuda" else main.type,
                           state_dict=prefetched if prefetched is not None else streamed_weights, offload_index={},
                           offload_buffers=False, force_hooks=True)
    model.hf_device_map = dict(device_map)
    if prefetched is not None:
        attach_prefetch(model, prefetched)
    return model


def _hookable_parameters(model) -> None:
    """accelerate's hooks rebuild a parameter they move as `type(p)(value, requires_grad=...)`, which loses a
    GGUFParameter's quant_type (diffusers cannot dequantize it then) and fails on a plain tensor: each GGUFParameter
    swapped for a subclass that takes its quant_type from the value it is rebuilt from, each plain tensor made a
    Parameter."""
    import torch  # lazy: torch (heavy, off start-up)
    from diffusers.quantizers.gguf.utils import GGUFParameter  # lazy: diffusers (heavy, off start-up)

    hooked = _hooked_gguf_parameter()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, GGUFParameter) and not isinstance(param, hooked):
                plain = torch.Tensor._make_subclass(torch.Tensor, param.data, False)
                module._parameters[name] = hooked(plain, param.requires_grad, param.quant_type)
            elif param is not None and not isinstance(param, torch.nn.Parameter):
                # a weight diffusers' GGUF loader dequantized for a _keep_in_fp32_modules layer is a plain tensor
                module._parameters[name] = torch.nn.Parameter(param, requires_grad=False)


@functools.cache
def _hooked_gguf_parameter():
    from diffusers.quantizers.gguf.utils import GGUFParameter  # lazy: diffusers (heavy, off start-up)

    class HookedGGUFParameter(GGUFParameter):
        def __new__(cls, data, requires_grad=False, quant_type=None):
            quant_type = quant_type if quant_type is not None else getattr(data, "quant_type", None)
            return super().__new__(cls, data, requires_grad=requires_grad, quant_type=quant_type)

    return HookedGGUFParameter


def load_slice(comp: ComponentSource, device: str, dtype: str | None, skip: frozenset[str], weights: str | None = None):
    """The component on `device` without the blocks named in `skip` (device_map keys such as
    `transformer_blocks.3`), whose tensors stay on the meta device: a pipeline rank's slice
    (dm_cli.run.ranks.pipeline) reads only its own blocks' weights from the checkpoint, cast as
    `from_pretrained` casts them and stored as the plan stores them (`weights`: fp8, int8; as `load_component`)."""
    import torch  # lazy: torch (heavy, off start-up)

    def kept(name: str) -> bool:
        parts = name.split(".")
        return not any(".".join(parts[:n]) in skip for n in range(1, len(parts)))

    torch_dtype = getattr(torch, dtype) if dtype else None
    try:
        if comp.single_file is not None:  # diffusers' from_single_file reads every tensor; the other slices' go at once
            model = _from_single_file(comp, {"": "cpu"}, torch_dtype)
            for key in skip:  # an empty module in the block's place (the cut drops it)
                list_name, _, index = key.rpartition(".")
                model.get_submodule(list_name)[int(index)] = torch.nn.Module()
            model.to(device)
        else:
            model = _load_streamed(comp, {"": device}, torch_dtype, weights, resident=True, place=device, keep=kept)
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise _unloadable(comp, error) from error
    model.eval()
    return model


def _load_streamed(comp: ComponentSource, device_map: dict, torch_dtype, weights: str | None = None, resident: bool = False,
                   place: str = "cpu", keep=None, overlap: bool = False):
    """Build empty, put each tensor on its device, and stream cpu/disk blocks from the ORIGINAL safetensors.

    accelerate's own disk offload re-saves every tensor as .dat; here offloaded blocks are read from
    the checkpoint's shards (mmap) on each use. Each tensor goes stored dtype -> run dtype -> storage
    dtype (fp8 for the tensors `weight_formats` casts), as from_pretrained + enable_layerwise_casting
    would, one tensor at a time. `resident`: everything stays on `place`, the CPU unless a pipeline slice says
    otherwise (simulated or cpu-only plans). `keep(name)` False: that tensor is not read (it stays on meta).
    """
    import torch  # lazy: torch (heavy, off start-up)
    from accelerate.utils import set_module_tensor_to_device  # lazy: accelerate (heavy, off start-up)
    from safetensors import safe_open  # lazy: safetensors (heavy, off start-up)

    loaded = as_loaded(comp)  # an lm_head the checkpoint stores is its own tensor, as from_pretrained keeps it
    comp, skeleton, checkpoint = loaded.comp, loaded.skeleton, loaded.checkpoint
    model = build_model(comp.library, comp.cls, comp.config, device="empty")
    dtype_name = str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else None
    fp8 = weights if weights == "fp8" else None
    infos = {t.name: t for t in skeleton.tensors}
    aliases = {alias: group[0] for group in skeleton.tie_groups for alias in group[1:]}
    if checkpoint is None or checkpoint.problems:  # read leniently for the skeleton: raise, listing every problem
        checkpoint = open_checkpoint(comp.weights, strict=True)
    folder = Path(comp.weights).parent
    key_of = _checkpoint_keys(model, list(checkpoint.tensor_files), comp)  # model name -> checkpoint key
    where = {name: folder / checkpoint.tensor_files[key] for name, key in key_of.items()}
    int8_layers = {t.name.rpartition(".")[0] for t in skeleton.tensors if weights == "int8" and "int8" in t.low_precision}
    nf4_layers = _linear4bit(model, skeleton, weights, torch_dtype)
    saved = _saved_linear4bit(model, comp, skeleton, torch_dtype)
    modules = dict(model.named_modules())

    streamed: dict[str, LoadedTensor] = {}
    buffer_names = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + sorted(buffer_names)
    persistent = {t.name for t in skeleton.tensors if t.kind in ("param", "buffer")} | set(aliases)
    handles: dict[str, object] = {}
    for name in names:
        if name not in persistent or (keep is not None and not keep(name)):
            continue  # non-persistent buffers were built for real by init_empty_weights(include_buffers=False)
        stored = name if name in where else aliases.get(name, name)
        if stored not in where:
            stored = next((a for g in skeleton.tie_groups if name in g for a in g if a in where), stored)
        if stored not in where:
            raise CheckpointError(f"Component '{comp.name}': tensor '{name}' is missing from {comp.weights}.")
        info = infos.get(name) or infos[aliases.get(name, stored)]
        entry = LoadedTensor(name, str(where[stored]), key_of[stored], info.dtype_at(dtype_name),
                             info.dtype_at(dtype_name, fp8))
        storage_dtype = getattr(torch, entry.storage)
        dev = place if resident else device_of(name, device_map, "cpu")
        if dev in ("cpu", "disk") and not resident and name not in buffer_names:
            if name in saved:
                raise CheckpointError(f"Component '{comp.name}' was saved quantized, and its layers cannot be streamed "
                                      "from cpu or disk: plan it with more GPU memory.")
            streamed[name] = entry  # the meta tensor takes the storage dtype: accelerate casts each streamed value to it
            set_module_tensor_to_device(model, name, "meta", value=torch.empty(info.shape, dtype=storage_dtype, device="meta"),
                                        dtype=storage_dtype)
            continue
        handle = handles.get(entry.file) or handles.setdefault(entry.file, safe_open(entry.file, framework="pt", device="cpu"))
        layer, _, leaf = name.rpartition(".")
        if name in saved:  # packed as saved, with its statistics
            stats = {}
            for key in saved[name]:  # a statistic may sit in another shard than its weight
                path = str(folder / checkpoint.tensor_files[key])
                stats[key] = (handles.get(path) or handles.setdefault(path, safe_open(path, framework="pt", device="cpu"))
                              ).get_tensor(key)
            load_saved_weight(modules[layer], handle.get_tensor(key_of[stored]), stats, "cpu" if dev in ("cpu", "disk") else dev)
            continue
        if leaf == "weight" and layer in nf4_layers:  # quantized on its device, from its run dtype copy
            quantize_weight(modules[layer], read_cast(handle, entry), "cpu" if dev in ("cpu", "disk") else dev)
            continue
        set_module_tensor_to_device(model, name, "cpu" if dev in ("cpu", "disk") else dev, value=read_cast(handle, entry),
                                    dtype=storage_dtype)
        if leaf == "weight" and layer in int8_layers:
            quantize_int8(modules[layer])  # this layer's weight only: its run dtype copy lives one tensor long
    handles.clear()
    if fp8:
        apply_fp8(model, torch_dtype)
    if resident:
        return model
    return _dispatch(model, device_map, CastingWeights(streamed), overlap)


def _linear4bit(model, skeleton, weights: str | None, torch_dtype) -> set[str]:
    """With nf4 weights: the layers bitsandbytes' 4-bit loading converts (`weight_formats`' nf4 tags) swapped for
    empty Linear4bit layers computing in the run dtype; their names (none without nf4)."""
    import torch  # lazy: torch (heavy, off start-up)

    if weights != "nf4":
        return set()
    layers = {t.name.rpartition(".")[0] for t in skeleton.tensors if "nf4" in t.low_precision}
    compute = torch_dtype if torch_dtype is not None else getattr(torch, skeleton.compute_dtype())
    to_linear4bit(model, layers, compute)
    return layers


def _saved_linear4bit(model, comp: ComponentSource, skeleton, torch_dtype) -> dict[str, list[str]]:
    """A diffusers folder saved in bitsandbytes 4-bit: its quantized layers swapped for empty Linear4bit layers;
    weight name -> the checkpoint keys of its statistics (none for other folders). 8-bit ones are refused."""
    import torch  # lazy: torch (heavy, off start-up)

    fmt = quantization_of(comp.config)
    if fmt is None:
        return {}
    if fmt not in ("bnb-nf4", "bnb-fp4"):
        raise CheckpointError(f"Component '{comp.name}' was saved in bitsandbytes {fmt}, which dmap plans but runs only "
                              "for transformers models: give its unquantized folder with --weights nf4 or int8.")
    quantized = {t.name for t in skeleton.tensors if t.quantized_bytes}
    config = comp.config["quantization_config"]
    compute = torch_dtype if torch_dtype is not None else getattr(torch, str(config.get("bnb_4bit_compute_dtype") or "float32"))
    to_linear4bit(model, {n.rpartition(".")[0] for n in quantized}, compute, fmt.removeprefix("bnb-"),
                  bool(config.get("bnb_4bit_use_double_quant")))
    checkpoint = open_checkpoint(comp.weights, strict=True)
    return {name: [k for k in checkpoint.tensor_files if k.startswith(f"{name}.")] for name in quantized}


def _checkpoint_keys(model, keys: list[str], comp: ComponentSource) -> dict[str, str]:
    """Model tensor name -> checkpoint key. transformers 5 renames legacy checkpoint keys while loading
    (Mistral-3 saves `language_model.model.*` for `model.language_model.*`): the same renamings, by
    transformers' own `rename_source_key`. A key that needs a converter (merged or split tensors) is refused."""
    if not is_transformers_model(type(model)):
        return {key: key for key in keys}
    # lazy: transformers (heavy, off start-up)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    present = dict.fromkeys(model.state_dict(), True)  # names only: the model is empty
    out = {}
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, present)
        if converter is not None:
            raise CheckpointError(f"Component '{comp.name}': checkpoint tensor '{key}' needs transformers' conversion "
                                  f"({converter}), which dmap cannot stream; plan it onto GPUs whole, without --weights.")
        out[name] = key
    return out


def free_components(models: list) -> None:
    """Hooks off, references dropped, allocator caches emptied: the memory goes back to the device.

    One gc.collect() for all of them. The list is emptied. Every parameter and buffer is swapped for
    an empty meta tensor first, so a reference the caller cannot drop (WanPipeline's loop keeps the
    high-noise expert in a local variable until the next step) does not keep the weights alive.
    """
    import torch  # lazy: torch (heavy, off start-up)
    from accelerate.hooks import remove_hook_from_module  # lazy: accelerate (heavy, off start-up)

    while models:
        model = models.pop()
        prefetch = model.__dict__.pop("_dmap_prefetch", None)
        if prefetch is not None:  # its pinned host copies go now, whatever still holds the model
            prefetch.close()
        try:
            remove_hook_from_module(model, recurse=True)
        except Exception:  # noqa: BLE001 - a model without hooks
            pass
        for module in model.modules():  # diffusers' hook registries keep the model reachable otherwise
            module.__dict__.pop("_diffusers_hook", None)
            for tensors in (module._parameters, module._buffers):
                for key, tensor in tensors.items():
                    if tensor is not None and tensor.device.type != "meta":
                        # shape and dtype, not empty_like: tensor subclasses (torchao's int8) do not implement it
                        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                        tensors[key] = torch.nn.Parameter(empty, requires_grad=False) if isinstance(
                            tensor, torch.nn.Parameter) else empty
        del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- the pipeline object ---------------------------------------------------------------------


def placeholder(comp: ComponentSource, torch_dtype, real_tensors: tuple[str, ...] = ()):
    """The component on the meta device: its config and dtype for the pipeline, no memory.

    `real_tensors` (the family's `placeholder_tensors`): small tensors the pipeline reads while the
    component is not loaded (FLUX.2 [klein] un-normalises latents with the VAE's batch-norm
    statistics at the end of denoising); they are read from the checkpoint, the rest stays on meta.

    Text encoders get None instead: the pipelines only read them while encoding (when the real one
    is loaded) and, given prompt embeddings, fall back to the denoiser's dtype exactly as the
    diffusers staged recipe (which passes text_encoder=None) does. Building a T5 on meta costs a
    quarter of a second even for the demo, for nothing.
    """
    if comp.name.startswith("text_encoder"):
        return None

    model = build_on_meta(comp.library, comp.cls, comp.config)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    if real_tensors and comp.weights is not None:
        _read_tensors(model, comp, real_tensors)
    return model


def _read_tensors(model, comp, names: tuple[str, ...]) -> None:
    """Named tensors of a meta model replaced by their values in the checkpoint (cast as loading casts)."""
    from accelerate.utils import set_module_tensor_to_device  # lazy: accelerate (heavy, off start-up)
    from safetensors import safe_open  # lazy: safetensors (heavy, off start-up)

    checkpoint = open_checkpoint(comp.weights, strict=True)
    folder = Path(comp.weights).parent
    current = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in names:
        shard = checkpoint.tensor_files.get(name)
        if shard is None or name not in current:
            raise CheckpointError(f"Component '{comp.name}': tensor '{name}' is missing from {comp.weights}.")
        with safe_open(str(folder / shard), framework="pt", device="cpu") as handle:
            value = handle.get_tensor(name)
        dtype = current[name].dtype if value.is_floating_point() else value.dtype
        set_module_tensor_to_device(model, name, "cpu", value=value.to(dtype))


def build_pipeline(source, torch_dtype, placeholders: dict):
    """The pipeline object with tokenizers and scheduler loaded and every model a meta placeholder."""
    import diffusers  # lazy: diffusers (heavy, off start-up)

    cls = getattr(diffusers, source.pipeline_class)
    params = pyinspect.signature(cls.__init__).parameters
    kwargs = {}
    for name, param in params.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        if name in placeholders:
            kwargs[name] = placeholders[name]
        elif name in source.other_components:
            library, class_name = source.other_components[name]
            kwargs[name] = _load_weightless(source, name, library, class_name)
        elif name == "requires_safety_checker":
            kwargs[name] = bool(source.model_index.get("requires_safety_checker", False))
        elif name in source.model_index and not isinstance(source.model_index[name], list):
            kwargs[name] = source.model_index[name]  # a pipeline setting: FLUX.2 [klein]'s is_distilled, Wan 2.2's boundary_ratio
        elif param.default is pyinspect.Parameter.empty:
            kwargs[name] = None
    staged = type(cls.__name__, (cls,), {"_execution_device": property(lambda self: self._dmap_device)})
    with warnings.catch_warnings():
        # diffusers' config advice (a 21-line steps_offset FutureWarning for older SD schedulers) is not
        # the user's to act on in the middle of a run; the pipeline behaves exactly as diffusers' own
        warnings.simplefilter("ignore", FutureWarning)
        pipe = staged(**kwargs)
    pipe._dmap_device = "cpu"
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _load_weightless(source, name, library, class_name):
    if library is None or class_name is None:
        return None
    folder = source.root / name
    if "Scheduler" in class_name:
        import diffusers  # lazy: diffusers (heavy, off start-up)

        scheduler_cls = getattr(diffusers, class_name, None)
        if scheduler_cls is None:
            raise SourceError(f"Scheduler {class_name} is not in this diffusers.")
        if not (folder / "scheduler_config.json").is_file():
            raise SourceError(f"The scheduler config of {source.spec} is missing: {folder / 'scheduler_config.json'}.")
        return scheduler_cls.from_pretrained(source.root, subfolder=name)
    if "Tokenizer" in class_name or class_name.endswith("Processor"):
        import transformers  # lazy: transformers (heavy, off start-up)

        if not folder.is_dir() or not any(folder.iterdir()):
            raise SourceError(
                f"Tokenizer '{name}' of {source.spec} is missing ({folder}): copy the tokenizer folders with the weights."
            )
        try:
            try:
                return getattr(transformers, class_name).from_pretrained(folder)
            except ImportError:
                if not class_name.endswith("Processor"):
                    raise
                # a processor whose image half needs a missing backend (torchvision): dmap's PIL one where it has
                # one (Qwen2VLProcessor); else (PixtralProcessor) text-to-image only tokenizes, and its tokenizer loads
                processor = torchvision_free_processor(class_name, folder)
                return processor if processor is not None else transformers.AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError, ImportError) as error:
            raise SourceError(f"Tokenizer '{name}' of {source.spec} cannot be loaded from {folder}: {error}") from error
    return None  # feature extractors, image encoders: not used for text-to-image

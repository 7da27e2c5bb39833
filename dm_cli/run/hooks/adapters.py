"""LoRA adapters at run time: loaded into their component each time it loads, through diffusers' own
`load_lora_weights` (key conversions, peft injection) and `set_adapters` (the scales).

peft puts each adapter on the device and in the dtype of the layer it patches. Where that layer's weight is on
the meta device (a block streamed from cpu or disk: accelerate's offload hooks keep it there between forwards) or
in fp8 (`--weights fp8`), it stands in as a one-element view during the injection (`_stand_ins`): in its dtype for
a streamed one, in the compute dtype for fp8 (an fp8 adapter would lose its precision, and CPUs have no fp8
matmul), as diffusers gets by loading a LoRA before `enable_layerwise_casting`. The adapters of streamed layers
are then streamed with them (`_stream_adapters`). int8 layers (torchao) take peft's own torchao LoRA layer; GGUF
layers take the adapter in float32 beside the quantized weight, which diffusers dequantizes per call. Where the
plan says so, the adapters are then fused into the weights. A LoRA the plan was not made for never gets here
(`check_plan_matches`, and an inline plan places every component); a file holding NaN or Inf is refused before
peft sees it (`dm_cli.model.lora.nonfinite_tensor`). No Typer, no Rich.
"""

from __future__ import annotations

import contextlib
import warnings

from dm_cli.errors import UsageError
from dm_cli.model.lora import file_digest, nonfinite_tensor, shown

ADAPTER_PREFIX = "dmap_lora_"


def load_loras(pipe, name: str, model, loras: tuple, compute_dtype=None, fuse: bool = False) -> None:
    """The LoRAs patching component `name` (just loaded as `model`, running in `compute_dtype`; None: the model's
    dtype) loaded by the pipeline's own `load_lora_weights` (Wan 2.2's second expert: `load_into_transformer_2=True`)
    and weighted by `set_adapters`. Each file must still have the sha256 it had when dmap read it (the metadata
    names that digest).

    `fuse` (the plan's choice, dm_cli.planning.placement.lora_sizing.lora_unfused_because): merged into the weights at those scales
    (diffusers' `fuse_lora`), then their peft layers removed (`unload_lora`), so the component runs as a plain one
    with no per-call cost (a rank-32 LoRA on every linear layer of a mid-size FLUX: +15% per step unfused, +2%
    fused)."""
    if compute_dtype is None:
        compute_dtype = model.dtype  # diffusers' ModelMixin reports the compute dtype under layerwise casting
    setattr(pipe, name, model)  # load_lora_weights patches the pipeline's own attribute
    kwargs = {"load_into_transformer_2": True} if name == "transformer_2" else {}
    adapters = []
    for index, lora in enumerate(loras):
        adapter = f"{ADAPTER_PREFIX}{index}"
        bad = nonfinite_tensor(lora.path, lora.digest)
        if bad is not None:
            raise UsageError(f"--lora {shown(lora.name)}: its tensor '{shown(bad)}' holds NaN or infinite values, "
                             "which would turn every image black; use another export of this LoRA.")
        # diffusers removes accelerate's hooks from a pipeline without an hf_device_map (and re-adds them as its own
        # sequential offload, which needs a GPU): dmap's hooks are the plan's, they stay
        device_map, pipe.hf_device_map = pipe.hf_device_map, {name: "dmap"}
        try:
            with warnings.catch_warnings(), _stand_ins(model, compute_dtype):
                warnings.simplefilter("ignore")  # peft's notes (config/state-dict differences, torchao merging)
                pipe.load_lora_weights(lora.path, adapter_name=adapter, use_safetensors=True, local_files_only=True,
                                       **kwargs)
        except (ValueError, KeyError, RuntimeError, OSError) as error:
            raise UsageError(f"--lora {shown(lora.name)} cannot be loaded into {name}: "
                             f"{str(error).splitlines()[0].rstrip('.')}.") from None
        finally:
            pipe.hf_device_map = device_map
        _stream_adapters(model, lora.name)
        if adapter not in (getattr(model, "peft_config", None) or {}):  # the pipeline put it elsewhere, or nowhere
            raise UsageError(f"--lora {shown(lora.name)}: {type(pipe).__name__}.load_lora_weights did not load it "
                             f"into {name}.")
        if file_digest(lora.path) != lora.digest:
            raise UsageError(f"--lora {shown(lora.path)} changed after dmap read it (its sha256 differs): run again.")
        adapters.append(adapter)
    model.set_adapters(adapters, [lora.scale for lora in loras])
    if fuse:
        model.fuse_lora(adapter_names=adapters)
        model.unload_lora()


# --- adapters of layers streamed from cpu or disk ------------------------------------------------------


def _streamed_layers(model) -> list:
    """(module, hook) for each module whose own tensors accelerate streams to its execution device on every
    forward (dispatch_model hooks each layer of an offloaded block)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook  # lazy: accelerate (heavy, off start-up)

    out = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for each in hook.hooks if isinstance(hook, SequentialHook) else [hook]:
            if isinstance(each, AlignDevicesHook) and each.offload:
                out.append((module, each))
    return out


@contextlib.contextmanager
def _stand_ins(model, compute_dtype):
    """Around peft's injection: each meta weight (streamed from cpu or disk) and each fp8 weight (stored low)
    a one-element view of its shape, in its own dtype (a GGUF weight keeps its type) or, for fp8, the compute
    dtype: peft puts each adapter on its layer's device and in its dtype, and a meta adapter would lose its
    values, an fp8 one its precision (and CPUs have no fp8 matmul). The weights themselves come back after it."""
    import torch  # lazy: torch (heavy, off start-up)

    low = {torch.float8_e4m3fn, torch.float8_e5m2}
    replaced = []
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or (param.device.type != "meta" and param.dtype not in low):
                continue
            view = torch.zeros((), dtype=compute_dtype if param.dtype in low else param.dtype,
                               device="cpu" if param.device.type == "meta" else param.device).expand(param.shape)
            quant_type = getattr(param, "quant_type", None)
            module._parameters[leaf] = (type(param)(view, quant_type=quant_type) if quant_type is not None
                                        else torch.nn.Parameter(view, requires_grad=False))
            replaced.append((module, leaf, param))
    try:
        yield
    finally:
        for module, leaf, param in replaced:
            module._parameters[leaf] = param


def _stream_adapters(model, lora_name: str) -> None:
    """Each new adapter module of a layer accelerate streams to its execution device (dispatch_model hooks each
    layer of an offloaded block) streamed like that layer: its tensors kept on the cpu, moved to the layer's
    execution device for each forward."""
    import torch  # lazy: torch (heavy, off start-up)
    from accelerate.hooks import add_hook_to_module  # lazy: accelerate (heavy, off start-up)
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (heavy, off start-up)

    layers = _streamed_layers(model)
    if any(hook.place_submodules and any(isinstance(m, BaseTunerLayer) for m in module.modules())
           for module, hook in layers):  # accelerate streams that module whole, from a map without the adapters
        raise UsageError(f"--lora {shown(lora_name)} patches a layer that accelerate streams as part of a larger "
                         "module, which dmap cannot stream an adapter with: plan that block on a GPU.")
    hooks = {id(module): hook for module, hook in layers}
    for layer in model.modules():
        hook = hooks.get(id(layer.get_base_layer())) if isinstance(layer, BaseTunerLayer) else None
        if hook is None:
            continue
        for attr in layer.adapter_layer_names:
            for adapter in (getattr(layer, attr, None) or {}).values():
                if not isinstance(adapter, torch.nn.Module):
                    raise UsageError(f"--lora {shown(lora_name)} patches an embedding of a streamed block, which dmap "
                                     "cannot stream an adapter with: plan that block on a GPU.")
                if not hasattr(adapter, "_hf_hook"):  # as quiet as its layer's (run/load/prefetch.py: no flush each set)
                    add_hook_to_module(adapter, type(hook)(execution_device=hook.execution_device, offload=True,
                                                           offload_buffers=True, place_submodules=True))

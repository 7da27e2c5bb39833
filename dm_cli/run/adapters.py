"""LoRA adapters at run time: loaded into their component each time it loads, through diffusers' own
`load_lora_weights` (key conversions, peft injection) and `set_adapters` (the scales), unfused.

Blocks streamed from cpu or disk to their GPU (accelerate's offload hooks keep them on the meta device between
forwards) take their adapters too: peft patches them while their weights stand in as one-element placeholders,
and each adapter then lives on the cpu like the layer it patches, moved to the GPU with it for each forward
(`_streamed_adapters`). What peft cannot patch is refused before anything loads (`lora_refusal`):
layers stored in fp8 or int8 (peft casts the adapter to the layer's dtype). A GGUF-quantized layer takes
its adapter as diffusers allows it: in float32 beside the quantized weight, which diffusers dequantizes per call.
No Typer, no Rich.
"""

from __future__ import annotations

import contextlib

from dm_cli.errors import UsageError

ADAPTER_PREFIX = "dmap_lora_"


def lora_refusal(plan, loras: tuple) -> str | None:
    """One sentence when a LoRA cannot patch its component as the plan places and stores it, else None."""
    for lora in loras:
        name = lora.component
        if name not in plan.components:
            return f"--lora {lora.name} patches '{name}', which the plan does not place: plan again with this --lora."
        fmt = plan.weights.get(name)
        if fmt:
            return (f"--lora {lora.name}: peft cannot patch layers stored as {fmt} (it would cast the LoRA to {fmt} "
                    f"too): plan '{name}' without --weights.")
    return None


def load_loras(pipe, name: str, model, loras: tuple) -> None:
    """The LoRAs patching component `name` (just loaded as `model`) loaded by the pipeline's own
    `load_lora_weights` (Wan 2.2's second expert: `load_into_transformer_2=True`) and weighted by `set_adapters`.
    Each file must still have the sha256 it had when dmap read it (the metadata names that digest)."""
    import warnings

    from dm_cli.model.lora import file_digest, shown

    setattr(pipe, name, model)  # load_lora_weights patches the pipeline's own attribute
    kwargs = {"load_into_transformer_2": True} if name == "transformer_2" else {}
    adapters = []
    for index, lora in enumerate(loras):
        adapter = f"{ADAPTER_PREFIX}{index}"
        # diffusers removes accelerate's hooks from a pipeline without an hf_device_map (and re-adds them as its own
        # sequential offload, which needs a GPU): dmap's hooks are the plan's, they stay
        device_map, pipe.hf_device_map = pipe.hf_device_map, {name: "dmap"}
        try:
            with warnings.catch_warnings(), _streamed_adapters(model, lora.name):  # peft's note on config/state-dict differences
                warnings.simplefilter("ignore", RuntimeWarning)     # is not the user's to act on
                pipe.load_lora_weights(lora.path, adapter_name=adapter, use_safetensors=True, local_files_only=True,
                                       **kwargs)
        except (ValueError, KeyError, RuntimeError, OSError) as error:
            raise UsageError(f"--lora {shown(lora.name)} cannot be loaded into {name}: "
                             f"{str(error).splitlines()[0].rstrip('.')}.") from None
        finally:
            pipe.hf_device_map = device_map
        if adapter not in (getattr(model, "peft_config", None) or {}):  # the pipeline put it elsewhere, or nowhere
            raise UsageError(f"--lora {shown(lora.name)}: {type(pipe).__name__}.load_lora_weights did not load it "
                             f"into {name}.")
        if file_digest(lora.path) != lora.digest:
            raise UsageError(f"--lora {shown(lora.path)} changed after dmap read it (its sha256 differs): run again.")
        adapters.append(adapter)
    model.set_adapters(adapters, [lora.scale for lora in loras])


# --- adapters of layers streamed from cpu or disk ------------------------------------------------------


def _streamed_layers(model) -> list:
    """(module, hook) for each module whose own tensors accelerate streams to its execution device on every
    forward (dispatch_model hooks each layer of an offloaded block)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    out = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for each in hook.hooks if isinstance(hook, SequentialHook) else [hook]:
            if isinstance(each, AlignDevicesHook) and each.offload:
                out.append((module, each))
    return out


@contextlib.contextmanager
def _streamed_adapters(model, lora_name: str):
    """Around peft's injection: each streamed meta tensor a one-element cpu view of its shape and dtype (peft puts an
    adapter on its layer's device and dtype, and meta adapters would lose their values); after it, the layers back
    on meta and each new adapter module streamed like the layer it patches: its tensors kept on the cpu, moved to
    the layer's execution device for each forward."""
    import torch
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device
    from peft.tuners.tuners_utils import BaseTunerLayer

    from dm_cli.model.lora import shown

    layers = _streamed_layers(model)
    for module, hook in layers:
        for tensor_name, tensor in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                        recurse=hook.place_submodules):
            if tensor.device.type == "meta":
                stand_in = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
                if getattr(tensor, "quant_type", None) is not None:  # a GGUF weight keeps its type
                    stand_in = type(tensor)(stand_in, quant_type=tensor.quant_type)
                set_module_tensor_to_device(module, tensor_name, "cpu", value=stand_in)
    try:
        yield
    finally:
        for module, hook in layers:
            for tensor_name, _ in list(named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                            recurse=hook.place_submodules)):
                set_module_tensor_to_device(module, tensor_name, "meta")
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
                if not hasattr(adapter, "_hf_hook"):
                    add_hook_to_module(adapter, AlignDevicesHook(execution_device=hook.execution_device, offload=True,
                                                                 offload_buffers=True, place_submodules=True))

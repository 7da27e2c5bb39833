"""LoRA adapters in a plan: which component each patches, the bytes they add beside the layers they patch and
while those run, and whether they can be fused into the weights at load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dm_cli.devices import streams_blocks
from dm_cli.errors import UsageError
from dm_cli.families import family_parts
from dm_cli.model.lora import layer_problems, settle_targets
from dm_cli.units import DTYPE_BYTES

if TYPE_CHECKING:  # annotations only
    from dm_cli.model.sources import ComponentSource


def lora_extra_bytes(comp: ComponentSource, skeleton, loras: tuple, dtype: str) -> tuple[dict[str, int], tuple]:
    """What the LoRAs patching a component add, unfused: lora_A and lora_B live beside the layer they patch, in its
    dtype (peft casts them to it), so their bytes go with that layer's weight (tensor name -> bytes) and the planner
    puts them in the block that holds it. A LoRA in a layout diffusers converts while loading (kohya's) is spread
    over the component's weights. Beside fp8 or int8 weights the adapters stay in the compute dtype (dm_cli.run.
    adapters). Refused, one sentence: layers that are not in the component (a LoRA for another model)."""
    if not loras:
        return {}, ()
    infos = {t.name: t for t in skeleton.tensors}
    shapes = {t.name: t.shape for t in skeleton.tensors}
    weights = [t for t in skeleton.tensors if t.kind == "param" and t.name.endswith(".weight") and len(t.shape) >= 2]
    extra: dict[str, int] = {}
    report = []
    for lora in loras:
        problem = layer_problems(lora, shapes)
        if problem:
            raise UsageError(problem)
        if lora.layers:
            added = {f"{layer.module}.weight": layer.numel * _adapter_itemsize(infos[f"{layer.module}.weight"], dtype)
                     for layer in lora.layers}
        else:  # a foreign layout: diffusers renames its keys only while loading
            total = lora.numel * DTYPE_BYTES[dtype]
            numels = sum(t.numel for t in weights) or 1
            added = {t.name: total * t.numel // numels for t in weights}
        for name, count in added.items():
            extra[name] = extra.get(name, 0) + count
        report.append((lora, sum(added.values())))
    return extra, tuple(report)


def lora_transients(loras: tuple, outputs: dict[str, int], skeleton, compute_dtype: str) -> dict[str, int]:
    """Layer -> bytes its unfused LoRAs add while it runs: peft computes `lora_B(lora_A(x)) * scale` beside the
    layer's output and adds it in, two more tensors of the output's size (in the adapter's dtype; one adapter
    at a time). A LoRA in a layout diffusers converts while loading names no layers here: it adds nothing."""
    infos = {t.name: t for t in skeleton.tensors}
    out: dict[str, int] = {}
    for lora in loras:
        for layer in lora.layers:
            weight = infos.get(f"{layer.module}.weight")
            ratio = _adapter_itemsize(weight, compute_dtype) / DTYPE_BYTES[compute_dtype] if weight else 1
            added = int(2 * outputs.get(layer.module, 0) * max(1.0, ratio))
            out[layer.module] = max(out.get(layer.module, 0), added)
    return {layer: nbytes for layer, nbytes in out.items() if nbytes}


def with_lora_peaks(module_peaks: dict[str, int], lora_layers: dict[str, int]) -> dict[str, int]:
    """The trace's peaks with each patched layer's LoRA transients on top of what was live while it ran, and the
    modules around it at least as high: the LoRA raises a block's peak only where it exceeds the block's own."""
    peaks = dict(module_peaks)
    for layer, added in lora_layers.items():
        raised = module_peaks.get(layer, 0) + added
        prefix = layer
        while True:
            peaks[prefix] = max(peaks.get(prefix, 0), raised)
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
    return peaks


def _adapter_itemsize(weight, dtype: str) -> int:
    """Bytes per element of the adapter peft puts beside `weight`: its dtype at the run dtype; float32 beside a
    GGUF-quantized weight (peft builds adapters in float32 and casts them only to a floating layer dtype)."""
    return DTYPE_BYTES["float32"] if weight.quantized_bytes else DTYPE_BYTES[weight.dtype_at(dtype)]


def lora_unfused_because(prepared, device_map: dict, switched: bool = False) -> str | None:
    """Why the LoRAs of a component cannot be fused into its weights at load (diffusers' `fuse_lora`, then
    `unload_lora`: no peft layer left, no per-call cost), or None when they can: fusing needs every weight real and
    in a floating dtype, and `switched` adapters (chosen per image: peft's set_adapters) stay peft layers."""
    if switched:
        return "requests or queue items choose among the adapters per image, which only unfused adapters allow"
    if prepared.weights:
        return f"its layers are stored as {prepared.weights}, which peft cannot merge into"
    if prepared.skeleton.quantized:
        return "its layers are GGUF-quantized, which peft cannot merge into"
    if streams_blocks(device_map):
        return "its blocks stream from cpu or disk (their weights are on the meta device between calls)"
    return None


def lora_targets(source, loras: tuple) -> tuple:
    """The LoRAs with the component each patches (`dm_cli.model.lora.settle_targets`), as `dmap run` settles them."""
    if not loras:
        return ()
    family, denoiser, _ = family_parts(source.pipeline_class, source.components)
    return settle_targets(tuple(loras), [c.name for c in source.components],
                          denoiser.name if denoiser is not None else None, family.experts if family is not None else (),
                          source.pipeline_class)

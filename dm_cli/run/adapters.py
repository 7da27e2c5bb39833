"""LoRA adapters at run time: loaded into their component each time it loads, through diffusers' own
`load_lora_weights` (key conversions, peft injection) and `set_adapters` (the scales), unfused.

What peft cannot patch is refused before anything loads (`lora_refusal`): layers streamed block by block from
cpu or disk to a GPU (accelerate's offload hooks hold them on the meta device), GGUF-quantized layers and layers
stored in fp8 or int8 (peft casts the adapter to the layer's dtype). No Typer, no Rich.
"""

from __future__ import annotations

from dm_cli.devices import normalise_map
from dm_cli.errors import UsageError

ADAPTER_PREFIX = "dmap_lora_"


def lora_refusal(plan, source, loras: tuple, simulate: bool) -> str | None:
    """One sentence when a LoRA cannot patch its component as the plan places and stores it, else None."""
    comps = {c.name: c for c in source.components}
    for lora in loras:
        name = lora.component
        if name not in plan.components:
            return f"--lora {lora.name} patches '{name}', which the plan does not place: plan again with this --lora."
        comp = comps.get(name)
        single = getattr(comp, "single_file", None)
        if single is not None and getattr(single, "format", None) == "gguf":
            return (f"--lora {lora.name}: '{name}' comes from the GGUF file {single.path.name}, whose quantized layers "
                    "dmap cannot patch with a LoRA; use the pipeline's own safetensors weights for it.")
        fmt = plan.weights.get(name)
        if fmt:
            return (f"--lora {lora.name}: peft cannot patch layers stored as {fmt} (it would cast the LoRA to {fmt} "
                    f"too): plan '{name}' without --weights.")
        if simulate:
            continue  # every virtual device is the CPU, where the component is loaded whole
        where = set(normalise_map(plan.components[name].device_map).values())
        on_accelerator = any(not isinstance(d, str) or d == "mps" for d in where)
        if "disk" in where or (on_accelerator and where & {"cpu"}):
            return (f"--lora {lora.name} patches '{name}', which the plan streams from cpu or disk to its GPU block by "
                    "block: dmap cannot add LoRA layers to streamed blocks; give the GPUs room for it (--max-memory), "
                    "plan it all on the cpu, or run with --simulate.")
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
        try:
            with warnings.catch_warnings():  # peft's note on config/state-dict differences is not the user's to act on
                warnings.simplefilter("ignore", RuntimeWarning)
                pipe.load_lora_weights(lora.path, adapter_name=adapter, use_safetensors=True, local_files_only=True,
                                       **kwargs)
        except (ValueError, KeyError, RuntimeError, OSError) as error:
            raise UsageError(f"--lora {shown(lora.name)} cannot be loaded into {name}: "
                             f"{str(error).splitlines()[0].rstrip('.')}.") from None
        if adapter not in (getattr(model, "peft_config", None) or {}):  # the pipeline put it elsewhere, or nowhere
            raise UsageError(f"--lora {shown(lora.name)}: {type(pipe).__name__}.load_lora_weights did not load it "
                             f"into {name}.")
        if file_digest(lora.path) != lora.digest:
            raise UsageError(f"--lora {shown(lora.path)} changed after dmap read it (its sha256 differs): run again.")
        adapters.append(adapter)
    model.set_adapters(adapters, [lora.scale for lora in loras])

"""A component as the planner sees it: its skeleton sized (fp8/int8 storage, its LoRAs' bytes) and its meta
trace, cut into blocks in execution order with their activations (the search's ComponentInput)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from dm_cli.errors import CheckpointError, DoesNotFitError, UsageError
from dm_cli.inputs import InputSpec
from dm_cli.model.formats.weight_formats import component_format, layer_compute_bytes, transient_by_key
from dm_cli.model.skeleton import as_loaded
from dm_cli.planning.placement.blocks import ComponentInput, component_blocks, coverage_problems
from dm_cli.planning.placement.lora_sizing import lora_extra_bytes, lora_transients, with_lora_peaks
from dm_cli.planning.trace import trace
from dm_cli.units import format_size

if TYPE_CHECKING:  # annotations only
    from dm_cli.model.sources import ComponentSource


def _splittable(comp: ComponentSource) -> bool:
    """The VAE is never split (AutoencoderKL does not split cleanly across GPUs)."""
    return not (comp.name == "vae" or comp.cls.startswith("Autoencoder"))


@dataclass
class TraceFacts:
    """What the planner needs from a trace (the tracer caches the traces themselves)."""

    execution_order: list[str] | None
    module_peaks: dict[str, int]
    activation_peak: int
    unsplittable: list[str]
    same_device_groups: dict[str, list[list[str]]]
    warning: str | None
    module_outputs: dict[str, int] = field(default_factory=dict)  # module -> bytes of its largest output
    work: dict[str, int] = field(default_factory=dict)  # one call's FLOPs, memory-bound bytes and ops (trace.py)
    peak_at: dict = field(default_factory=dict)  # on a GPU: the module, op and kernel bytes at the peak
    attention_backends: dict[str, int] = field(default_factory=dict)  # on a GPU: the attention kernel -> calls


def trace_facts(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str, use_cache: bool = True,
                tiled: bool = False, on_progress: Callable[[str], None] | None = None,
                on_gpu: bool = False) -> TraceFacts:
    """The meta trace of one component: execution order, activation peaks, what must not be split
    (`tiled`: of its decode with diffusers' enable_tiling()). `on_gpu`: the peaks a GPU's kernels reach (the
    allocator's blocks, attention's and cuDNN's buffers: gpu_kernels.py), else the CPU's (the storages alone)."""
    result = trace.trace_component(comp, pipeline_class, inputs, dtype, use_cache=use_cache, tiled=tiled,
                             on_progress=on_progress)
    gpu = on_gpu and bool(result.gpu_module_peaks)
    return TraceFacts(list(result.execution_order) or None,
                      dict(result.gpu_module_peaks if gpu else result.module_peaks),
                      int(result.gpu_activation_peak if gpu else result.activation_peak),
                      list(result.unsplittable), dict(getattr(result, "same_device_groups", {}) or {}),
                      result.fallback_warning, dict(result.module_outputs), dict(getattr(result, "work", {}) or {}),
                      dict(result.gpu_peak_at) if gpu else {}, dict(result.attention_backends) if gpu else {})


@dataclass
class PreparedComponent:
    source: object  # ComponentSource
    skeleton: object  # Skeleton
    dtype: str
    facts: TraceFacts
    spec: ComponentInput
    warnings: list[str]
    weights: str | None = None  # fp8 / int8 storage (weight_formats.py); None: the run dtype
    effective_dtype: str | None = None  # the dtype its tensors are sized at (None: as stored)
    lora_bytes: tuple = ()  # (LoraAdapter, bytes it adds at the run dtype) for each LoRA patching it


def prepare_component(comp: ComponentSource, pipeline_class: str | None, inputs: InputSpec, dtype: str | None,
                      use_cache: bool = True, weights: dict[str, str | None] | None = None,
                      on_progress: Callable[[str], None] | None = None, loras: tuple = (),
                      on_gpu: bool = False) -> PreparedComponent:
    """Skeleton + trace -> the planner's ComponentInput (blocks in execution order with activations).

    `weights` (from `parse_weights_spec`) stores some tensors in fp8 or int8: they are counted at
    those sizes, by the rule the runner applies, and the compute copy of the largest such layer
    (upcast while it runs) is added to the activations of every block that holds it. `on_gpu`: activations as a
    GPU's kernels hold them (trace_facts).
    """
    if on_progress is not None:
        on_progress(f"Sizing {comp.name} ({comp.cls}): counting its tensors")
    loaded = as_loaded(comp, use_cache=use_cache)  # what from_pretrained keeps (untied lm_head)
    comp, skeleton, checkpoint, tie_note = loaded.comp, loaded.skeleton, loaded.checkpoint, loaded.note
    if checkpoint is not None and checkpoint.problems:  # a plan for a broken checkpoint would be wrong
        listed = "; ".join(str(p) for p in checkpoint.problems)
        raise CheckpointError(f"Component '{comp.name}' has {len(checkpoint.problems)} checkpoint problem(s): {listed}.")
    fmt = component_format(weights or {}, comp.name, skeleton)
    if fmt and skeleton.quantized:
        origin = "a GGUF file" if getattr(comp, "single_file", None) is not None else "a folder saved quantized"
        raise UsageError(f"'{comp.name}' comes from {origin}, quantized already: drop --weights {comp.name}={fmt}.")
    effective = dtype if dtype is not None else skeleton.default_dtype()
    if fmt and effective is None:
        effective = skeleton.compute_dtype()  # a checkpoint stored in fp8 runs in its other tensors' dtype
    trace_dtype = effective or skeleton.dominant_dtype(None)
    warnings: list[str] = [skeleton.note] if skeleton.note and not skeleton.stored else []
    if tie_note:
        warnings.append(tie_note)
    if skeleton.quantized:  # GGUF, or a folder saved quantized (its note names the format)
        warnings.append(_gguf_note(comp, skeleton, trace_dtype) if getattr(comp, "single_file", None) is not None
                        else skeleton.note)
    if comp.config is None:
        facts = TraceFacts(None, {}, 0, [], {}, "no config: registration order, no activation estimate")
    else:
        facts = trace_facts(comp, pipeline_class, inputs, trace_dtype, use_cache, on_progress=on_progress,
                            on_gpu=on_gpu)
    if facts.warning and not inputs.weights_only and "overflow" in facts.warning.lower():
        raise DoesNotFitError(_overflow_refusal(comp, inputs))  # never planned as if it needed nothing
    if facts.warning:
        warnings.append(f"{comp.name}: {facts.warning}")
    extra, lora_bytes = lora_extra_bytes(comp, skeleton, loras, effective or trace_dtype)
    transients = {} if inputs.weights_only else lora_transients(loras, facts.module_outputs, skeleton, trace_dtype)
    spec, block_warnings = component_spec(comp, skeleton, facts, inputs, effective, fmt, trace_dtype, extra,
                                           transients)
    warnings += [f"{comp.name}: {w}" for w in block_warnings]
    return PreparedComponent(comp, skeleton, trace_dtype, facts, spec, warnings, fmt, effective, lora_bytes)


def _overflow_refusal(comp: ComponentSource, inputs: InputSpec) -> str:
    """A trace that overflowed (torch's storage size, a Python int to C) has no activation estimate, and
    its tensors are beyond any device: planning on without the estimate would report a fit."""
    what = f"{inputs.height}x{inputs.width}" + (f", {inputs.num_frames} frames" if inputs.num_frames else "")
    return (f"{comp.name} ({comp.cls}) does not fit: its activations for {what} at batch {inputs.effective_batch} "
            "are too large to count (its trace on the meta device overflowed); use a smaller size, --batch-size "
            "or --num-images.")


def _gguf_note(comp: ComponentSource, skeleton, compute_dtype: str) -> str:
    """What a plan says of a GGUF component: its types, and the per-layer dequantization it counts."""
    types = ", ".join(f"{count} {name}" for name, count in sorted(comp.single_file.quant_types().items()))
    largest = max(layer_compute_bytes(skeleton.tensors, None, compute_dtype).values(), default=0)
    return (f"{comp.name}: GGUF tensors ({types}) stay quantized; diffusers dequantizes each layer's weight to "
            f"{compute_dtype} while it runs (largest {format_size(largest)}), counted in its block's activations.")


def component_spec(comp: ComponentSource, skeleton, facts: TraceFacts, inputs: InputSpec, effective: str | None, fmt: str | None,
                    trace_dtype: str, extra: dict[str, int] | None = None,
                    lora_layers: dict[str, int] | None = None) -> tuple[ComponentInput, list[str]]:
    """The planner's view of one component for one trace: blocks in execution order with their activations.
    `extra`: bytes held beside a tensor (a LoRA's, `lora_extra_bytes`), counted with it; `lora_layers`: bytes a
    LoRA adds while a layer runs (`lora_transients`), on top of what is live then (`with_lora_peaks`)."""
    peaks = {} if inputs.weights_only else with_lora_peaks(facts.module_peaks, lora_layers or {})
    extra = extra or {}
    tensor_bytes = [(t.name, t.bytes_at(effective, fmt) + extra.get(t.name, 0)) for t in skeleton.tensors]
    blocks, block_warnings = component_blocks(skeleton.modules, tensor_bytes, skeleton.no_split_modules,
                                              facts.execution_order, facts.unsplittable, peaks,
                                              facts.same_device_groups, skeleton.tie_groups)
    activation_peak = 0 if inputs.weights_only else max([facts.activation_peak, *peaks.values()])
    layers = {} if inputs.weights_only else layer_compute_bytes(skeleton.tensors, fmt, trace_dtype)
    if layers:
        extra = transient_by_key([b.keys for b in blocks], layers)
        blocks = [replace(b, activation=b.activation + e) for b, e in zip(blocks, extra)]
        activation_peak += max(layers.values())
    spec = ComponentInput(comp.name, skeleton.cls if skeleton.cls != "?" else comp.cls, blocks, _splittable(comp),
                          activation_peak)
    names = [t.name for t in skeleton.tensors] + [alias for group in skeleton.tie_groups for alias in group[1:]]
    problems = coverage_problems({k: 0 for b in blocks for k in b.keys}, names)
    if problems:  # a bug in block cutting, never the user's fault
        raise AssertionError(f"blocks of {comp.name} do not cover its tensors: {problems[:3]}")
    return spec, block_warnings


def without_activations(spec: ComponentInput, io_bytes: bool) -> ComponentInput:
    """The component with no activations (and with `io_bytes`, no inputs/outputs): what weights alone need."""
    return replace(spec, blocks=[replace(b, activation=0) for b in spec.blocks], activation_peak=0,
                   io_bytes=0 if io_bytes else spec.io_bytes)

"""The plan's predicted step time (`Plan.predicted_time`): what step_time.py needs, gathered from the traced and
placed plan, and the profile a plan predicts with (--profile, else this machine's calibrated one, else the default)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from dm_cli.errors import UsageError
from dm_cli.families import family_parts
from dm_cli.inputs import check_count
from dm_cli.model.formats.weight_formats import layer_compute_bytes
from dm_cli.planning.modes import CompileMode, parse_compile
from dm_cli.planning.parallel.parallel import PIPELINE_LISTS, denoiser_shape, step_flops
from dm_cli.planning.placement.components import trace_facts
from dm_cli.planning.time.overlap import OVERLAPPED
from dm_cli.planning.time.profiles import DEFAULT_PROFILE, DeviceProfile, cached_profile, read_profile
from dm_cli.planning.time.step_time import CallWork, RankCompute, Traffic, call_terms, compiled, predict
from dm_cli.units import DTYPE_BYTES, shorten

MAX_QUEUE = 1_000_000
_BLOCK_ENTRY = re.compile(rf"(?:{'|'.join(PIPELINE_LISTS)})\.[0-9]+")  # a block of the lists (the trace's `outside`)
NO_CPU_PROFILE = ("No predicted time: dmap has no profile of this CPU, and a GPU's figures say nothing of it; "
                  "dmap calibrate measures one (about 20 s), or pass --profile FILE.")


@dataclass(frozen=True)
class PredictionRequest:
    """What `dmap plan --profile FILE --steps N --queue N` asks of the prediction."""

    profile: str | None = None  # a profile file or "table:NAME" (None: the cached one, else the default)
    steps: int | None = None  # None: the family's (or the demo's) default
    queue: int = 1
    prompt: str | None = None  # the prompt: pipelines that drop the text's padding run its own length
    compile: CompileMode = CompileMode.NONE  # --compile as the run asks it: the step as it compiles

    def __post_init__(self) -> None:
        """--steps and --queue checked, one sentence each; compile's word (or "", None: none) as its member."""
        object.__setattr__(self, "compile", parse_compile(self.compile or None))
        if self.steps is not None:
            check_count("steps", self.steps, "--steps")
        if isinstance(self.queue, bool) or not isinstance(self.queue, int) or not 1 <= self.queue <= MAX_QUEUE:
            raise UsageError(f"--queue must be a whole number from 1 to {MAX_QUEUE}, not {shorten(self.queue, quote=True)}.")


def chosen_profile(request: PredictionRequest, kind: str) -> tuple[DeviceProfile, str]:
    """(the profile, where it came from: "file", "table", "cached" or "default"); UsageError for a bad file. The
    calibrated one only when it measured the kind of device ("gpu", "cpu") the denoiser runs on: a CPU's profile
    says nothing of the GPUs a plan names."""
    if request.profile is not None:
        return read_profile(request.profile), "table" if str(request.profile).startswith("table:") else "file"
    cached = cached_profile()
    return (cached, "cached") if cached is not None and cached.kind == kind else (DEFAULT_PROFILE, "default")


def with_profile_rates(options):
    """The options with the parallel time model's rates (--device-tflops, --link-gbps) that were not given taken
    from the profile: its matmul rate at the plan's dtype (bfloat16 when not given) and its link (rate and latency per
    message: a given --link-gbps describes the link alone, bytes only), so that `--parallel auto` chooses on the
    calibrated device."""
    request = options.parallel
    if request.device_tflops is not None and request.link_gbps is not None:
        return options
    profile, _ = chosen_profile(options.prediction, "gpu")  # the parallel layouts are over GPUs
    dtype = options.placement.dtype or "bfloat16"
    tflops = request.device_tflops if request.device_tflops is not None else profile.rate(profile.matmul_tflops, dtype)
    link = request.link_gbps if request.link_gbps is not None else profile.link_gbps
    latency = profile.link_latency_s if request.link_gbps is None else 0.0
    collective = profile.collective_latency_s if request.link_gbps is None else 0.0
    collective_gbps = profile.collective_gbps if request.link_gbps is None else 0.0
    return replace(options, parallel=replace(request, device_tflops=tflops, link_gbps=link, link_latency_s=latency,
                                             collective_latency_s=collective, collective_gbps=collective_gbps))


def rated_for_plan(parallel: tuple, given, dtype: str, prepared) -> tuple:
    """`parallel_request`'s (options, family, guidance, denoiser shape) rated for the traced plan, where they were
    first rated before any trace (the profile's peak matmul rate at bfloat16, 2-byte activations):
    - at the plan's dtype when none was asked (the checkpoint's: a CPU plan of the demo is float32, whose matmuls run
      7x slower than bfloat16's on this CPU, which made the layouts' exchanges look 7x their share of a step);
    - on a measured profile (dmap calibrate's; the table's GPUs keep their peak) unless --device-tflops was given,
      at the rate that makes the time model's FLOPs per step (2 x params x tokens)
      take the detailed model's compute seconds of the traced denoiser (step_time.py: op sizes, attention, elementwise
      bytes, ops; what a small model spends far below the peak), so that each layout's share of the compute and its
      exchanges (bytes over the link, a latency each) are weighed in the same seconds; and with that model itself
      (`compute`), which parallel.py asks for each rank's share of a call (what does not divide by the ranks: the
      ops every rank dispatches, the weights every rank reads, the rate of smaller matmuls).
    `given`: the parallel request as asked, before the profile's rates filled it in."""
    options, family, guidance, shape = parallel
    placement = options.placement if options.placement.dtype else replace(options.placement, dtype=dtype)
    rated = with_profile_rates(replace(options, parallel=given, placement=placement)).parallel
    element = 4 if placement.dtype == "float32" else 2
    shape = replace(shape, element_bytes=element,
                    prediction_bytes=shape.prediction_bytes * element // max(1, shape.element_bytes))
    tflops, compute = rated.device_tflops, None
    prep = next((p for p in prepared if p.spec.name == family.denoiser), None)
    profile, _ = chosen_profile(options.prediction, "gpu")
    if given.device_tflops is None and profile.measured and prep is not None and prep.facts.work:
        work = CallWork.of(prep.facts.work, prep.spec.weights_bytes)
        calls = max(1, family.calls_at_run(options.inputs, options.negative_prompt, options.settings))
        compute = RankCompute(work, profile, placement.dtype)
        seconds = calls * compute.call_s()
        flops = step_flops(shape, sum(t.numel for t in prep.skeleton.tensors))
        if seconds > 0 and flops > 0:
            tflops = min(max(flops / seconds / 1e12, 1e-9), 1e6)
    request = replace(options.parallel, device_tflops=tflops, link_gbps=rated.link_gbps,
                      link_latency_s=rated.link_latency_s, collective_latency_s=rated.collective_latency_s,
                      collective_gbps=rated.collective_gbps, compute=compute)
    return replace(options, parallel=request), family, guidance, shape


def plan_prediction(plan, source, prepared, options, request: PredictionRequest) -> dict:
    """`predicted_time` for the plan ({} when dmap knows no family or its denoiser was not traced)."""
    family, denoiser, _ = family_parts(source.pipeline_class, source.components)
    inputs = options.inputs
    if family is None or denoiser is None or inputs.weights_only or denoiser.name not in plan.components:
        return {}
    prep = next((p for p in prepared if p.spec.name == denoiser.name), None)
    if prep is None or not prep.facts.work:
        return {}
    placed = plan.components[denoiser.name]
    on_gpu = any(isinstance(device, int) or str(device).isdigit() for device in placed.device_map.values())
    profile, origin = chosen_profile(request, "gpu" if on_gpu else "cpu")
    if origin == "default" and not on_gpu:  # the default is a GPU's: it says nothing of this CPU
        plan.warnings.append(NO_CPU_PROFILE)
        return {"steps": request.steps or family.default_steps}  # no seconds; the steps `dmap run -d` runs
    work_facts, text_tokens = run_work(prep, source, family, denoiser, inputs, options, request)  # may trace again
    element = 4 if plan.dtype == "float32" else 2
    shape = denoiser_shape(denoiser, source.pipeline_class, inputs, family, element)
    work = replace(CallWork.of(work_facts, placed.weights_bytes), cast_bytes=cast_bytes(prep))
    compiles, eager = compile_mode(plan, denoiser.name, request.compile, options)
    work = compiled(work, compiles) if compiles is not CompileMode.NONE else work
    devices = set(map(str, placed.device_map.values()))
    hooked = len(prep.facts.execution_order or ()) if placed.offloaded_bytes else (
        len(placed.device_map) if len(devices) > 1 else 0)  # offloaded: every module holding weights; split: each key
    traffic = Traffic(placed.offloaded_bytes, placed.hops, shape.hop_bytes, hooked, streams_of(prep, placed))
    steps = request.steps or family.default_steps
    layouts = dict(plan.parallel.predicted_step_s) if plan.parallel is not None else None
    calls = family.calls_at_run(inputs, options.negative_prompt, options.settings)
    encoders = max(1, calls) * stage_seconds(plan, prepared, profile, "encode")  # a negative prompt's too under CFG
    result = predict(work, traffic, profile, plan.dtype, max(1, calls), steps,
                     inputs.batch_size * inputs.num_images, request.queue, layouts, origin,
                     encoders, stage_seconds(plan, prepared, profile, "decode"))
    if text_tokens is not None:
        result["text_tokens"] = text_tokens
    if request.compile is not CompileMode.NONE:
        result.update(compile=compiles, **({"compile_eager_because": eager} if eager else {}))
    return result


# weight formats whose layers run Python at each call, which a run compiles eager (run/hooks/compile.py PYTHON_WEIGHTS)
EAGER_WEIGHTS = ("fp8", "nf4", "gguf")


def compile_mode(plan, name: str, asked: CompileMode, options) -> tuple[CompileMode, str | None]:
    """(what a run asking `--compile asked` compiles of denoiser `name`: none, regional or full; why it runs eager
    instead), by the rules run/hooks/compile.py's `eager_reason` applies to this plan."""
    if asked is CompileMode.NONE:
        return CompileMode.NONE, None
    placed = plan.components[name]
    where = {str(device) for device in placed.device_map.values()}
    if "disk" in where or ("cpu" in where and len(where) > 1):
        reason = "its blocks stream from cpu or disk through accelerate's hooks, which move weights in Python each call"
    elif plan.weights.get(name) in EAGER_WEIGHTS:
        reason = f"its {plan.weights[name]} weights run Python at each call"
    elif any(lora.get("component") == name and not lora.get("fused") for lora in plan.loras):
        reason = "its LoRAs stay unfused"
    elif options.cache is not None:
        reason = "the step cache decides in Python at each call which blocks run"
    else:
        return (CompileMode.FULL if asked is CompileMode.FULL else CompileMode.REGIONAL), None
    return CompileMode.NONE, reason


def cast_bytes(prep) -> float:
    """Bytes one call of `prep` moves to upcast its weights stored in fp8, int8, NF4 or GGUF: each layer's compute
    copy written, then read by its matmul (an NF4 layer on a single row reads its packed weight instead:
    bitsandbytes' GEMV kernel); for torchao's int8, the scale applied to each layer's output (read and written) too."""
    layers = layer_compute_bytes(prep.skeleton.tensors, prep.weights, prep.dtype)
    if prep.weights == "nf4":  # a layer run on one row (bitsandbytes' GEMV) reads the packed weight: no copy
        rows = {t.name.rpartition(".")[0]: t.shape[0] for t in prep.skeleton.tensors if len(t.shape) == 2}
        element = DTYPE_BYTES.get(prep.dtype, 2)
        layers = {layer: nbytes for layer, nbytes in layers.items()
                  if prep.facts.module_outputs.get(layer, 0) > rows.get(layer, 0) * element}
    moved = 2.0 * sum(layers.values())
    if prep.weights == "int8":
        moved += 2.0 * sum(prep.facts.module_outputs.get(layer, 0) for layer in layers)
    return moved


def stage_seconds(plan, prepared, profile: DeviceProfile, stage: str) -> float:
    """Predicted seconds of one call of each component of `stage` ("encode", "decode"): its traced work on the same
    terms as the denoiser's, with its offloaded weights streamed in."""
    total = 0.0
    for prep in prepared:
        placed = plan.components.get(prep.spec.name)
        if placed is None or not prep.facts.work or stage not in (placed.stage, *placed.stages):
            continue
        work = replace(CallWork.of(prep.facts.work, placed.weights_bytes), cast_bytes=cast_bytes(prep))
        traffic = Traffic(placed.offloaded_bytes, streams=streams_of(prep, placed))
        total += sum(call_terms(work, profile, plan.dtype, traffic).values())
    return total


def streams_of(prep, placed) -> tuple:
    """Step_time.py's `Traffic.streams` for a component whose offload the plan overlaps (overlap.py): each block in
    execution order as (bytes streamed to the execution device each call, prefetched: a cpu block, in a block list);
    () for a synchronous one, whose offloaded bytes count in full."""
    if placed.offload.get("mode") != OVERLAPPED:
        return ()
    out = []
    for block in prep.spec.blocks:
        where = str(placed.device_map.get(block.name, placed.device_map.get("")))
        streamed = where in ("cpu", "disk") and where != str(placed.execution_device)
        out.append((block.bytes if streamed else 0, streamed and where == "cpu",
                    _BLOCK_ENTRY.fullmatch(block.name) is not None))
    return tuple(out)


def run_work(prep, source, family, denoiser, inputs, options, request: PredictionRequest) -> tuple[dict, int | None]:
    """(one denoiser call's work at run time, the text tokens it sees or None): the plan traces the text at its
    maximum length (the memory worst case); a pipeline that drops the padding (Qwen-Image, Z-Image) runs the prompt's
    own length, so with a prompt and the pipeline's tokenizer the denoiser is traced again at that length."""
    maximum = family.max_sequence_length(denoiser, inputs)
    if not maximum:
        return prep.facts.work, None
    folder = source.root / "tokenizer" if source.root is not None else None
    tokens = family.run_text_tokens(folder, request.prompt, options.negative_prompt, int(maximum))
    if tokens is None or tokens >= maximum:
        return prep.facts.work, None
    facts = trace_facts(prep.source, source.pipeline_class, replace(inputs, max_sequence_length=tokens), prep.dtype,
                        options.use_cache)
    return (facts.work or prep.facts.work), tokens

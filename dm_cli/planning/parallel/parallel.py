"""Parallel within a step: CFG-parallel and context parallel (Ulysses) over torchrun ranks, chosen by the plan.

A denoiser split by the device map runs one GPU at a time. With `--world-size N` the plan says how N ranks
(rank r on GPU r) could all work in each step instead:

- **CFG-parallel** (degree 2): the two guidance branches on two ranks (the halves of the doubled batch of
  SD/SDXL/SD3/Z-Image, or the two separate calls of Wan and Qwen-Image's true CFG), exchanging one noise
  prediction per step. Only when the family's guidance has two branches for these inputs.
- **Context parallel** (Ulysses degree u): diffusers' `ContextParallelConfig(ulysses_degree=u)` through
  `model.enable_parallelism(...)`, for denoiser classes with a `_cp_plan` (`CP_PLANS`): the sequence is split
  over u ranks, attention heads are exchanged all-to-all. u must divide the heads and every split sequence.
  Ring attention is not planned (`ring` is always 1).
- both at once: world size = cfg x ulysses.
- **Pipeline parallel** (PipeFusion-like, degree N): the denoiser's blocks (the entries of its
  `transformer_blocks`, `single_transformer_blocks` or `blocks` lists) cut into N contiguous slices, slice r on
  rank r; the hidden states (and the text's) pass rank to rank, and several queue prompts (micro-batches) are in
  flight so that every rank computes all the time. The plan's device map of the denoiser is that cut (GPU r holds
  slice r, the modules before the blocks GPU 0, those after the last GPU): one process runs it as a plain split,
  the baseline the pipeline is compared with. The cut balances the slices' FLOPs (`pipeline_cut`).

Memory per rank: the denoiser's weights whole on every rank (Wan 2.2's experts together when they fit, else
one at a time), its activations divided by the degrees (CFG halves a doubled batch; Ulysses divides the
sequence) plus one layer's all-to-all buffers, and the rank's GPU overhead. Encoders and the VAE are not
copied: they run once, as the single-process plan places them (their stages' peaks on that GPU count).
Pipeline: rank r holds its slice, every module of the denoiser outside the block lists (embedders, output
layers: small), the denoiser's activation peak (one micro-batch computes at a time), `in_flight` x (send +
receive buffers of one micro-batch's hidden and text hidden states) and its overhead; the LoRA adapters of its
slice's layers, as its blocks' bytes count them; Wan 2.2's experts, cut at the same blocks, both slices of each.

Step times (`auto`) from a simple model: FLOPs per step (2 x params x tokens x calls, plus attention's
4 x layers x tokens^2 x hidden) at `device_tflops`, plus what crosses the links at `link_gbps` (split:
hidden states at each hop and offloaded weights streamed; CFG: one noise prediction; Ulysses: q, k, v and
out of every attention layer, 4 x (tokens/u) x hidden x bytes x (u-1)/u per rank). Pipeline: the same FLOPs
per slice (2 x its parameters x tokens, plus attention for each block in it); one prompt takes the split's time
(sum of the slices plus a hop of the hidden states at each cut), a queue of at least `in_flight` >= N prompts one
image-step per max over slices of (slice + one hop). With a calibrated profile (`compute`, step_time.RankCompute)
a rank's compute is instead the detailed model of its share of a call: under cfg and context it still dispatches
every op and reads every weight (its matmuls on a share of the tokens run at the smaller op's rate), a pipeline
slice runs its share of both; FLOPs alone divided a tiny model's step by the ranks where, on two CPU ranks,
context parallel measured no faster than one. Each exchange also costs the link's latency (`link_latency_s`:
0 for the GPU table's links, where it is microseconds against milliseconds of compute; between CPU ranks, gloo over
loopback, `dmap calibrate` measures tens of microseconds a message, and Ulysses sends 4 per attention layer):
CFG one all-gather per step, Ulysses 4 all-to-alls per attention layer and call plus the output's gather (each a
collective: `collective_latency_s` where calibrated, diffusers' functional all-to-all costing several messages), a
pipeline hop `HOP_MESSAGES` messages (a header, the hidden and the text hidden states), a split's hop none.

The layout a plan records and its choice among these candidates: `parallel_layout.py`.
Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dm_cli.errors import UsageError
from dm_cli.families import GUIDANCE_BATCH, GUIDANCE_SEPARATE, Job, call_spec
from dm_cli.families.calls import TensorSpec
from dm_cli.inputs import Generation
from dm_cli.planning.modes import Layout, Parallel
from dm_cli.units import shorten

MAX_WORLD_SIZE = 1024
MAX_IN_FLIGHT = 1024
# The lists whose entries pipeline parallel cuts into slices (entries of a root ModuleList of these names)
PIPELINE_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")
SPEEDUP_BASIS = "per-slice FLOPs from the configs"
# The denoiser classes `dmap run` cuts (dm_cli.run.ranks.pipeline): their blocks carry the whole state from one to the next
PIPELINE_CLASSES = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel",
                    "WanTransformer3DModel")
DEFAULT_DEVICE_TFLOPS = 100.0  # dense bf16 a GPU sustains in a denoiser step (an H100 peaks near 990)
DEFAULT_LINK_GBPS = 25.0  # GB/s between two GPUs (PCIe 4 x16; NVLink is 10-20x more)
HOP_MESSAGES = 3  # a pipeline hop's sends: the header, the hidden and the text hidden states (run/ranks/pipeline_links.py)
ULYSSES_MESSAGES = 4  # all-to-alls per attention layer and call: q, k, v in, the output back
# ops diffusers' Ulysses adds per attention layer and call (reshapes, permutes, copies, the collectives and waits):
# 1280 aten ops a call on each rank of the FLUX demo (8 attention layers) against 949 in one process, diffusers 0.42.1
ULYSSES_OPS_PER_LAYER = 41

# Denoiser classes with a `_cp_plan` in diffusers 0.42.1 (of the families dmap knows), and the sequences it
# splits over the ranks (each must divide by the degree): FLUX-style joint attention splits the text tokens
# too; Wan splits only the video tokens (its cross-attention keeps the whole prompt).
CP_PLANS = {
    "FluxTransformer2DModel": ("image", "text"),
    "Flux2Transformer2DModel": ("image", "text"),
    "QwenImageTransformer2DModel": ("image", "text"),
    "WanTransformer3DModel": ("image",),
}


@dataclass(frozen=True)
class ParallelRequest:
    """What `dmap plan --world-size N --parallel CHOICE` asks (choice None: none for one rank, auto above)."""

    world_size: int = 1
    choice: str | None = None
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    link_gbps: float = DEFAULT_LINK_GBPS
    in_flight: int | None = None  # pipeline: micro-batches in flight (None: the world size)
    link_latency_s: float = 0.0  # seconds per exchange on the link (a message's fixed cost; 0: bytes alone)
    collective_latency_s: float = 0.0  # seconds per collective (all-to-all, gather) beyond its bytes; 0: link_latency_s
    collective_gbps: float = 0.0  # the rate of a collective's bytes (calibrated between CPU ranks); 0: link_gbps
    # the detailed model of a call on one rank (step_time.RankCompute: a calibrated profile's); None: FLOPs at
    # device_tflops. Not a user setting: plan_prediction.rated_for_plan fills it in from the traced denoiser.
    compute: object = None

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def settled(self) -> "ParallelRequest":
        """The request checked, one sentence each (UsageError), with its choice filled in."""
        size = self.world_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise UsageError(f"--world-size must be a whole number from 1 to {MAX_WORLD_SIZE}, not "
                             f"{shorten(size, quote=True)}.")
        choice = self.choice if self.choice is not None else (Parallel.NONE.value if size == 1 else Parallel.AUTO.value)
        if choice not in Parallel.words():
            raise UsageError(f"--parallel must be {', '.join(Parallel.words()[:-1])} or {Parallel.AUTO}, not "
                             f"{shorten(choice, quote=True)}.")
        if size == 1 and choice != Parallel.NONE:
            raise UsageError(f"--parallel {choice} needs --world-size 2 or more (one rank has nothing to share).")
        if size > 1 and choice == Parallel.NONE:
            raise UsageError(f"--world-size {size} with --parallel none would run one process: give --parallel "
                             "cfg, context, cfg+context, pipeline or auto.")
        for flag, value in (("--device-tflops", self.device_tflops), ("--link-gbps", self.link_gbps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value <= 1e6:
                raise UsageError(f"{flag} must be a number above 0 (at most 1e6), not {shorten(value, quote=True)}.")
        in_flight = self.in_flight
        if in_flight is not None:
            if isinstance(in_flight, bool) or not isinstance(in_flight, int) or not 1 <= in_flight <= MAX_IN_FLIGHT:
                raise UsageError(f"--in-flight must be a whole number from 1 to {MAX_IN_FLIGHT}, not "
                                 f"{shorten(in_flight, quote=True)}.")
            if choice not in (Parallel.PIPELINE, Parallel.AUTO):
                raise UsageError(f"--in-flight sets the micro-batches of --parallel pipeline, which --parallel {choice} "
                                 "does not use: drop it, or use --parallel pipeline or auto.")
        for latency in (self.link_latency_s, self.collective_latency_s):
            if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency <= 1:
                raise UsageError(f"the link's latency must be a number of seconds from 0 to 1, not "
                                 f"{shorten(latency, quote=True)}.")
        rate = self.collective_gbps
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not 0 <= rate <= 1e6:
            raise UsageError(f"the collectives' rate must be a number of GB/s from 0 to 1e6, not {shorten(rate, quote=True)}.")
        return replace(self, choice=choice, device_tflops=float(self.device_tflops), link_gbps=float(self.link_gbps),
                       link_latency_s=float(self.link_latency_s), collective_latency_s=float(self.collective_latency_s),
                       collective_gbps=float(rate))

    @property
    def planned_in_flight(self) -> int:
        """Micro-batches the pipeline layout plans in flight: --in-flight, else one per rank, which keeps every rank
        busy when the slices take equal times (more only hide jitter, and each holds its activations and buffers:
        on the bench's CPU ranks 2 per rank were no faster and rank 1 held 545 MB at its peak against 498 MB)."""
        return self.in_flight if self.in_flight is not None else min(MAX_IN_FLIGHT, self.world_size)


@dataclass(frozen=True)
class Guidance:
    """How many guidance branches a step has for these inputs (2: CFG-parallel can split them), and why not."""

    kind: str  # GUIDANCE_BATCH, GUIDANCE_SEPARATE or GUIDANCE_DISTILLED (dm_cli.families)
    branches: int
    why_not: str = ""  # the sentence refusing cfg when branches == 1


@dataclass(frozen=True)
class DenoiserShape:
    """The denoiser's call for these inputs, from its config and the family's call spec (no trace needed)."""

    cls: str
    heads: int
    hidden: int  # heads x head dim
    layers: int  # attention layers
    image_tokens: int
    text_tokens: int
    batch: int  # of one call (a CFG-doubled batch included)
    calls: int  # per step (2 under separate CFG)
    element_bytes: int  # of one activation element (bf16: 2)
    prediction_bytes: int  # one branch's noise prediction
    blocks: int = 0  # entries of its block lists, as its config counts them (0: unknown)
    experts: tuple[str, ...] = ()  # the other denoisers the pipeline switches to (Wan 2.2's transformer_2)

    @property
    def hop_bytes(self) -> int:
        """One micro-batch's block inputs at a pipeline cut: the hidden and the text hidden states of one call."""
        return (self.image_tokens + self.text_tokens) * self.hidden * self.element_bytes * self.batch

    def buffer_bytes(self, in_flight: int) -> int:
        """A pipeline rank's send and receive buffers for `in_flight` micro-batches."""
        return in_flight * 2 * self.hop_bytes

    @property
    def split_sequences(self) -> tuple[str, ...] | None:
        return CP_PLANS.get(self.cls)

    @property
    def split_tokens(self) -> int:
        """Tokens the context-parallel plan splits (and that attention sees) per sample."""
        parts = self.split_sequences or ("image", "text")
        return self.image_tokens + (self.text_tokens if "text" in parts else 0)


@dataclass(frozen=True)
class Candidate:
    layout: str
    cfg: int = 1
    ulysses: int = 1

    @property
    def title(self) -> str:
        return layout_title(self.layout, self.cfg, self.ulysses)


def layout_title(layout: str, cfg: int, ulysses: int, world_size: int = 0) -> str:
    if layout == Layout.SPLIT:
        return f"device-map split over {world_size} GPUs" if world_size else "device-map split"
    if layout == Layout.PIPELINE:
        return f"pipeline parallel ({world_size} slices)" if world_size else "pipeline parallel"
    if layout == Layout.CFG:
        return "CFG-parallel (2 branches)"
    if layout == Layout.CONTEXT:
        return f"context parallel (Ulysses {ulysses})"
    return f"CFG-parallel 2 x context parallel (Ulysses {ulysses})"


def cfg_refusal(guidance: Guidance) -> str | None:
    return guidance.why_not if guidance.branches < 2 else None


def context_refusal(shape: DenoiserShape, ulysses: int) -> str | None:
    """Why context parallel of this degree cannot run this denoiser (None: it can)."""
    if shape.split_sequences is None:
        known = ", ".join(sorted(CP_PLANS))
        return (f"{shape.cls} has no _cp_plan in diffusers 0.42.1, so it cannot run context parallel "
                f"(the classes that can: {known}); use --parallel cfg or a smaller --world-size.")
    if shape.heads % ulysses:
        degrees = [d for d in range(2, shape.heads + 1) if shape.heads % d == 0 and d <= MAX_WORLD_SIZE][:6]
        return (f"Ulysses degree {ulysses} does not divide {shape.cls}'s {shape.heads} attention heads: use a "
                f"degree of {', '.join(map(str, degrees))} (world size = cfg x ulysses).")
    for name in shape.split_sequences:
        tokens = shape.image_tokens if name == "image" else shape.text_tokens
        if tokens % ulysses:
            what = "--height/--width/--frames" if name == "image" else "--max-sequence-length"
            return (f"Ulysses degree {ulysses} does not divide the {tokens} {name} tokens of {shape.cls} for these "
                    f"inputs: change {what} or the world size.")
    return None


def pipeline_refusal(shape: DenoiserShape, world: int) -> str | None:
    """Why pipeline parallel cannot cut this denoiser over `world` ranks, from its config (None: it can)."""
    if shape.cls not in PIPELINE_CLASSES:
        other = "cfg or context" if shape.split_sequences else "cfg"
        return (f"pipeline parallel cuts {', '.join(PIPELINE_CLASSES[:-1])} and {PIPELINE_CLASSES[-1]} (whose blocks "
                f"carry the whole state from one to the next), not {shape.cls}: use --parallel {other}.")
    if shape.blocks and world > shape.blocks:
        return (f"--world-size {world} with --parallel pipeline needs a block per rank, and {shape.cls} has "
                f"{shape.blocks}: use --world-size {shape.blocks} or fewer.")
    return None


def candidates(request: ParallelRequest, guidance: Guidance, shape: DenoiserShape) -> tuple[list[Candidate], dict]:
    """The layouts to compare for `request` (settled): one for an explicit choice (UsageError when it cannot
    run), every runnable one and the split for auto; with the sentences refusing the others (auto)."""
    world, choice = request.world_size, request.choice
    found: list[Candidate] = [Candidate(Layout.SPLIT.value)] if choice == Parallel.AUTO else []
    refused: dict[str, str] = {}
    if choice in (Parallel.PIPELINE, Parallel.AUTO):
        problem = pipeline_refusal(shape, world)
        if problem and choice == Parallel.PIPELINE:
            raise UsageError(problem)
        if choice == Parallel.PIPELINE:
            return [Candidate("pipeline")], refused
    wanted = [layout.value for layout in ((Layout.CFG, Layout.CONTEXT, Layout.CFG_CONTEXT) if choice == Parallel.AUTO
                                          else (Parallel(choice).layout,))]
    for layout in wanted:
        cfg = 2 if layout != Layout.CONTEXT else 1
        ulysses = world // cfg if layout != Layout.CFG else 1
        problem = None
        if cfg * ulysses != world or (layout == Layout.CFG_CONTEXT and ulysses < 2):
            problem = (f"{layout_title(layout, cfg, max(ulysses, 2))} needs a world size of "
                       + ("2" if layout == Layout.CFG else "2 x the Ulysses degree (4, 6, 8, ...)") + f", not {world}.")
        problem = problem or (cfg_refusal(guidance) if cfg == 2 else None) or (
            context_refusal(shape, ulysses) if ulysses > 1 else None)
        if problem and choice != Parallel.AUTO:
            raise UsageError(problem)
        if problem:
            refused[layout] = problem
        else:
            found.append(Candidate(layout, cfg, ulysses))
    if choice == Parallel.AUTO:
        problem = pipeline_refusal(shape, world)
        if problem:
            refused["pipeline"] = problem
        else:
            found.append(Candidate("pipeline"))
    return found, refused


# --- what the family and the configs say (before any trace) ---------------------------------------


def guidance_branches(family, inputs, negative_prompt: str | None, settings: dict) -> Guidance:
    """The guidance branches of one step for these inputs: 2 under CFG on a doubled batch (GUIDANCE_BATCH with
    cfg_batch() == 2) or under separate true-CFG calls that actually run (Qwen-Image: true_cfg_scale > 1 and a
    negative prompt, as its pipeline decides); else 1, with the sentence that refuses CFG-parallel."""
    title = family.title()
    if family.guidance == GUIDANCE_BATCH:
        if family.cfg_batch(inputs) == 2:
            return Guidance("batch", 2)
        return Guidance("batch", 1, f"CFG-parallel needs two guidance branches, and {title} at guidance scale "
                                    f"{family.guidance_scale(inputs):g} runs one: raise --guidance-scale or use "
                                    "--parallel context.")
    if family.guidance == GUIDANCE_SEPARATE:
        if family.denoiser_calls(inputs) < 2:
            return Guidance("separate", 1, f"CFG-parallel needs two guidance branches, and {title} at guidance "
                                           f"scale {family.guidance_scale(inputs):g} makes one call per step: "
                                           "raise --guidance-scale or use --parallel context.")
        declared = {s.name: s.default for s in family.settings if s.default is not None}
        generation = Generation(negative_prompt=negative_prompt, steps=1, guidance_scale=family.guidance_scale(inputs),
                                height=inputs.height or 0, width=inputs.width or 0, num_images=1,
                                settings=tuple(sorted({**declared, **{k: v for k, v in settings.items()
                                                                      if v is not None}}.items())))
        job = Job("", 0, generation)
        true_cfg = getattr(family, "true_cfg", None)
        if callable(true_cfg) and not true_cfg(job):
            return Guidance("separate", 1, f"CFG-parallel needs two guidance branches, and {title} runs its second "
                                           "(true CFG) call only with --negative-prompt and --true-cfg-scale above 1: "
                                           "add them or use --parallel context.")
        return Guidance("separate", 2)
    return Guidance("distilled", 1, f"{title} is guidance-distilled (guidance is an input of the model, one call "
                                    "per step), so there are no two branches for CFG-parallel: use --parallel context.")


def _count_of(config: dict, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _patch(config: dict) -> tuple[int, int]:
    """(temporal, spatial) patch of the denoiser's latents (1, 1 for packed tokens)."""
    patch = config.get("patch_size", config.get("all_patch_size"))
    if isinstance(patch, list) and patch:
        patch = patch if len(patch) == 3 else [1, patch[0], patch[0]]
        return int(patch[0]), int(patch[1])
    return 1, int(patch) if isinstance(patch, int) and patch > 0 else 1


def denoiser_shape(comp, pipeline_class: str | None, inputs, family, element_bytes: int) -> DenoiserShape:
    """Heads, layers and token counts of the denoiser's call for `inputs`, from its config and the family's
    call spec (dm_cli.families.calls): the same shapes the meta trace runs."""
    config = comp.config or {}
    spec = call_spec(comp, pipeline_class, inputs)
    kwargs = spec.kwargs if spec is not None else {}
    latents = kwargs.get("hidden_states", kwargs.get("x"))
    text = kwargs.get("encoder_hidden_states", kwargs.get("cap_feats"))
    shape = latents.shape if isinstance(latents, TensorSpec) else (1, 1, 1)
    temporal, spatial = _patch(config)
    if len(shape) == 3:  # packed tokens (B, N, C)
        tokens = shape[1]
    elif len(shape) == 4:  # (B, C, H, W)
        tokens = (shape[2] // spatial) * (shape[3] // spatial)
    else:  # (B, C, F, H, W)
        tokens = (shape[2] // temporal) * (shape[3] // spatial) * (shape[4] // spatial)
    heads = _count_of(config, "num_attention_heads", "n_heads")
    head_dim = _count_of(config, "attention_head_dim")
    hidden = heads * head_dim if head_dim else _count_of(config, "dim", "inner_dim")
    layers = _count_of(config, "num_layers", "n_layers") + _count_of(config, "num_single_layers") \
        + 2 * _count_of(config, "n_refiner_layers")
    numel = math.prod(shape)
    return DenoiserShape(comp.cls, heads, hidden, layers, tokens,
                         text.shape[1] if isinstance(text, TensorSpec) and len(text.shape) == 3 else 0,
                         shape[0], family.denoiser_calls(inputs), element_bytes,
                         numel * element_bytes // max(1, family.cfg_batch(inputs)),
                         _count_of(config, "num_layers") + _count_of(config, "num_single_layers"))


# --- memory and time ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rank:
    """A rank's GPU: its budget, overhead, and the peak of the stages that are not the denoiser's there."""

    gpu: int
    capacity: int
    overhead: int
    other_peak: int = 0


@dataclass(frozen=True)
class DenoiserLoad:
    """What the traced plan knows of the denoiser: weights per expert, activation peak, parameters, and how
    the single-process plan runs it (hops and offloaded bytes of the busiest expert)."""

    weights: tuple[int, ...]
    activation_peak: int
    params: int
    hops: int = 0
    offloaded_bytes: int = 0
    split_peaks: dict = field(default_factory=dict)  # GPU -> the single-process plan's peak there


def _per_rank_batch_calls(shape: DenoiserShape, guidance: Guidance, cfg: int) -> tuple[float, float]:
    """(batch, calls) one rank runs per step: CFG halves a doubled batch, or the separate calls."""
    if cfg == 2 and guidance.kind == "separate":
        return shape.batch, shape.calls / 2
    return shape.batch / cfg, shape.calls


def rank_denoise_peak(cand: Candidate, shape: DenoiserShape, guidance: Guidance, load: DenoiserLoad,
                      rank: Rank) -> tuple[int, bool]:
    """(peak bytes of the denoise stage on `rank`, whether the experts are resident together)."""
    divisor = (cand.cfg if guidance.kind != "separate" else 1) * cand.ulysses
    activations = -(-load.activation_peak // divisor)
    batch, _ = _per_rank_batch_calls(shape, guidance, cand.cfg)
    if cand.ulysses > 1:  # one layer's q, k, v, out sent and received all-to-all
        activations += int(4 * shape.split_tokens / cand.ulysses * shape.hidden * shape.element_bytes * batch)
    together = sum(load.weights) + activations + rank.overhead
    if together <= rank.capacity or len(load.weights) == 1:
        return together, True
    return max(load.weights) + activations + rank.overhead, False


def step_flops(shape: DenoiserShape, params: int) -> float:
    """FLOPs of one step on one device: the dense layers (2 x params x tokens) and attention's scores and
    weighted sums (4 x layers x query tokens x key tokens x hidden), for every sample and call."""
    tokens = shape.image_tokens + shape.text_tokens
    per_sample = 2 * params * tokens + 4 * shape.layers * _attention_pairs(shape) * shape.hidden
    return float(per_sample * shape.batch * shape.calls)


def _attention_pairs(shape: DenoiserShape) -> int:
    """(query, key) token pairs of one attention layer for one sample."""
    tokens = shape.image_tokens + shape.text_tokens
    if shape.split_sequences == ("image",):  # self-attention over the video, cross-attention to the prompt
        return shape.image_tokens * (shape.image_tokens + shape.text_tokens)
    return tokens * tokens  # joint attention over both


def step_seconds(cand: Candidate, shape: DenoiserShape, guidance: Guidance, load: DenoiserLoad,
                 request: ParallelRequest) -> float:
    """The predicted seconds of one denoising step for this layout (see the module's doc)."""
    flops, link = step_flops(shape, load.params), request.link_gbps * 1e9
    model = request.compute
    compute = model.call_s() * shape.calls if model is not None else flops / (request.device_tflops * 1e12)
    if cand.layout == Layout.SPLIT:
        hidden_bytes = (shape.image_tokens + shape.text_tokens) * shape.hidden * shape.element_bytes * shape.batch
        moved = load.hops * hidden_bytes * shape.calls + load.offloaded_bytes * shape.calls
        return compute + moved / link
    batch, calls = _per_rank_batch_calls(shape, guidance, cand.cfg)
    if model is not None:  # every rank dispatches every op of its calls, over its share of the samples and tokens
        seconds = model.call_s(batch / shape.batch / cand.ulysses) * calls
    else:
        seconds = compute / (cand.cfg * cand.ulysses)
    latency = request.collective_latency_s or request.link_latency_s
    collective_link = (request.collective_gbps or request.link_gbps) * 1e9  # what the collectives' bytes move at
    if cand.ulysses > 1:
        u = cand.ulysses
        tensor = (shape.split_tokens / u) * shape.hidden * shape.element_bytes  # one of q, k, v, out on a rank
        seconds += ULYSSES_MESSAGES * tensor * (u - 1) / u * shape.layers * batch * calls / collective_link
        if model is not None:  # each copied into the all-to-all's layout and back (read and written twice), by the
            # ops Ulysses adds
            seconds += model.copy_s(ULYSSES_MESSAGES * 2 * 2 * tensor * shape.layers * batch * calls)
            seconds += model.ops_s(ULYSSES_OPS_PER_LAYER * shape.layers * calls)
        seconds += (ULYSSES_MESSAGES * shape.layers + 1) * calls * (u - 1) * latency
    if cand.cfg > 1:
        seconds += shape.prediction_bytes / collective_link + latency
    return seconds


# --- pipeline parallel: the cut ------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One atomic block of the denoiser's plan (the search's Block) as the cut sees it: its name, device_map keys,
    weights and parameters."""

    name: str
    keys: tuple[str, ...]
    bytes: int
    params: int
    work: float | None = None  # sum over its weights of parameters x the tokens each multiplies (`weight_tokens`)

    @property
    def entries(self) -> tuple[str, ...]:
        """The block-list entries it holds ("transformer_blocks.3"); () when it is not (all) inside one."""
        found = [list_entry(key) for key in self.keys]
        return () if None in found else tuple(dict.fromkeys(found))


# Weights that multiply one vector per sample (the timestep's modulation), the text tokens only, or (in FLUX's single
# blocks, which run on the joined sequence) every token; the rest multiply the image tokens. Measured on the bench
# FLUX (2 double + 4 single blocks, 256 image + 64 text tokens): counting every weight at every token made a double
# block look 2.4x a single one and cut 2 | 4 (rank 1 computed 1.7x rank 0); counted this way they cost the same.
_ONCE = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "img_mod.", "txt_mod.",
         "scale_shift_table", "time_text_embed.", "time_embed", "timestep_embedder.", "condition_embedder.time",
         "time_guidance_embed.", "double_stream_modulation", "single_stream_modulation")
_TEXT = ("_context", ".add_", "to_add_out", "txt_", "context_embedder.", "condition_embedder.text", "attn2.to_k.",
         "attn2.to_v.")


def weight_tokens(name: str, shape: "DenoiserShape") -> int:
    """The tokens per sample that the weight `name` multiplies in one call (an estimate from the name)."""
    if any(part in name for part in _ONCE):
        return 1
    if any(part in name for part in _TEXT):
        return shape.text_tokens
    if name.startswith("single_transformer_blocks."):
        return shape.image_tokens + shape.text_tokens
    return shape.image_tokens


def list_entry(key: str) -> str | None:
    """The entry of a block list (PIPELINE_LISTS) that a module name is, or lies in; None: outside them."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in PIPELINE_LISTS and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return None


@dataclass(frozen=True)
class PipelineCut:
    """The denoiser cut into one contiguous slice per rank."""

    slices: tuple[tuple[str, ...], ...]  # per rank: its block-list entries, in execution order
    block_map: dict  # every unit's name -> its GPU (rank r on GPU r): the single-process device map of the cut
    slice_bytes: tuple[int, ...]  # weights of each rank's entries
    slice_flops: tuple[float, ...]  # per step and image; the first rank's with the modules before the blocks, the
    # last rank's with those after
    shared_bytes: int  # every module outside the block lists: each rank holds them all

    @property
    def world_size(self) -> int:
        return len(self.slices)


def pipeline_cut(units: list[Unit], world: int, shape: DenoiserShape,
                 room: list[int] | None = None) -> "PipelineCut | str":
    """The denoiser's units (execution order) cut into `world` contiguous non-empty slices of whole block-list
    entries, minimising the largest slice's FLOPs (per step: 2 x parameters x tokens for every unit, plus one
    attention layer per entry); the modules before the first entry go with slice 0, those after the last with the
    last slice, any between two entries with the slice before. `room[r]`: the most bytes of block weights rank r
    can hold; the fastest cut that keeps every slice within its room is taken (FLUX's double blocks hold 2.4x a
    single block's weights for the same FLOPs, so the fastest cut alone can overfill the first rank), else the
    fastest one. A sentence when it cannot be cut."""
    tokens = shape.image_tokens + shape.text_tokens
    per_sample = shape.batch * shape.calls
    attention = 4 * _attention_pairs(shape) * shape.hidden

    def flops(unit: Unit, entries: int) -> float:
        work = unit.work if unit.work is not None else unit.params * tokens
        return float((2 * work + entries * attention) * per_sample)

    atoms: list[list[Unit]] = []  # runs of units that hold the same entries: the cut never divides one
    atom_entries: list[tuple[str, ...]] = []
    before: list[Unit] = []
    after: list[Unit] = []  # non-block units since the last atom (between atoms: they join the one before)
    for unit in units:
        entries = unit.entries
        if not entries:
            (after if atoms else before).append(unit)
            continue
        if atoms and set(entries) & set(atom_entries[-1]) and not after:
            atoms[-1].append(unit)
            atom_entries[-1] = tuple(dict.fromkeys((*atom_entries[-1], *entries)))
            continue
        if after:
            atoms[-1].extend(after)
            after = []
        atoms.append([unit])
        atom_entries.append(entries)
    if not atoms:
        other = "cfg or context" if shape.split_sequences else "cfg"
        return (f"pipeline parallel cuts a transformer's block lists ({', '.join(PIPELINE_LISTS)}), and {shape.cls} "
                f"has none: use --parallel {other}.")
    if world > len(atoms):
        return (f"--world-size {world} with --parallel pipeline needs a block per rank, and {shape.cls} has "
                f"{len(atoms)}: use --world-size {len(atoms)} or fewer.")
    costs = [sum(flops(u, len(entries) if u is atom[0] else 0) for u in atom)
             for atom, entries in zip(atoms, atom_entries)]
    head = sum(flops(u, 0) for u in before)
    tail = sum(flops(u, 0) for u in after)
    sizes = [sum(u.bytes for u in atom if u.entries) for atom in atoms]
    starts = (balanced_cut(costs, world, head, tail, sizes, room) if room is not None else None) \
        or balanced_cut(costs, world, head, tail)
    bounds = list(zip(starts, [*starts[1:], len(atoms)]))
    block_map = {u.name: 0 for u in before}
    slices, slice_bytes, slice_flops = [], [], []
    for rank, (start, end) in enumerate(bounds):
        members = [u for atom in atoms[start:end] for u in atom]
        block_map.update({u.name: rank for u in members})
        slices.append(tuple(e for entries in atom_entries[start:end] for e in entries))
        slice_bytes.append(sum(u.bytes for u in members if u.entries))
        slice_flops.append(sum(costs[start:end]) + (head if rank == 0 else 0) + (tail if rank == world - 1 else 0))
    block_map.update({u.name: world - 1 for u in after})
    shared = sum(u.bytes for u in units if not u.entries)
    return PipelineCut(tuple(slices), block_map, tuple(slice_bytes), tuple(slice_flops), shared)


def balanced_cut(costs: list[float], parts: int, head: float = 0.0, tail: float = 0.0, sizes: list[int] | None = None,
                 room: list[int] | None = None) -> list[int] | None:
    """The start index of each of `parts` contiguous non-empty slices of `costs` (1 <= parts <= len(costs)) that
    minimise the largest slice, the first slice carrying `head` more and the last `tail` more (dynamic
    programming over the cut points, O(parts x n^2)); with `sizes` and `room`, only slices k whose sizes sum to at
    most room[k] (None when no such cut exists)."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    held = [0]
    for size in sizes or [0] * n:
        held.append(held[-1] + size)

    def fits(k: int, j: int, i: int) -> bool:  # slice k (1-based) of entries j .. i - 1
        return room is None or held[i] - held[j] <= room[k - 1]

    inf = float("inf")
    # best[k][i]: the least largest slice of costs[:i] in k slices; cut[k][i]: where the k-th slice starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    for i in range(1, n + 1):
        best[1][i] = prefix[i] + head if fits(1, 0, i) else inf
    for k in range(2, parts + 1):
        for i in range(k, n + 1):
            extra = tail if (k == parts and i == n) else 0.0
            for j in range(k - 1, i):
                if not fits(k, j, i):
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[parts][n] == inf:
        return None
    starts, i = [], n
    for k in range(parts, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return [0, *reversed(starts)]


def beside_slice(shared_bytes: int, activation_peak: int, shape: DenoiserShape, in_flight: int) -> int:
    """What a pipeline rank holds beside its slice's block weights and its GPU's overhead: every module outside the
    block lists, one micro-batch's activations and `in_flight` x (send + receive buffers)."""
    return shared_bytes + activation_peak + shape.buffer_bytes(in_flight)


def pipeline_rank_peak(cut: PipelineCut, rank: int, activation_peak: int, shape: DenoiserShape, in_flight: int,
                       overhead: int) -> int:
    """The denoise stage's peak on rank `rank` under pipeline parallel: its slice, what it holds beside it
    (`beside_slice`) and the GPU's overhead."""
    return cut.slice_bytes[rank] + beside_slice(cut.shared_bytes, activation_peak, shape, in_flight) + overhead


def pipeline_seconds(cut: PipelineCut, shape: DenoiserShape, request: ParallelRequest, in_flight: int) -> tuple[float, float]:
    """(seconds per step of one image run as the cut's device-map split in one process: the slices one after
    another and a hop of the hidden states at each cut; seconds per image-step of the pipeline with `in_flight`
    prompts in flight: the slowest rank's slice and hop, or one prompt's round trip over the prompts in flight).
    """
    link = request.link_gbps * 1e9
    hop = (shape.hop_bytes / link + HOP_MESSAGES * request.link_latency_s) * shape.calls
    model, total = request.compute, sum(cut.slice_flops)
    detailed = model is not None and total
    stages = ([model.call_s(f / total, divide_ops=True) * shape.calls for f in cut.slice_flops]
              if detailed else [f / (request.device_tflops * 1e12) for f in cut.slice_flops])
    # one process runs the work outside the blocks once; each pipeline rank runs it again (its stage counts it)
    split = (model.call_s() * shape.calls if detailed else sum(stages)) + (len(stages) - 1) * hop
    round_trip = sum(stages) + len(stages) * hop
    return split, max(max(s + hop for s in stages), round_trip / max(1, in_flight))

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

Memory per rank: the denoiser's weights whole on every rank (Wan 2.2's experts together when they fit, else
one at a time), its activations divided by the degrees (CFG halves a doubled batch; Ulysses divides the
sequence) plus one layer's all-to-all buffers, and the rank's GPU overhead. Encoders and the VAE are not
copied: they run once, as the single-process plan places them (their stages' peaks on that GPU count).

Step times (`auto`) from a simple model: FLOPs per step (2 x params x tokens x calls, plus attention's
4 x layers x tokens^2 x hidden) at `device_tflops`, plus what crosses the links at `link_gbps` (split:
hidden states at each hop and offloaded weights streamed; CFG: one noise prediction; Ulysses: q, k, v and
out of every attention layer, 4 x (tokens/u) x hidden x bytes x (u-1)/u per rank).

Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.units import format_size, shorten

CHOICES = ("none", "cfg", "context", "cfg+context", "auto")
LAYOUTS = ("split", "cfg", "context", "cfg+context")
MAX_WORLD_SIZE = 1024
DEFAULT_DEVICE_TFLOPS = 100.0  # dense bf16 a GPU sustains in a denoiser step (an H100 peaks near 990)
DEFAULT_LINK_GBPS = 25.0  # GB/s between two GPUs (PCIe 4 x16; NVLink is 10-20x more)

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

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def settled(self) -> "ParallelRequest":
        """The request checked, one sentence each (UsageError), with its choice filled in."""
        size = self.world_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise UsageError(f"--world-size must be a whole number from 1 to {MAX_WORLD_SIZE}, not "
                             f"{shorten(size, quote=True)}.")
        choice = self.choice if self.choice is not None else ("none" if size == 1 else "auto")
        if choice not in CHOICES:
            raise UsageError(f"--parallel must be {', '.join(CHOICES[:-1])} or {CHOICES[-1]}, not "
                             f"{shorten(choice, quote=True)}.")
        if size == 1 and choice != "none":
            raise UsageError(f"--parallel {choice} needs --world-size 2 or more (one rank has nothing to share).")
        if size > 1 and choice == "none":
            raise UsageError(f"--world-size {size} with --parallel none would run one process: give --parallel "
                             "cfg, context, cfg+context or auto.")
        for flag, value in (("--device-tflops", self.device_tflops), ("--link-gbps", self.link_gbps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value <= 1e6:
                raise UsageError(f"{flag} must be a number above 0 (at most 1e6), not {shorten(value, quote=True)}.")
        return ParallelRequest(size, choice, float(self.device_tflops), float(self.link_gbps))


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
    if layout == "split":
        return f"device-map split over {world_size} GPUs" if world_size else "device-map split"
    if layout == "cfg":
        return "CFG-parallel (2 branches)"
    if layout == "context":
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


def candidates(request: ParallelRequest, guidance: Guidance, shape: DenoiserShape) -> tuple[list[Candidate], dict]:
    """The layouts to compare for `request` (settled): one for an explicit choice (UsageError when it cannot
    run), every runnable one and the split for auto; with the sentences refusing the others (auto)."""
    world, choice = request.world_size, request.choice
    wanted = {"cfg": ("cfg",), "context": ("context",), "cfg+context": ("cfg+context",),
              "auto": ("cfg", "context", "cfg+context")}[choice]
    found: list[Candidate] = [Candidate("split")] if choice == "auto" else []
    refused: dict[str, str] = {}
    for layout in wanted:
        cfg = 2 if layout != "context" else 1
        ulysses = world // cfg if layout != "cfg" else 1
        problem = None
        if cfg * ulysses != world or (layout == "cfg+context" and ulysses < 2):
            problem = (f"{layout_title(layout, cfg, max(ulysses, 2))} needs a world size of "
                       + ("2" if layout == "cfg" else "2 x the Ulysses degree (4, 6, 8, ...)") + f", not {world}.")
        problem = problem or (cfg_refusal(guidance) if cfg == 2 else None) or (
            context_refusal(shape, ulysses) if ulysses > 1 else None)
        if problem and choice != "auto":
            raise UsageError(problem)
        if problem:
            refused[layout] = problem
        else:
            found.append(Candidate(layout, cfg, ulysses))
    return found, refused


# --- what the family and the configs say (before any trace) ---------------------------------------


def guidance_branches(family, inputs, negative_prompt: str | None, settings: dict) -> Guidance:
    """The guidance branches of one step for these inputs: 2 under CFG on a doubled batch (GUIDANCE_BATCH with
    cfg_batch() == 2) or under separate true-CFG calls that actually run (Qwen-Image: true_cfg_scale > 1 and a
    negative prompt, as its pipeline decides); else 1, with the sentence that refuses CFG-parallel."""
    from dm_cli.families import GUIDANCE_BATCH, GUIDANCE_SEPARATE, Job

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
        job = Job("", negative_prompt, 0, 1, family.guidance_scale(inputs), inputs.height or 0, inputs.width or 0,
                  settings=tuple(sorted({**declared, **{k: v for k, v in settings.items() if v is not None}}.items())))
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
    from dm_cli.families import call_spec
    from dm_cli.families.calls import TensorSpec

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
                         numel * element_bytes // max(1, family.cfg_batch(inputs)))


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
    if shape.split_sequences == ("image",):  # self-attention over the video, cross-attention to the prompt
        pairs = shape.image_tokens * (shape.image_tokens + shape.text_tokens)
    else:  # joint attention over both
        pairs = tokens * tokens
    per_sample = 2 * params * tokens + 4 * shape.layers * pairs * shape.hidden
    return float(per_sample * shape.batch * shape.calls)


def step_seconds(cand: Candidate, shape: DenoiserShape, guidance: Guidance, load: DenoiserLoad,
                 request: ParallelRequest) -> float:
    """The predicted seconds of one denoising step for this layout (see the module's doc)."""
    flops, link = step_flops(shape, load.params), request.link_gbps * 1e9
    compute = flops / (request.device_tflops * 1e12)
    if cand.layout == "split":
        hidden_bytes = (shape.image_tokens + shape.text_tokens) * shape.hidden * shape.element_bytes * shape.batch
        moved = load.hops * hidden_bytes * shape.calls + load.offloaded_bytes * shape.calls
        return compute + moved / link
    seconds = compute / (cand.cfg * cand.ulysses)
    batch, calls = _per_rank_batch_calls(shape, guidance, cand.cfg)
    if cand.ulysses > 1:
        u = cand.ulysses
        per_layer = 4 * (shape.split_tokens / u) * shape.hidden * shape.element_bytes * (u - 1) / u
        seconds += per_layer * shape.layers * batch * calls / link
    if cand.cfg > 1:
        seconds += shape.prediction_bytes / link
    return seconds


# --- the choice ---------------------------------------------------------------------------------


@dataclass
class ParallelLayout:
    """The layout a plan records (`parallel` in the plan JSON, docs/CONTRACTS.md)."""

    world_size: int
    layout: str
    cfg: int
    ulysses: int
    ring: int = 1
    per_rank_peak_bytes: dict[str, int] = field(default_factory=dict)  # rank -> peak on its GPU
    predicted_step_s: dict[str, float] = field(default_factory=dict)  # candidate -> seconds per step
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why not
    reason: str = ""
    experts: str = "together"  # Wan 2.2's experts on each rank: "together" or "one at a time"
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    link_gbps: float = DEFAULT_LINK_GBPS

    @property
    def title(self) -> str:
        return layout_title(self.layout, self.cfg, self.ulysses, self.world_size)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "layout": self.layout, "cfg": self.cfg, "ulysses": self.ulysses,
                "ring": self.ring, "per_rank_peak_bytes": dict(self.per_rank_peak_bytes),
                "predicted_step_s": dict(self.predicted_step_s), "rejected": dict(self.rejected),
                "reason": self.reason, "experts": self.experts, "device_tflops": self.device_tflops,
                "link_gbps": self.link_gbps}

    @classmethod
    def from_json(cls, data) -> "ParallelLayout":
        """A plan file's `parallel`, every field checked (ValueError, one sentence: plan files are hostile)."""
        if not isinstance(data, dict):
            raise ValueError("'parallel' must be a JSON object")
        world = _whole(data.get("world_size"), "'parallel' world_size", 2, MAX_WORLD_SIZE)
        layout = data.get("layout")
        if layout not in LAYOUTS:
            raise ValueError(f"'parallel' layout must be {', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}, found "
                             f"{shorten(layout, quote=True)}")
        cfg = _whole(data.get("cfg"), "'parallel' cfg", 1, 2)
        ulysses = _whole(data.get("ulysses"), "'parallel' ulysses", 1, MAX_WORLD_SIZE)
        ring = _whole(data.get("ring", 1), "'parallel' ring", 1, 1)
        expected = {"split": (1, 1), "cfg": (2, 1), "context": (1, world), "cfg+context": (2, world // 2)}[layout]
        if (cfg, ulysses) != expected or (layout != "split" and cfg * ulysses * ring != world) or (
                layout == "cfg+context" and ulysses < 2):
            raise ValueError(f"'parallel' {layout} with cfg {cfg} x ulysses {ulysses} x ring {ring} does not make "
                             f"world_size {world}")
        peaks = _mapping(data.get("per_rank_peak_bytes"), "'parallel' per_rank_peak_bytes")
        if sorted(peaks, key=lambda k: (len(k), k)) != [str(r) for r in range(world)]:
            raise ValueError(f"'parallel' per_rank_peak_bytes must name ranks 0 to {world - 1}")
        times = _mapping(data.get("predicted_step_s", {}), "'parallel' predicted_step_s")
        rejected = _mapping(data.get("rejected", {}), "'parallel' rejected")
        if not set(times) | set(rejected) <= set(LAYOUTS):
            raise ValueError("'parallel' predicted_step_s and rejected may only name layouts")
        experts = data.get("experts", "together")
        if experts not in ("together", "one at a time"):
            raise ValueError("'parallel' experts must be \"together\" or \"one at a time\"")
        return cls(world, layout, cfg, ulysses, ring,
                   {k: _whole(v, f"'parallel' rank {k} peak", 0, 2**60) for k, v in peaks.items()},
                   {k: _number(v, f"'parallel' predicted_step_s {k}") for k, v in times.items()},
                   {k: _string(v, f"'parallel' rejected {k}") for k, v in rejected.items()},
                   _string(data.get("reason", ""), "'parallel' reason"), experts,
                   _number(data.get("device_tflops", DEFAULT_DEVICE_TFLOPS), "'parallel' device_tflops", positive=True),
                   _number(data.get("link_gbps", DEFAULT_LINK_GBPS), "'parallel' link_gbps", positive=True))


def choose_layout(request: ParallelRequest, guidance: Guidance, shape: DenoiserShape, load: DenoiserLoad,
                  ranks: list[Rank]) -> ParallelLayout:
    """The fastest layout that fits (auto) or the one asked for; DoesNotFitError when the one asked for (or,
    for auto, every parallel one and the split) does not fit on some rank."""
    found, rejected = candidates(request, guidance, shape)
    times = {"split": round(step_seconds(Candidate("split"), shape, guidance, load, request), 4)}  # the comparison
    fitting: list[tuple[float, Candidate, dict, bool]] = []
    for cand in found:
        times[cand.layout] = round(step_seconds(cand, shape, guidance, load, request), 4)
        if cand.layout == "split":
            peaks = {str(i): int(load.split_peaks.get(rank.gpu, 0)) for i, rank in enumerate(ranks)}
            fitting.append((times["split"], cand, peaks, True))
            continue
        peaks, together, short = {}, True, []
        for i, rank in enumerate(ranks):
            denoise, alone = rank_denoise_peak(cand, shape, guidance, load, rank)
            together = together and alone
            peaks[str(i)] = max(denoise, rank.other_peak)
            if denoise > rank.capacity:
                short.append(f"GPU {rank.gpu} needs {format_size(denoise)} of {format_size(rank.capacity)}")
        if short:
            rejected[cand.layout] = (f"{cand.title} does not fit: the whole denoiser on every rank "
                                     f"({format_size(max(load.weights))} of weights per expert) plus its activations; "
                                     + "; ".join(short[:3]) + ".")
            if request.choice != "auto":
                raise DoesNotFitError(rejected[cand.layout], {"per_rank": peaks})
            continue
        fitting.append((times[cand.layout], cand, peaks, together))
    best_time, best, peaks, together = min(fitting, key=lambda item: item[0])
    layout = ParallelLayout(request.world_size, best.layout, best.cfg, best.ulysses, 1, peaks, times, rejected,
                            experts="together" if together else "one at a time",
                            device_tflops=request.device_tflops, link_gbps=request.link_gbps)
    layout.reason = _reason(layout, best_time, times, request)
    return layout


def _reason(layout: ParallelLayout, best: float, times: dict[str, float], request: ParallelRequest) -> str:
    """One line: what was chosen, its predicted step against the split's, and the largest rank's peak."""
    how = "as asked" if request.choice != "auto" else "the fastest layout that fits"
    against = f" against {times['split']:.3g} s/step split" if "split" in times and layout.layout != "split" else ""
    others = [f"{k} {v:.3g} s" for k, v in times.items() if k not in (layout.layout, "split")]
    if others:
        against += f" ({', '.join(others)})"
    peak = max(layout.per_rank_peak_bytes.values(), default=0)
    return (f"{layout.title}, {how}: predicted {best:.3g} s/step{against}; fits with {format_size(peak)} "
            f"per rank at most")


# --- checks of a plan file's values -------------------------------------------------------------


def _whole(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be a whole number from {low} to {high}, found {shorten(value, quote=True)}")
    return value


def _number(value, what: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or value > 1e12 or (positive and value == 0):
        raise ValueError(f"{what} must be a finite number {'above' if positive else 'from'} 0, found "
                         f"{shorten(value, quote=True)}")
    return float(value)


def _string(value, what: str) -> str:
    if not isinstance(value, str) or len(value) > 10_000:
        raise ValueError(f"{what} must be a string (at most 10,000 characters)")
    return value


def _mapping(value, what: str) -> dict:
    if not isinstance(value, dict) or len(value) > MAX_WORLD_SIZE:
        raise ValueError(f"{what} must be a JSON object (at most {MAX_WORLD_SIZE} entries)")
    return value

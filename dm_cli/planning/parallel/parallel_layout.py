"""The layout a plan records for --world-size (ParallelLayout: the plan JSON's `parallel`, checked when read) and
its choice among the candidates `parallel.py` lists, by memory per rank and predicted step time. Pure."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dm_cli.errors import DoesNotFitError, UsageError
from dm_cli.planning.modes import Layout, Parallel
from dm_cli.planning.parallel.parallel import (
    DEFAULT_DEVICE_TFLOPS,
    DEFAULT_LINK_GBPS,
    MAX_IN_FLIGHT,
    MAX_WORLD_SIZE,
    SPEEDUP_BASIS,
    Candidate,
    DenoiserLoad,
    DenoiserShape,
    Guidance,
    ParallelRequest,
    PipelineCut,
    Rank,
    candidates,
    layout_title,
    pipeline_rank_peak,
    pipeline_seconds,
    rank_denoise_peak,
    step_seconds,
)
from dm_cli.units import format_size, shorten


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
    # pipeline only (written only then): rank -> its block-list entries in execution order, the micro-batches planned
    # in flight, the predicted split / pipeline time per image for a queue of >= in_flight prompts, and its basis
    slices: dict[str, list[str]] = field(default_factory=dict)
    in_flight: int = 0
    predicted_speedup: float = 1.0
    speedup_basis: str = ""

    @property
    def title(self) -> str:
        return layout_title(self.layout, self.cfg, self.ulysses, self.world_size)

    def to_json(self) -> dict:
        pipeline = {"slices": {k: list(v) for k, v in self.slices.items()}, "in_flight": self.in_flight,
                    "predicted_speedup": self.predicted_speedup, "speedup_basis": self.speedup_basis}
        return {"world_size": self.world_size, "layout": self.layout, "cfg": self.cfg, "ulysses": self.ulysses,
                "ring": self.ring, "per_rank_peak_bytes": dict(self.per_rank_peak_bytes),
                "predicted_step_s": dict(self.predicted_step_s), "rejected": dict(self.rejected),
                "reason": self.reason, "experts": self.experts, "device_tflops": self.device_tflops,
                "link_gbps": self.link_gbps, **(pipeline if self.layout == Layout.PIPELINE else {})}

    @classmethod
    def from_json(cls, data) -> "ParallelLayout":
        """A plan file's `parallel`, every field checked (ValueError, one sentence: plan files are hostile)."""
        if not isinstance(data, dict):
            raise ValueError("'parallel' must be a JSON object")
        world = _whole(data.get("world_size"), "'parallel' world_size", 2, MAX_WORLD_SIZE)
        layout = data.get("layout")
        if layout not in Layout.words():
            raise ValueError(f"'parallel' layout must be {', '.join(Layout.words()[:-1])} or {Layout.PIPELINE}, found "
                             f"{shorten(layout, quote=True)}")
        cfg = _whole(data.get("cfg"), "'parallel' cfg", 1, 2)
        ulysses = _whole(data.get("ulysses"), "'parallel' ulysses", 1, MAX_WORLD_SIZE)
        ring = _whole(data.get("ring", 1), "'parallel' ring", 1, 1)
        expected = {"split": (1, 1), "cfg": (2, 1), "context": (1, world), "cfg+context": (2, world // 2),
                    "pipeline": (1, 1)}[layout]
        if (cfg, ulysses) != expected or (layout not in (Layout.SPLIT, Layout.PIPELINE) and cfg * ulysses * ring != world) or (
                layout == Layout.CFG_CONTEXT and ulysses < 2):
            raise ValueError(f"'parallel' {layout} with cfg {cfg} x ulysses {ulysses} x ring {ring} does not make "
                             f"world_size {world}")
        peaks = _mapping(data.get("per_rank_peak_bytes"), "'parallel' per_rank_peak_bytes")
        if sorted(peaks, key=lambda k: (len(k), k)) != [str(r) for r in range(world)]:
            raise ValueError(f"'parallel' per_rank_peak_bytes must name ranks 0 to {world - 1}")
        times = _mapping(data.get("predicted_step_s", {}), "'parallel' predicted_step_s")
        rejected = _mapping(data.get("rejected", {}), "'parallel' rejected")
        if not set(times) | set(rejected) <= set(Layout.words()):
            raise ValueError("'parallel' predicted_step_s and rejected may only name layouts")
        experts = data.get("experts", "together")
        if experts not in ("together", "one at a time"):
            raise ValueError("'parallel' experts must be \"together\" or \"one at a time\"")
        layout_of = cls(world, layout, cfg, ulysses, ring,
                        {k: _whole(v, f"'parallel' rank {k} peak", 0, 2**60) for k, v in peaks.items()},
                        {k: _number(v, f"'parallel' predicted_step_s {k}") for k, v in times.items()},
                        {k: _string(v, f"'parallel' rejected {k}") for k, v in rejected.items()},
                        _string(data.get("reason", ""), "'parallel' reason"), experts,
                        _number(data.get("device_tflops", DEFAULT_DEVICE_TFLOPS), "'parallel' device_tflops",
                                positive=True),
                        _number(data.get("link_gbps", DEFAULT_LINK_GBPS), "'parallel' link_gbps", positive=True))
        extra = [k for k in ("slices", "in_flight", "predicted_speedup", "speedup_basis") if k in data]
        if layout != Layout.PIPELINE:
            if extra:
                raise ValueError(f"'parallel' {extra[0]} belongs to the pipeline layout, not {layout}")
            return layout_of
        layout_of.slices = _slices(data.get("slices"), world)
        layout_of.in_flight = _whole(data.get("in_flight"), "'parallel' in_flight", 1, MAX_IN_FLIGHT)
        layout_of.predicted_speedup = _number(data.get("predicted_speedup", 1.0), "'parallel' predicted_speedup",
                                              positive=True)
        layout_of.speedup_basis = _string(data.get("speedup_basis", ""), "'parallel' speedup_basis")
        return layout_of


# auto shares the steps only where that is predicted this much faster than the split (one process, no exchanges):
# on two CPU ranks the predictions of cfg and context were within 20% of the measured steps, and a layout predicted a
# few percent faster (context on the demo at 256x256: 1%) measured 21% slower
AUTO_MARGIN = 1.10


def figures(seconds: float) -> float:
    """Four significant figures: a tiny model's step keeps its digits (4 decimals made every layout 0.0001 s), and
    the prediction is not more precise than that."""
    return float(f"{seconds:.4g}")


def choose_layout(request: ParallelRequest, guidance: Guidance, shape: DenoiserShape, load: DenoiserLoad,
                  ranks: list[Rank], cut: "PipelineCut | str | None" = None) -> ParallelLayout:
    """The fastest layout that fits (auto) or the one asked for; DoesNotFitError when the one asked for (or,
    for auto, every parallel one and the split) does not fit on some rank. `cut`: the pipeline's (for pipeline
    and auto), or the sentence saying why the denoiser has none. Auto keeps a layout that shares every step
    (cfg, context) when one fits, else pipeline parallel when it fits, else the split."""
    found, rejected = candidates(request, guidance, shape)
    times = {"split": figures(step_seconds(Candidate("split"), shape, guidance, load, request))}  # the comparison
    fitting: list[tuple[float, Candidate, dict, bool]] = []
    piped = None
    for cand in found:
        if cand.layout == Layout.PIPELINE:
            piped = pipeline_candidate(request, shape, load.activation_peak, ranks, cut, rejected)
            if piped is not None:  # its speed-up over its own cut's split, on the basis the other layouts share (the
                # cut's per-slice FLOPs count the tokens each weight multiplies, step_seconds 2 x params x all tokens)
                times["pipeline"] = figures(times["split"] * piped[1] / piped[2] if piped[2] else piped[1])
            continue
        times[cand.layout] = figures(step_seconds(cand, shape, guidance, load, request))
        if cand.layout == Layout.SPLIT:
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
            if request.choice != Parallel.AUTO:
                raise DoesNotFitError(rejected[cand.layout], {"per_rank": peaks})
            continue
        fitting.append((times[cand.layout], cand, peaks, together))
    sharing = [item for item in fitting if item[1].layout != Layout.SPLIT]
    if piped is not None and not sharing:
        return _pipeline_layout(request, piped, times, rejected)
    if piped is not None:
        rejected["pipeline"] = (f"pipeline parallel fits too (predicted {piped[3]:.2f}x the split's images per second "
                                f"for a queue of {piped[4]} prompts or more), but auto keeps to layouts that share "
                                f"every step when one fits ({', '.join(item[1].layout for item in sharing)} does here): "
                                "they speed up one prompt as well.")
    fastest = min(fitting, key=lambda item: item[0])
    split = next((item for item in fitting if item[1].layout == Layout.SPLIT), None)
    close = request.choice == Parallel.AUTO and split is not None and fastest[0] * AUTO_MARGIN > split[0]
    best_time, best, peaks, together = split if close else fastest  # within the prediction's error: the split
    layout = ParallelLayout(request.world_size, best.layout, best.cfg, best.ulysses, 1, peaks, times, rejected,
                            experts="together" if together else "one at a time",
                            device_tflops=request.device_tflops, link_gbps=request.link_gbps)
    layout.reason = _reason(layout, best_time, times, request)
    if close and fastest is not split:
        layout.reason = (f"{layout.title}, kept by auto: {fastest[1].title} is predicted at {fastest[0]:.3g} s/step, "
                         f"less than {AUTO_MARGIN - 1:.0%} faster than the split's {best_time:.3g} (within the "
                         f"prediction's error, not worth its exchanges); fits with "
                         f"{format_size(max(peaks.values(), default=0))} per rank at most")
    return layout


def pipeline_candidate(request: ParallelRequest, shape: DenoiserShape, activation_peak: int, ranks: list[Rank],
                       cut: "PipelineCut | str | None", rejected: dict):
    """(cut, seconds per image-step, the cut's split seconds per step, speed-up, the queue it needs (prompts), per-rank
    peaks) of the
    pipeline layout, or None with the sentence in `rejected` (auto); UsageError or DoesNotFitError when asked for."""
    if not isinstance(cut, PipelineCut):
        problem = cut or "pipeline parallel found no cut of the denoiser for these ranks."
        if request.choice == Parallel.PIPELINE:
            raise UsageError(problem)
        rejected["pipeline"] = problem
        return None
    in_flight = request.planned_in_flight
    buffers = shape.buffer_bytes(in_flight)
    peaks, short = {}, []
    for i, rank in enumerate(ranks):
        denoise = pipeline_rank_peak(cut, i, activation_peak, shape, in_flight, rank.overhead)
        peaks[str(i)] = max(denoise, rank.other_peak)
        if denoise > rank.capacity:
            short.append((i, rank, denoise))
    if short:
        i, rank, denoise = short[0]
        more = f" (and {len(short) - 1} more rank(s))" if len(short) > 1 else ""
        problem = (f"pipeline parallel does not fit: rank {i} needs {format_size(denoise)} of GPU {rank.gpu}'s "
                   f"{format_size(rank.capacity)}{more}, for its slice of {format_size(cut.slice_bytes[i])}, "
                   f"{format_size(cut.shared_bytes)} of modules outside the block lists, "
                   f"{format_size(activation_peak)} of activations, {format_size(buffers)} of send and receive "
                   f"buffers for {in_flight} micro-batches in flight (--in-flight) and {format_size(rank.overhead)} of "
                   "overhead; use more ranks, fewer micro-batches in flight or a smaller size.")
        if request.choice == Parallel.PIPELINE:
            raise DoesNotFitError(problem, {"per_rank": peaks})
        rejected["pipeline"] = problem
        return None
    split, piped = pipeline_seconds(cut, shape, request, in_flight)
    return cut, piped, split, round(split / piped, 3) if piped else 1.0, min(in_flight, len(ranks)), peaks


def _pipeline_layout(request: ParallelRequest, piped, times: dict, rejected: dict) -> ParallelLayout:
    """The pipeline layout's record; its `split` time is the cut's (the device map the plan then has)."""
    cut, seconds, split, speedup, queue, peaks = piped
    times["split"], times["pipeline"] = figures(split), figures(seconds)
    layout = ParallelLayout(request.world_size, "pipeline", 1, 1, 1, peaks, times, rejected,
                            device_tflops=request.device_tflops, link_gbps=request.link_gbps,
                            slices={str(r): list(names) for r, names in enumerate(cut.slices)},
                            in_flight=request.planned_in_flight, predicted_speedup=speedup, speedup_basis=SPEEDUP_BASIS)
    how = "as asked" if request.choice != Parallel.AUTO else "as no layout that shares every step fits"
    layout.reason = (f"{layout.title}, {how}: predicted {speedup:.2f}x the split's images per second for a queue of "
                     f"{queue} prompts or more ({seconds:.3g} s per image-step against {split:.3g} s/step for the "
                     "same cut run in one process; one prompt alone runs at the split's speed, or its two CFG calls "
                     f"per step as two micro-batches); fits with {format_size(max(peaks.values(), default=0))} per rank "
                     "at most")
    return layout


def _reason(layout: ParallelLayout, best: float, times: dict[str, float], request: ParallelRequest) -> str:
    """One line: what was chosen, its predicted step against the split's, and the largest rank's peak."""
    how = "as asked" if request.choice != Parallel.AUTO else "the fastest layout that fits"
    against = f" against {times['split']:.3g} s/step split" if Layout.SPLIT in times and layout.layout != Layout.SPLIT else ""
    others = [f"{k} {v:.3g} s" for k, v in times.items() if k not in (layout.layout, "split", "pipeline")]
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


def _slices(value, world: int) -> dict[str, list[str]]:
    """The pipeline's slices: ranks 0 to world - 1, each a non-empty list of module names, none named twice."""
    value = _mapping(value, "'parallel' slices")
    if sorted(value, key=lambda k: (len(k), k)) != [str(r) for r in range(world)]:
        raise ValueError(f"'parallel' slices must name ranks 0 to {world - 1}")
    seen: set[str] = set()
    out = {}
    for rank in sorted(value, key=int):
        names = value[rank]
        if not isinstance(names, list) or not names or len(names) > 100_000 or not all(
                isinstance(n, str) and _MODULE.match(n) for n in names):
            raise ValueError(f"'parallel' slice {rank} must be a non-empty list of module names")
        if seen & set(names) or len(set(names)) != len(names):
            raise ValueError(f"'parallel' slices name a block twice (slice {rank})")
        seen.update(names)
        out[rank] = list(names)
    return out


_MODULE = re.compile(r"^[\w-]+(?:\.[\w-]+)*$")


def _mapping(value, what: str) -> dict:
    if not isinstance(value, dict) or len(value) > MAX_WORLD_SIZE:
        raise ValueError(f"{what} must be a JSON object (at most {MAX_WORLD_SIZE} entries)")
    return value

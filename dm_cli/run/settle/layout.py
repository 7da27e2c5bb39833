"""How this launch's torchrun ranks share each denoising step, decided once while the run is settled
(dm_cli.run.settle.settle): --parallel or the plan file's recorded layout, a queue's default, the refusals (one
sentence each), and the CPU ranks that stand in for a plan's GPUs. The loops that run a layout read the decision
(`SettledRun.sharing`, `SettledRun.loop`); they are dm_cli.run.ranks.parallel and dm_cli.run.ranks.pipeline."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dm_cli.devices import device_key, is_gpu
from dm_cli.errors import UsageError
from dm_cli.planning.modes import Layout, Parallel
from dm_cli.planning.parallel.parallel import (
    PIPELINE_CLASSES,
    ParallelRequest,
    candidates,
    denoiser_shape,
    guidance_branches,
    layout_title,
)
from dm_cli.run.distributed import Ranks
from dm_cli.run.request import parallel_choice, run_inputs, visible_gpus

if TYPE_CHECKING:  # the core nouns, for annotations only
    from dm_cli.planning.plan_file import Plan

# a block of a block list in a device map ("transformer_blocks.3"): what pipeline parallel cuts
BLOCK_KEY = re.compile(r"(?P<list>[A-Za-z_][\w.]*)\.(?P<index>[0-9]+)")
LAUNCH = ("launch it with torchrun --nproc-per-node N (N = 2 for cfg, the Ulysses degree for context, the plan's GPUs "
          "for pipeline)")


@dataclass(frozen=True)
class StepSharing:
    """How this torchrun launch shares each denoising step: layout, degrees, and where this rank stands."""

    layout: Layout  # cfg, context, cfg+context or pipeline (dm_cli.run.ranks.pipeline)
    cfg: int
    ulysses: int
    ranks: Ranks
    guidance: str = ""  # "batch" or "separate" (cfg): how the pipeline runs its two branches

    def __post_init__(self) -> None:
        """The layout as its member, whoever made the sharing (a candidate's word, a test's)."""
        object.__setattr__(self, "layout", Layout(self.layout))

    @property
    def branch(self) -> int:
        """The CFG branch this rank computes (0: the first half or the first call; 1: the other)."""
        return self.ranks.rank // self.ulysses if self.cfg == 2 else 0

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main

    def describe(self) -> str:
        if self.layout == Layout.PIPELINE:
            return f"pipeline parallel: one slice of the denoiser on each of {self.ranks.world_size} torchrun ranks"
        return f"{layout_title(self.layout, self.cfg, self.ulysses)} over {self.ranks.world_size} torchrun ranks"


@dataclass(frozen=True)
class Slices:
    """Rank r's block keys (`transformer_blocks.3`), in execution order, and how many prompts may be in flight."""

    blocks: tuple[tuple[str, ...], ...]
    in_flight: int

    @property
    def world_size(self) -> int:
        return len(self.blocks)

    @property
    def every_block(self) -> tuple[str, ...]:
        return tuple(key for part in self.blocks for key in part)


def plan_slices(plan, denoiser: str, world_size: int) -> Slices:
    """The slices of the plan's split: rank r holds the denoiser's blocks the plan puts on GPU r. Refused (one
    sentence) unless the blocks are cut into `world_size` contiguous, non-empty runs on GPUs 0 .. N - 1."""
    device_map = plan.components[denoiser].device_map
    blocks = [(key, device_key(dev)) for key, dev in device_map.items() if BLOCK_KEY.fullmatch(key)]
    how = (f"plan it with dmap plan --world-size {world_size} --parallel pipeline (and the same --max-memory), then "
           "run that plan with -d")
    if not blocks:
        raise UsageError(f"The plan puts {denoiser} on its devices whole, not block by block, so there is nothing to "
                         f"cut into {world_size} slices: {how}.")
    owners = [dev for _, dev in blocks]
    if any(not (is_gpu(dev) and isinstance(dev, int) and dev < world_size) for dev in owners):
        where = sorted({str(dev) for dev in owners}, key=str)
        raise UsageError(f"--parallel pipeline gives rank r the blocks the plan puts on GPU r, and this plan puts "
                         f"{denoiser}'s blocks on {', '.join(where)} for {world_size} ranks: {how}.")
    if owners != sorted(owners) or set(owners) != set(range(world_size)):
        raise UsageError(f"The plan does not cut {denoiser}'s blocks into {world_size} runs, one per GPU 0 to "
                         f"{world_size - 1} in order: {how}.")
    parts = tuple(tuple(key for key, dev in blocks if dev == rank) for rank in range(world_size))
    recorded = getattr(getattr(plan, "parallel", None), "in_flight", None)
    return Slices(parts, recorded or ParallelRequest(world_size, Layout.PIPELINE).planned_in_flight)  # the planner's default


def pipeline_refusal(family, generation, plan, world_size: int) -> str | None:
    """Why this run cannot be pipelined (None: it can)."""
    if world_size < 2:
        return ("--parallel pipeline cuts the denoiser among torchrun ranks and this is one process: launch it with "
                "torchrun --nproc-per-node N (N = the plan's GPUs).")
    denoiser = plan.components[family.denoiser].cls if plan is not None else None
    if denoiser is not None and denoiser not in PIPELINE_CLASSES:
        return (f"--parallel pipeline cuts the denoisers whose blocks pass their whole state from one to the next "
                f"({', '.join(PIPELINE_CLASSES)}), not {denoiser}: for one prompt use --parallel cfg or context; for a queue drop --parallel (the ranks then share the prompts).")
    return None


def step_sharing(choice: Parallel | str | None, plan, source, family, generation,
                 ranks: Ranks | None = None) -> tuple[StepSharing | None, tuple[str, ...]]:
    """The sharing this run uses and what to tell the user of it: `choice` (--parallel; None: follow the plan file's
    `parallel` when torchrun started as many ranks as it records), or None for one process per image; `source`,
    `family` and the settled `generation` are the run's (dm_cli.run.settle.settle). Refusals are one sentence; a pipeline's
    (`checked_pipeline`) are settle's, once, when the plan it reads is known."""
    ranks = ranks or Ranks.from_env()
    recorded = getattr(plan, "parallel", None)
    if choice is None and recorded is not None and recorded.layout != Layout.SPLIT:
        if ranks.world_size == 1:
            return None, (f"The plan shares each step over {recorded.world_size} torchrun ranks ({recorded.title}); "
                          "this is one process, so it runs the single-process placement: launch with torchrun "
                          f"--nproc-per-node {recorded.world_size} to share.",)
        check_rank_count(recorded, ranks)
        choice = Layout(recorded.layout).choice
    choice = parallel_choice(choice)
    if choice in (None, Parallel.NONE):
        return None, ()
    if choice is Parallel.PIPELINE:
        return StepSharing(Layout.PIPELINE, 1, 1, ranks), ()
    if ranks.world_size == 1:
        raise UsageError(f"--parallel {choice} shares each step among torchrun ranks and this is one process: {LAUNCH}.")
    layout, guidance = _layout(choice, ranks.world_size, source, family, generation)
    sharing = StepSharing(layout.layout, layout.cfg, layout.ulysses, ranks, guidance.kind)
    return sharing, (f"Each denoising step is shared: {sharing.describe()}; rank 0 encodes, decodes and writes the "
                     "outputs.",)


def check_rank_count(recorded, ranks: Ranks) -> None:
    """A plan's recorded sharing (`plan.parallel`) followed under torchrun needs the ranks it records: another count
    is refused in one sentence (one run or a queue alike; one plain process runs the single-process placement)."""
    if ranks.distributed and ranks.world_size != recorded.world_size:
        raise UsageError(f"The plan shares each step over {recorded.world_size} ranks ({recorded.title}) but "
                         f"torchrun started {ranks.world_size}: launch with --nproc-per-node "
                         f"{recorded.world_size}, or give --parallel none.")


def pipelined(choice: str | None, plan, ranks: Ranks | None = None) -> bool:
    """Whether this launch runs the pipeline: --parallel pipeline, or a plan file's pipeline layout followed under
    torchrun with as many ranks as it records."""
    ranks = ranks or Ranks.from_env()
    recorded = getattr(plan, "parallel", None)
    return choice == Parallel.PIPELINE or (choice is None and recorded is not None and recorded.layout == Layout.PIPELINE
                                    and ranks.world_size == recorded.world_size)


def shares_steps(choice: str | None, plan, ranks: Ranks) -> bool:
    """Whether this launch's ranks share each image's steps: a --parallel layout other than none, or a plan file's
    recorded sharing followed with as many ranks as it records."""
    recorded = getattr(plan, "parallel", None)
    if choice in (None, Parallel.AUTO):  # the plan's choice
        return recorded is not None and recorded.layout != Layout.SPLIT and ranks.world_size == recorded.world_size
    return choice != Parallel.NONE and choice in Parallel.words()


def cpu_ranks(choice: str | None, plan) -> int:
    """GPUs 0 .. N - 1 of a plan that N torchrun ranks without a GPU stand in for, each on its CPU (0: none): the
    ranks of a pipeline, or of cfg / context parallel (the denoiser whole on each rank's CPU, as on each GPU)."""
    ranks = Ranks.from_env()
    if ranks.world_size < 2 or not shares_steps(choice, plan, ranks):
        return 0

    return ranks.world_size if visible_gpus() == 0 else 0


def checked_pipeline(plan, family, generation, ranks: Ranks) -> tuple[StepSharing, tuple[str, ...]]:
    """Pipeline parallel (dm_cli.run.ranks.pipeline): refused in one sentence unless the plan cuts the denoiser into one
    slice per rank (`plan` None: a plan still to be made, what can be known without it); and what to tell the user."""
    problem = pipeline_refusal(family, generation, plan, ranks.world_size)
    if problem:
        raise UsageError(problem)
    sharing = StepSharing(Layout.PIPELINE, 1, 1, ranks)
    if plan is None:
        return sharing, ()
    slices = plan_slices(plan, family.denoiser, ranks.world_size)
    return sharing, (f"The denoiser is cut into {ranks.world_size} slices ({sharing.describe()}), up to "
                     f"{slices.in_flight} prompts in flight; rank 0 encodes, decodes and writes the outputs.",)


def _layout(choice: str, world_size: int, source, family, generation):
    """(candidate, guidance) for `choice` on this SOURCE and generation; auto prefers cfg+context, then cfg
    (one exchange per step), then context."""
    inputs = run_inputs(generation)
    comp = next(c for c in source.components if c.name == family.denoiser)
    guidance = guidance_branches(family, inputs, generation.negative_prompt, dict(generation.settings))
    shape = denoiser_shape(comp, source.pipeline_class, inputs, family, 4)
    found, refused = candidates(ParallelRequest(world_size, choice).settled(), guidance, shape)
    order = (Layout.CFG_CONTEXT, Layout.CFG, Layout.CONTEXT)  # auto without a plan's memory model
    found = [c for c in found if c.layout in order]
    if not found:
        raise UsageError(f"--parallel auto finds no layout for {world_size} ranks: " + " ".join(refused.values()))
    return min(found, key=lambda c: order.index(c.layout)), guidance


def queue_parallel(plan: Plan | None, ranks) -> Parallel:
    """A queue's --parallel when none is given: "pipeline" when the plan file records a pipeline layout for as many
    torchrun ranks as this launch has (they then hold slices of one denoiser and every prompt passes through all of
    them), else "none" (each rank takes its own prompts; one process runs the plan's single-process placement). A
    pipeline plan under torchrun with another number of ranks is refused (one sentence, on every rank, before
    anything loads or joins), as for one prompt: its slices are cut for its own count."""
    recorded = getattr(plan, "parallel", None)
    if recorded is not None and recorded.layout == Layout.PIPELINE:
        check_rank_count(recorded, ranks)
    return Parallel.PIPELINE if plan is not None and pipelined(None, plan, ranks) else Parallel.NONE

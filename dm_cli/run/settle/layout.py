"""How this launch's torchrun ranks share each denoising step, decided once while the run is settled
(dm_cli.run.settle.settle): --parallel or the plan file's recorded layout, a queue's default, the refusals (one
sentence each), and the CPU ranks that stand in for a plan's GPUs. The loops that run a layout read the decision
(`SettledRun.sharing`, `SettledRun.loop`); they are dm_cli.run.ranks.parallel and dm_cli.run.ranks.pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dm_cli.errors import UsageError
from dm_cli.planning.modes import Layout, Parallel
from dm_cli.planning.parallel.parallel import ParallelRequest, candidates, denoiser_shape, guidance_branches
from dm_cli.run.distributed import Ranks
from dm_cli.run.ranks.parallel import StepSharing
from dm_cli.run.ranks.pipeline import pipeline_refusal, plan_slices
from dm_cli.run.request import parallel_choice, run_inputs, visible_gpus

if TYPE_CHECKING:  # the core nouns, for annotations only
    from dm_cli.planning.plan_file import Plan

LAUNCH = ("launch it with torchrun --nproc-per-node N (N = 2 for cfg, the Ulysses degree for context, the plan's GPUs "
          "for pipeline)")


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

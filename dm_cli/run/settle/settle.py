"""Settling a run: every check of `dmap run`, a queue, `dmap serve` and `dm_cli.load`, once, in one fixed order.

The split accelerate makes between `infer_auto_device_map` (it decides) and `dispatch_model` (it acts): `settle`
decides everything a run needs before anything loads (SOURCE, the plan file, read once, the generation, the plan,
how torchrun ranks share a step, which stage loop runs) and refuses what cannot run, each refusal one sentence; the
`Session` (dm_cli.run.sessions.session) takes the frozen `SettledRun` it returns and only acts on it. No function here or
there receives a half-built Session. As litgpt checks its options once in `__post_init__`, the checks happen here
and nowhere else; the run's own checks are plain functions beside this module (dm_cli.run.settle.checks:
`prepare`, `check_plan_matches`, `make_run_plan`, ...), the facts they compare in dm_cli.run.request, and the checks
of other wings' facts (`int8_offload_problem`, ...) stay beside those facts. How ranks share a step is decided in
dm_cli.run.settle.layout, with the records the rank loops read (`StepSharing`, `Slices`): settling imports no loop
(an import-linter contract), so the loops depend on the decision, not the other way round.

The order, the same for every entry (where two checks could fire, the earlier one speaks):

1. `check_options`: counts, the image size, --dtype (`dmap run`, before outputs, plans or SOURCE are touched);
2. `refuse_single_only`: options that only make sense for one prompt, with --prompts;
3. `check_run_request`: the seed, the outputs and the plan file (`dmap run --prompt`, before anything is loaded;
   the plan it reads is handed to `settle`, which does not read it again);
4. `settle`: --dtype, the plan file (read once), SOURCE, the devices of a given plan, the generation, the outputs
   as settled, the plan against the run, its step cache; how ranks share each step (a queue's and a server's defaults included);
   the weights' files; the tiled decode; the plan made here and its devices; int8 placements; a queue's videos.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dm_cli.errors import UsageError
from dm_cli.families import Job
from dm_cli.inputs import Generation, check_count
from dm_cli.io.atomic import check_writable_file
from dm_cli.io.images import check_image_output, image_paths
from dm_cli.io.video import names_folder
from dm_cli.model import models  # the module: tests patch its quiet_libraries
from dm_cli.model.formats.weight_formats import int8_offload_problem
from dm_cli.model.single_file_weights import component_files_metadata
from dm_cli.planning import plan_file as plan_files  # the module: tests count its load_plan's calls
from dm_cli.planning.make import launch_warning
from dm_cli.planning.modes import CompileMode, Layout, Mode, Parallel, Strategy, Word
from dm_cli.planning.placement.lora_sizing import lora_targets
from dm_cli.run.distributed import Ranks
from dm_cli.run.entry_checks import check_seed
from dm_cli.run.hooks.compile import compile_choice
from dm_cli.run.request import inputs_from_plan, plan_digest, prediction_at, run_inputs
from dm_cli.run.settle import checks  # the module: tests patch make_run_plan, count check_devices_present's calls
from dm_cli.run.settle.checks import (
    check_plan_cache,
    check_plan_matches,
    check_tiled_decode,
    prepare,
    refuse_existing_outputs,
    settle_generation,
    source_of_plan,
)
from dm_cli.run.settle.layout import checked_pipeline, cpu_ranks, queue_parallel, step_sharing
from dm_cli.units import parse_dtype

if TYPE_CHECKING:  # the core nouns, for annotations only: importing them here would cost start-up time
    from dm_cli.families import Family
    from dm_cli.model.sources import Source
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.request import RunRequest
    from dm_cli.run.settle.layout import StepSharing


class Entry(Word):
    """Who asked for the run: it decides the defaults that differ between them (a queue's and a server's --parallel)."""

    SINGLE = "single"  # dmap run --prompt (dm_cli.run.sessions.single)
    QUEUE = "queue"  # dmap run --prompts (dm_cli.run.sessions.queue_runner)
    SERVE = "serve"  # dmap serve
    API = "api"  # dm_cli.load


class Loop(Word):
    """Which stage loop runs the run: one process (resident or staged, as the plan's mode), ranks sharing each step
    (the layouts of dm_cli.run.ranks.parallel), or the denoiser cut among the ranks (dm_cli.run.ranks.pipeline)."""

    RESIDENT = "resident"
    STAGED = "staged"
    CFG = "cfg"
    CONTEXT = "context"
    CFG_CONTEXT = "cfg+context"
    PIPELINE = "pipeline"


@dataclass(frozen=True)
class SettledRun:
    """A run with everything decided and checked, nothing loaded: what a `Session` acts on."""

    request: RunRequest  # SOURCE resolved (a plan file's when none was given), --parallel as chosen
    entry: Entry
    source: Source
    family: Family
    demo: bool
    generation: Generation  # settled: every default filled in, its LoRAs' targets, the plan's step cache
    defaults: Job  # the job each prompt starts from
    plan: Plan  # the plan file's, the given one, or the one made here
    plan_digest: str
    planned_here: bool
    source_from_plan: bool  # SOURCE was taken from the plan (none given)
    where: str  # what messages call the plan
    sharing: StepSharing | None  # how torchrun ranks share each step; None: one process per image
    loop: Loop
    largest_shard: dict  # component -> its largest weights file's bytes
    notices: tuple[str, ...] = ()
    compile: CompileMode = CompileMode.NONE  # --compile as it runs (dm_cli.run.hooks.compile.compile_choice)

    @property
    def pipelined(self) -> bool:
        return self.loop is Loop.PIPELINE

    @property
    def staged(self) -> bool:
        """The plan loads stage by stage (not resident), whichever loop runs it."""
        return self.plan.mode != Mode.RESIDENT

    @property
    def is_main(self) -> bool:
        """This rank decodes and gets the images (every process when steps are not shared)."""
        return self.sharing is None or self.sharing.is_main

    @property
    def fps(self) -> int | None:
        return self.generation.video_fps


# --- 1-3: what `dmap run` refuses before it reads a request -------------------------------------------------


def check_options(dtype: str | None, *, steps, num_images, height, width, max_sequence_length, frames, fps) -> None:
    """What no run could use, refused before outputs, plans or SOURCE are touched: cheap, and the user hears of a
    typo before minutes of loading rather than after."""
    generation = Generation(steps=steps, num_images=num_images, height=height, width=width,  # the counts' bounds
                            max_sequence_length=max_sequence_length, num_frames=frames, fps=fps)
    if height and width:  # a size given in full: its pixels per call (inputs.MAX_PIXELS) before SOURCE is resolved
        generation.inputs()
    if dtype is not None:
        parse_dtype(dtype)


def refuse_single_only(*, num_images: int | None, save_latents: str | None, frames: int | None, fps: int | None,
                       settings: dict, track_activations: bool, parallel: Parallel | None) -> None:
    """Options that only make sense for one prompt, refused with --prompts rather than silently ignored (a queue's
    --parallel left unset is chosen by `settle`, from the plan file it reads)."""
    if num_images not in (None, 1):
        raise UsageError("--num-images is for one prompt: with --prompts, repeat a line with another seed instead.")
    if save_latents or frames or fps or "guidance_scale_2" in settings or track_activations:
        raise UsageError("--save-latents, --frames, --fps, --guidance-scale-2 and --track-activations are for one "
                         "prompt, not --prompts.")
    if parallel not in (None, Parallel.NONE, Parallel.PIPELINE):
        raise UsageError("--parallel shares one image's steps among the torchrun ranks; with --prompts the ranks "
                         "already share the queue (one prompt each at a time): drop --parallel, or give --parallel "
                         "pipeline to cut the denoiser among them.")


def check_run_request(output: str | None, save_latents: str | None, num_images: int | None, seed: int,
                      device_map: str) -> Plan | None:
    """Raise UsageError for anything about the outputs, seed or plan file that would fail later; returns the plan
    file, read (boundedly) here once, for `settle` (None: --device-map is a strategy)."""
    check_seed(seed, "--seed")
    if num_images is not None:  # inputs.LIMITS, before a name is made for each image
        check_count("num_images", num_images)
    images = image_paths(output, num_images or 1) if output else []
    if output and names_folder(output):  # a video's frames folder: its parent must take it (the writer checks the rest)
        parent = Path(output.rstrip("/" + os.sep)).parent
        if not parent.is_dir():
            raise UsageError(f"Cannot write --output {output}: folder {parent} does not exist.")
        targets = []
    elif output:  # the folder is the same for every image: checked once, then only the names that exist (one scan)
        check_image_output(output, len(images), videos=True)
        targets = [(path, "--output") for path in dict.fromkeys([images[0], *images.existing()])]
    else:
        targets = []
    if save_latents:
        targets.append((Path(save_latents), "--save-latents"))
    for path, option in targets:
        check_writable_file(path, option, "image.png")
    if save_latents and output and images.contains(save_latents):
        raise UsageError(f"--save-latents {save_latents} is also the --output file: give different names.")
    if device_map in Strategy.words():
        return None
    if not device_map.endswith(".json") and not os.path.lexists(device_map):
        raise UsageError(device_map_refusal(device_map))
    return plan_files.load_plan(device_map)  # a FIFO, /dev/zero or a broken plan: refused here, read boundedly


def device_map_refusal(device_map: str) -> str:
    return f"--device-map must be {', '.join(Strategy.words())} or a plan JSON file, not '{device_map}'."


# --- 4: the run ---------------------------------------------------------------------------------------------


def settle(request: RunRequest, plan: Plan | None = None, *, entry: Entry = Entry.API, on_plan: Callable | None = None,
           on_status: Callable[[str | None], None] | None = None) -> SettledRun:
    """Every check of the run, once, in the module's order; the plan made here when none is given.

    `plan`: a Plan to follow; with `request.plan_file` set, that file as `check_run_request` read it (it is not
    read again). `on_plan(plan)` when the plan is known and checked against this machine; `on_status(message)`:
    what is happening (hashing, importing, planning; None: nothing now)."""
    # before the libraries' first import: some of them warn while importing (torchvision fallbacks)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

    status = on_status or (lambda message: None)
    ranks = Ranks.from_env()
    request, plan, source_from_plan = _plan_file(request, plan)
    source, family, demo, defaults, notices = prepare(request, status)
    if request.plan_file is not None and plan is None:
        plan = _load_plan(request.plan_file)
    if entry is Entry.QUEUE and request.parallel is None:  # a queue's ranks take prompts, not steps
        request = replace(request, parallel=queue_parallel(plan, ranks))
    if entry is Entry.SERVE and request.parallel is None:  # a server's ranks run a session each, unless --parallel
        request = replace(request, parallel=Parallel.NONE)
    generation, job, plan = _generation(request, plan, source, family, defaults, source_from_plan)
    # torchrun ranks sharing each step (--parallel, or the plan file's `parallel`): refused (one sentence) before
    # anything is imported or planned
    sharing, shared = step_sharing(request.parallel, plan, source, family, generation, ranks)
    pipeline = sharing is not None and sharing.layout == Layout.PIPELINE
    # a pipeline's refusal (pipeline_refusal), once: here when what it reads is known (the plan given, or one
    # process, which no plan helps), else once the plan made here is known (its denoiser's class)
    if pipeline and (plan is not None or sharing.ranks.world_size < 2):
        sharing, shared = checked_pipeline(plan, family, generation, sharing.ranks)
    notices = [*notices, *shared]
    largest = _checked_weights(source, status)
    planned_here = plan is None
    plan = _final_plan(request, plan, source, family, generation, sharing, status, on_plan)
    if pipeline and planned_here:
        sharing, shared = checked_pipeline(plan, family, generation, sharing.ranks)
        notices += shared
    if entry is Entry.QUEUE and job.num_frames:
        raise UsageError(f"--prompts writes images; {source.pipeline_class} makes videos: run one prompt at a time.")
    compiled, eager = compile_choice(request.compile, request, plan, family, sharing)
    notices += [eager] if eager else []
    return SettledRun(request=request, entry=entry, source=source, family=family, demo=demo, generation=generation,
                      defaults=job, plan=plan,
                      plan_digest=plan_digest(plan), planned_here=planned_here, source_from_plan=source_from_plan,
                      where=_where(request), sharing=sharing, loop=_loop(plan, sharing), largest_shard=largest, notices=tuple(notices), compile=compiled)


def _plan_file(request: RunRequest, plan: Plan | None) -> tuple[RunRequest, Plan | None, bool]:
    """--dtype, then the plan file as a name; `dmap run -d PLAN.json` without SOURCE: the plan's source (None still
    means the demo without a plan), the plan file read first. (request, the plan if read, SOURCE taken from it)"""
    if request.placement.dtype is not None:
        parse_dtype(request.placement.dtype)
    plan_file = request.plan_file
    if plan is None and plan_file is not None and not (plan_file.endswith(".json") or Path(plan_file).is_file()):
        raise UsageError(device_map_refusal(plan_file))
    # the plan file is read once, before SOURCE only when SOURCE comes from it (else SOURCE's problems come first)
    source_from_plan = request.source is None and (plan is not None or plan_file is not None)
    if source_from_plan:
        plan = plan if plan is not None else _load_plan(plan_file)
        request = replace(request, source=source_of_plan(plan, plan_file))
    return request, plan, source_from_plan


def _load_plan(path: str) -> Plan:
    return plan_files.load_plan(path)


def _where(request: RunRequest) -> str:
    """What messages call the plan."""
    return request.plan_file or "The plan"


def _generation(request: RunRequest, plan: Plan | None, source: Source, family: Family, defaults: dict,
                source_from_plan: bool) -> tuple[Generation, Job, Plan | None]:
    """A given plan's devices (before anything is shown or torch is imported), then the generation settled with
    the plan's inputs as defaults (the plan is made for, and checked against, it), the outputs as settled, the plan
    against the run and its step cache: (generation, the job each prompt starts from, the plan as the run follows
    it)."""
    if plan is not None and not request.simulate:
        checks.check_devices_present(plan, cpu_ranks(request.parallel, plan))
    if plan is not None:  # a plan's inputs are the defaults: dmap plan X -o p.json && dmap run X -d p.json
        defaults = {**defaults, **inputs_from_plan(plan)}
    generation = settle_generation(request.generation, source, family, defaults, request.per_prompt_images)
    if generation.loras:  # each LoRA with the component it patches, as the planner settles them
        generation = replace(generation, loras=lora_targets(source, generation.loras))
    refuse_existing_outputs(request, family, generation.num_images)
    if plan is not None:
        where = _where(request)
        check_plan_matches(plan, source, run_inputs(generation), request.placement, where, generation.loras,
                           plan_file=request.plan_file, source_from_plan=source_from_plan)
        plan = check_plan_cache(plan, request.generation.cache, where, off=request.cache_off)
        generation = replace(generation, cache=plan.cache)
    return generation, Job.of(generation, request.prompt, request.seed), plan


def _final_plan(request: RunRequest, plan: Plan | None, source: Source, family: Family, generation: Generation,
                sharing: StepSharing | None, status, on_plan) -> Plan:
    """The libraries imported; a given plan's tiled decode checked, or the plan made here and its devices; shown
    (`on_plan`); int8 placements refused (unless simulated)."""

    status("Importing torch, diffusers and transformers…")
    models.quiet_libraries()
    planned_here = plan is None
    if planned_here:
        status(f"Planning {source.spec} (meta-device traces are cached after the first run)…")
        plan = checks.make_run_plan(source, request, generation, family, sharing)
    else:
        check_tiled_decode(plan, source, _where(request))
    status(None)
    if planned_here and not request.simulate:  # a plan made here: before it is shown
        checks.check_devices_present(plan, cpu_ranks(request.parallel, plan))
    # the prediction shown is the run's: its steps and prompts, whatever steps a plan file was made at
    plan = replace(plan, predicted_time=prediction_at(plan.predicted_time, generation.steps, request.queue),
                   warnings=_run_warnings(plan))
    if on_plan is not None:
        on_plan(plan)
    if not request.simulate:
        _refuse_int8_offload(plan)
    return plan


def _run_warnings(plan: Plan) -> list[str]:
    """The plan's warnings as this run shows them: a plan of several ranks run under torchrun with as many is
    launched as its warning asks (`launch_warning`), which is then left out, as for a plan made here."""
    layout = getattr(plan, "parallel", None)
    if layout is None or Ranks.from_env().world_size != layout.world_size:
        return list(plan.warnings)
    return [warning for warning in plan.warnings if warning != launch_warning(layout)]


def _checked_weights(source: Source, status) -> dict:
    """Missing or corrupt weights are bad input: said before importing the libraries or planning; the largest
    shard of each component (what its load may add to the host's peak). Single files are hashed for the
    outputs' metadata."""
    largest = checks.check_weight_files(source)
    if any(c.single_file is not None for c in source.components):  # their sha256 goes into the metadata
        status("Hashing the single files (sha256, for the outputs' metadata)…")
        component_files_metadata(source)
    return largest


def _refuse_int8_offload(plan: Plan) -> None:
    """int8 weights a plan offloads cannot run (weight_formats.int8_offload_problem): before anything loads, not
    when that component's stage comes."""
    for name, fmt in plan.weights.items():
        problem = int8_offload_problem(name, fmt, plan.components[name].device_map)
        if problem:
            raise UsageError(problem)


def _loop(plan: Plan, sharing: StepSharing | None) -> Loop:
    if sharing is not None:
        return Loop(sharing.layout)
    return Loop.RESIDENT if plan.mode == Mode.RESIDENT else Loop.STAGED

"""`dmap run --prompts FILE`: a queue of prompts through `dm_cli.load(...).generate(...)`.

This rank's share of the queue (all of it without torchrun) minus the items whose output is
already complete, generated stage-major in chunks; each image written atomically as soon as it is
decoded, with its manifest line appended; at the end rank 0 gathers every rank's records over the
gloo group and writes the merged `manifest.jsonl`. No Typer, no Rich: the CLI passes callbacks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from dm_cli.errors import UsageError
from dm_cli.io import outputs  # the module: tests patch its save_images
from dm_cli.io.outputs import is_complete
from dm_cli.model.lora import chosen_loras
from dm_cli.run.distributed import Ranks, broadcast, select_gpus
from dm_cli.run.loops.carry import RESULT_JSON_VERSION, stages_json
from dm_cli.run.request import RunRequest
from dm_cli.run.sessions.outputs import claim_queue_folder
from dm_cli.run.sessions.queue import (
    MANIFEST,
    QueueItem,
    append_record,
    items_for_rank,
    merge_records,
    previous_records,
    rank_manifest_name,
    read_prompts,
    remove_stale_temporaries,
    resume_keys,
    write_manifest,
)
from dm_cli.run.sessions.session import Session
from dm_cli.run.settle import settle as settling  # the module: tests patch its settle
from dm_cli.run.settle.settle import Entry
from dm_cli.units import parse_size


@dataclass
class QueueRequest:
    """`dmap run --prompts`: the run options, exactly as for one prompt (`run`; its prompt, seed, steps
    and negative prompt are each item's defaults, its output unused), plus the queue's own."""

    prompts: str
    run: RunRequest
    output_dir: str = "dmap-out"
    resume: bool = True
    chunk_size: int | None = None
    chunk_memory: str | None = None
    gpus_per_rank: int | None = None


@dataclass
class QueueResult:
    output_dir: str
    rank: int
    world_size: int
    items: int  # in the whole queue
    mine: int  # this rank's share
    generated: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # complete before this run
    redone: dict[int, str] = field(default_factory=dict)  # item -> why its existing file did not count
    chunk_size: int = 0
    bytes_per_item: int = 0
    chunk_budget: int = 0
    chunk_size_given: bool = False
    mode: str = ""
    plan_digest: str = ""
    manifest: str | None = None  # written by this process (rank 0)
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)
    stages: dict[str, dict] = field(default_factory=dict)  # stage -> loads, load_s, run_s, components (this rank)
    step_cache: dict = field(default_factory=dict)  # --cache: its label and calls computed/skipped (this rank)
    resume: bool = True  # complete items were skipped: running the same command again resumes

    def to_json(self) -> dict:
        """The queue's `--json`: its `stages` in the shape one prompt's run prints (dm_cli.run.loops.carry.stages_json)."""
        return {"version": RESULT_JSON_VERSION, **asdict(self),
                "stages": stages_json({"name": name, **totals} for name, totals in self.stages.items())}


@dataclass
class QueueEvents:
    """What the CLI shows; every callback optional."""

    on_plan: Callable | None = None
    on_start: Callable[[QueueResult], None] | None = None  # after resume detection and chunk sizing
    on_item: Callable[[QueueItem, str, float], None] | None = None  # item, file written, seconds
    on_step: Callable[[int, int], None] | None = None
    on_chunk: Callable[[int, int], None] | None = None
    on_status: Callable[[str | None], None] | None = None  # what is happening now (importing, planning, loading)


def run_queue(request: QueueRequest, events: QueueEvents | None = None) -> QueueResult:
    """Generate this rank's missing items and record them; rank 0 writes the merged manifest."""
    events = events or QueueEvents()
    ranks = Ranks.from_env()
    select_gpus(ranks, request.gpus_per_rank)  # before anything initialises CUDA
    items = read_prompts(request.prompts, request.run.seed, request.output_dir)  # names checked before anything loads
    if request.chunk_size is not None and request.chunk_size < 1:
        raise UsageError("--chunk-size must be at least 1.")
    budget = parse_size(request.chunk_memory) if request.chunk_memory else None
    folder = Path(request.output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"Cannot create the output folder {folder}: {error.strerror or error}.") from None

    started = time.perf_counter()
    # every check, the plan and the queue's --parallel (dm_cli.run.settle.settle), on every rank before anything joins
    # items choosing among the run's LoRAs keep them unfused, switched per item (dm_cli.run.sessions.queue)
    # the predicted time is for the whole queue
    run = replace(request.run, switch_loras=request.run.switch_loras or chooses_loras(items, request.run.generation.loras),
                  queue=max(1, len(items)))
    settled = settling.settle(run, entry=Entry.QUEUE, on_plan=events.on_plan, on_status=events.on_status)
    # a pipeline's ranks each hold a slice of one denoiser: every prompt passes through all of them (rank 0 writes)
    pipelined = settled.pipelined
    mine = items if pipelined else items_for_rank(items, ranks.rank, ranks.world_size)
    result = QueueResult(str(folder), ranks.rank, ranks.world_size, len(items), len(mine), resume=request.resume)
    with claim_queue_folder(folder, ranks.is_main):  # a second queue into this folder stops, naming this one
        ranks.join(_backend(pipelined))
        try:
            _run_share(request, settled, events, ranks, items, mine, folder, budget, result, started)
        finally:
            ranks.leave()
    return result


def _backend(pipelined: bool) -> str:
    """gloo for the queue's small objects; a pipeline on GPUs also sends tensors over NCCL."""
    if not pipelined:
        return "gloo"
    import torch  # lazy: torch (heavy, off start-up)

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _run_share(request, settled, events, ranks: Ranks, items, mine, folder: Path, budget, result: QueueResult,
               started: float) -> None:
    pipeline = Session(settled, on_status=events.on_status)
    result.notices = pipeline.notices  # the session's own list: what the run adds as it runs shows too (as single.py)
    result.mode, result.plan_digest = pipeline.plan.mode, pipeline.plan_digest
    todo: list[QueueItem] = []
    records: dict[int, dict] = {}
    jobs = {}
    matched = resume_keys()
    for item in mine:
        job = jobs[item.index] = pipeline.job_for(item)
        done, why = is_complete(folder / item.output, pipeline.metadata(job), matched) if request.resume \
            else (False, "--no-resume")
        if done:
            result.skipped.append(item.index)
            records[item.index] = _record(item, job, pipeline.plan_digest, None, ranks.rank, resumed=True)
            continue
        if why not in ("missing", "--no-resume"):
            result.redone[item.index] = why
        remove_stale_temporaries(folder, item)
        todo.append(item)
    result.chunk_size_given = request.chunk_size is not None
    size, result.bytes_per_item, result.chunk_budget = pipeline.chunk_size(len(todo), budget)
    result.chunk_size = request.chunk_size or size
    if pipeline.pipelined:  # every rank runs rank 0's list (its outputs, its resume), in rank 0's chunks
        todo, result.chunk_size = _as_on_main(ranks, todo, result.chunk_size, mine)
    if events.on_start is not None:
        events.on_start(result)
    manifest = folder / (MANIFEST if not ranks.distributed else rank_manifest_name(ranks.rank))

    by_index = {item.index: item for item in todo}
    try:
        for generated in pipeline.generate(todo, chunk_size=result.chunk_size, on_step=events.on_step,
                                           on_chunk=events.on_chunk):
            item = by_index[generated.index]
            if not pipeline.is_main:  # a pipeline's other ranks hold slices of the denoiser: rank 0 writes
                result.generated.append(item.index)
                continue
            path = folder / item.output
            outputs.save_images(generated.images[:1], str(path), generated.metadata)
            record = _record(item, jobs[item.index], pipeline.plan_digest, generated.seconds, ranks.rank)
            append_record(manifest, record)
            records[item.index] = record
            result.generated.append(item.index)
            if events.on_item is not None:
                events.on_item(item, str(path), generated.seconds)
    finally:
        pipeline.close()
        members = {s.name: list(s.components) for s in pipeline.plan.stages}
        result.stages = {name: {**totals, "components": members.get(name, [])}
                         for name, totals in pipeline.stage_totals.items()}
        result.step_cache = pipeline.step_cache_counts()
    gathered = ranks.gather(records if pipeline.is_main else {})  # a pipeline's rank 0 holds every record
    if ranks.is_main:
        merged: dict[int, dict] = {}
        for part in gathered:
            merged.update(part)
        result.manifest = str(write_manifest(folder, merge_records(items, merged, previous_records(folder))))
    result.seconds = time.perf_counter() - started


def chooses_loras(items: list[QueueItem], loaded: tuple) -> bool:
    """Whether some item chooses other adapters than the run's `--lora` set (another set, scale or order, or none):
    then the plan keeps them unfused, so that the run switches them between items (peft's set_adapters). A choice
    that names no loaded adapter counts too: the session refuses it in one sentence."""
    def key(loras) -> list:
        return [(lora.path, lora.component, lora.scale) for lora in loras]

    for item in items:
        if item.loras is None:
            continue
        try:
            if key(chosen_loras(loaded, item.loras, "")) != key(loaded):
                return True
        except UsageError:
            return True
    return False


def _as_on_main(ranks: Ranks, todo: list[QueueItem], chunk_size: int, mine: list[QueueItem]):
    """Rank 0's items to generate and chunk size, on every rank."""
    indices, size = broadcast(([item.index for item in todo], chunk_size), ranks)
    by_index = {item.index: item for item in mine}
    return [by_index[i] for i in indices], size


def _record(item: QueueItem, job, digest: str, seconds: float | None, rank: int, resumed: bool = False) -> dict:
    record = {"item": item.index, "prompt": item.prompt, "seed": item.seed, "file": item.output, "plan_digest": digest,
              "seconds": None if seconds is None else round(seconds, 4), "rank": rank, "steps": job.steps,
              "guidance_scale": job.guidance_scale}
    if job.negative_prompt:
        record["negative_prompt"] = job.negative_prompt
    if job.loras:  # the adapters it ran with, as a request or an item names them (NAME:SCALE)
        record["lora"] = [f"{lora.name}:{lora.scale:g}" for lora in job.loras]
    if resumed:
        record["resumed"] = True
    return record

"""Generate images: staged encode -> denoise -> decode across the devices of a plan (the demo without SOURCE).

With --prompts FILE, a whole queue: stage-major in chunks, resumable, spread over ranks under torchrun."""

from __future__ import annotations

from typing import Annotated

import typer

from dm_cli.cli._cli_utils import (
    BinaryOpt,
    CacheOpt,
    ComponentFileOpt,
    DtypeOpt,
    FpsOpt,
    FramesOpt,
    GpusPerRankOpt,
    GuidanceScaleOpt,
    HeightOpt,
    ImageOpt,
    JsonOpt,
    LastImageOpt,
    LoraOpt,
    MaxMemoryOpt,
    MaxSequenceLengthOpt,
    ModeOpt,
    NegativePromptOpt,
    OverheadOpt,
    OverwriteOpt,
    ParallelOpt,
    PipelineOpt,
    PromptOpt,
    QuietOpt,
    RunNumImagesOpt,
    RunOutputOpt,
    RunSeedOpt,
    RunSourceArg,
    SimulateOpt,
    StepsOpt,
    WeightsOpt,
    WidthOpt,
)

# the options only `dmap run` takes (the shared ones are in _cli_utils)
PromptsOpt = Annotated[str | None, typer.Option(
    "--prompts", help="A queue: a text file (one prompt a line) or JSONL (prompt, negative_prompt, "
                      "seed, steps, guidance_scale, output per line); item i gets seed --seed + i.")]
DeviceMapOpt = Annotated[str, typer.Option(
    "--device-map", "-d", help="auto | balanced | balanced_low_0 | sequential (plan now), or a plan JSON from dmap plan.")]
SaveLatentsOpt = Annotated[str | None, typer.Option(
    "--save-latents", help="Also write the final latents (safetensors).")]
TrackActivationsOpt = Annotated[bool, typer.Option(
    "--track-activations", help="Measure activations op by op on CPU (slower; default: the process's peak RSS).")]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume/--no-resume", help="--prompts: skip items whose PNG is complete and made for them (default), or redo all.")]
ChunkSizeOpt = Annotated[int | None, typer.Option(
    "--chunk-size", min=1, help="--prompts, staged: prompts per chunk (default: what --chunk-memory holds).")]
ChunkMemoryOpt = Annotated[str | None, typer.Option(
    "--chunk-memory", help="--prompts, staged: RAM for embeddings and latents waiting between "
                           "stages (default: 10% of available RAM).")]


def run(
    ctx: typer.Context,
    source: RunSourceArg = None,
    prompt: PromptOpt = None,
    prompts: PromptsOpt = None,
    negative_prompt: NegativePromptOpt = None,
    image: ImageOpt = None,
    last_image: LastImageOpt = None,
    device_map: DeviceMapOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    mode: ModeOpt = "auto",
    overhead: OverheadOpt = None,
    steps: StepsOpt = None,
    guidance_scale: GuidanceScaleOpt = None,
    seed: RunSeedOpt = 0,
    height: HeightOpt = None,
    width: WidthOpt = None,
    num_images: RunNumImagesOpt = None,
    max_sequence_length: MaxSequenceLengthOpt = None,
    frames: FramesOpt = None,
    fps: FpsOpt = None,
    output: RunOutputOpt = None,
    save_latents: SaveLatentsOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    simulate: SimulateOpt = False,
    overwrite: OverwriteOpt = False,
    track_activations: TrackActivationsOpt = False,
    resume: ResumeOpt = True,
    chunk_size: ChunkSizeOpt = None,
    chunk_memory: ChunkMemoryOpt = None,
    gpus_per_rank: GpusPerRankOpt = None,
    parallel: ParallelOpt = None,
    pipeline: PipelineOpt = None,
    component_file: ComponentFileOpt = None,
    lora: LoraOpt = None,
    cache: CacheOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    binary: BinaryOpt = False,
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
    _refuse_early(ctx, prompt, prompts, dtype, steps=steps, num_images=num_images, height=height, width=width,
                  max_sequence_length=max_sequence_length, frames=frames, fps=fps)
    # the RunRequest's fields but its output, which differs between one prompt and a queue
    fields = {
        "source": source, "prompt": prompt or "", "negative_prompt": negative_prompt, "device_map": device_map,
        "max_memory": max_memory, "overhead": overhead, "mode": mode, "steps": steps,
        "guidance_scale": guidance_scale, "seed": seed, "height": height, "width": width, "num_images": num_images,
        "max_sequence_length": max_sequence_length, "num_frames": frames, "fps": fps, "save_latents": save_latents,
        "dtype": dtype, "simulate": simulate, "overwrite": overwrite, "track_activations": track_activations,
        "weights": weights, "images": image or None, "last_image": last_image, "parallel": parallel, "pipeline": pipeline,
        "component_files": component_file or None, "loras": lora or None, "cache": cache,
        "settings": dict(settings or {}),
    }
    if prompts is not None:
        from dm_cli.run.queue_runner import QueueRequest

        _refuse_single_only(fields)
        queue = QueueRequest(prompts=prompts, run=_request(fields, output=None, per_prompt_images=True), output_dir=output or "dmap-out",
                             resume=resume and not overwrite, chunk_size=chunk_size, chunk_memory=chunk_memory,
                             gpus_per_rank=gpus_per_rank)
        return _run_queue(queue, as_json, quiet, binary)
    return _run_one(fields, output, gpus_per_rank, as_json, quiet, binary)


def _refuse_early(ctx, prompt, prompts, dtype, *, steps, num_images, height, width, max_sequence_length, frames,
                  fps) -> None:
    """What no run could use, refused before outputs, plans or SOURCE are touched: cheap, and the user
    hears of a typo before minutes of loading rather than after."""
    if (prompt is None) == (prompts is None):
        from dm_cli.cli._errors import usage_error

        which = "Missing option '--prompt'" if prompt is None else "Both --prompt and --prompts given"
        raise usage_error(f"{which}: give --prompt TEXT for one image or --prompts FILE for a queue.", ctx)
    from dm_cli.inputs import check_counts
    from dm_cli.units import parse_dtype

    # counts no run could use and an unknown (or empty) --dtype: refused before outputs, plans or SOURCE
    check_counts(steps=steps, num_images=num_images, height=height, width=width,
                 max_sequence_length=max_sequence_length, num_frames=frames, fps=fps)
    if height and width:  # a size given in full: its pixels per call (inputs.MAX_PIXELS) before SOURCE is resolved
        from dm_cli.inputs import InputSpec

        InputSpec(height, width, num_images=num_images or 1, num_frames=frames)
    if dtype is not None:
        parse_dtype(dtype)


def _request(fields: dict, output: str | None, per_prompt_images: bool = False):
    """The run options, one RunRequest for one prompt and for a queue alike (whose items may bring their images)."""
    from dm_cli.run.request import RunRequest

    return RunRequest.of(**fields, output=output, per_prompt_images=per_prompt_images)


def _refuse_single_only(fields: dict) -> None:
    """Options that only make sense for one prompt, refused with --prompts rather than silently ignored."""
    from dm_cli.errors import UsageError

    if fields["num_images"] not in (None, 1):
        raise UsageError("--num-images is for one prompt: with --prompts, repeat a line with another seed instead.")
    if (fields["save_latents"] or fields["num_frames"] or fields["fps"] or "guidance_scale_2" in fields["settings"]
            or fields["track_activations"]):
        raise UsageError("--save-latents, --frames, --fps, --guidance-scale-2 and --track-activations are for one "
                         "prompt, not --prompts.")
    if fields["parallel"] not in (None, "none", "pipeline"):
        raise UsageError("--parallel shares one image's steps among the torchrun ranks; with --prompts the ranks "
                         "already share the queue (one prompt each at a time): drop --parallel, or give --parallel "
                         "pipeline to cut the denoiser among them.")
    from dm_cli.run.queue_runner import queue_parallel

    # a queue's ranks take prompts, not steps: it follows a plan file's 'parallel' only when that is a pipeline
    fields["parallel"] = fields["parallel"] or queue_parallel(fields["device_map"])


def _run_one(fields: dict, output: str | None, gpus_per_rank: int | None, as_json: bool, quiet: bool,
             binary: bool) -> int:
    """One prompt: the GPUs of this rank chosen and the outputs checked before anything is loaded, then
    the run, printed as JSON or drawn live by the renderer."""
    if gpus_per_rank is not None:
        from dm_cli.run.distributed import Ranks, select_gpus

        select_gpus(Ranks.from_env(), gpus_per_rank)
    from dm_cli.run.checks import check_run_request

    check_run_request(output or "dmap.png", fields["save_latents"], fields["num_images"], fields["seed"],
                      fields["device_map"])  # before anything is loaded
    from dm_cli.run.single import run as run_pipeline

    request = _request(fields, output=output or "dmap.png")
    from dm_cli.run.distributed import Ranks

    if not Ranks.from_env().is_main:  # torchrun's other ranks (sharing each step: rank 0 writes) report nothing
        run_pipeline(request)
        return 0
    if as_json:
        result = run_pipeline(request)
        from dm_cli.cli._output import print_json

        print_json(result.to_json())
        return 0
    from dm_cli.render.run import RunView

    with RunView(quiet=quiet, binary=binary, plan_file=_source_from(request)) as view:
        result = run_pipeline(request, on_plan=view.show_plan, on_step=view.step, on_status=view.status)
    view.summary(result)
    return 0


def _source_from(request) -> str | None:
    """The plan file whose SOURCE this run takes (none given), to say so first."""
    return request.plan_file if request.source is None else None


def _run_queue(request, as_json: bool, quiet: bool, binary: bool) -> int:
    from dm_cli.run.queue_runner import QueueEvents, run_queue

    if as_json:
        from dm_cli.cli._output import print_json

        print_json(run_queue(request).to_json())
        return 0
    from dm_cli.render.queue import QueueView

    with QueueView(quiet=quiet, binary=binary, plan_file=_source_from(request.run)) as view:
        result = run_queue(request, QueueEvents(on_plan=view.show_plan, on_start=view.start, on_item=view.item,
                                                on_step=view.step, on_chunk=view.chunk, on_status=view.status))
    view.summary(result)
    return 0

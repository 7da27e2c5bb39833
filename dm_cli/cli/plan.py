"""Plan where every component and block goes, for this input size, on these devices (checked on meta)."""

from __future__ import annotations

from typing import Annotated

import typer

from dm_cli.cli._cli_utils import (
    BinaryOpt,
    CacheOpt,
    ComponentFileOpt,
    ComponentOpt,
    DtypeOpt,
    FpsOpt,
    FramesOpt,
    GuidanceScaleOpt,
    ImageOpt,
    JsonOpt,
    LastImageOpt,
    LoraOpt,
    MaxMemoryOpt,
    MaxSequenceLengthOpt,
    ModeOpt,
    NegativePromptOpt,
    NoCacheOpt,
    NumImagesOpt,
    OverheadOpt,
    OverwriteOpt,
    PipelineOpt,
    PlanHeightOpt,
    PlanOutputOpt,
    PlanParallelOpt,
    PlanPromptOpt,
    QuietOpt,
    SourceArg,
    StepsOpt,
    WeightsOpt,
    WidthOpt,
    word_parser,
)
from dm_cli.planning.modes import Strategy

# the predicted step time (dm_cli.planning.step_time) and --parallel auto's time model
DeviceTflopsOpt = Annotated[float | None, typer.Option(
    "--device-tflops", help="--parallel auto: TFLOP/s one GPU sustains (default: the device profile's).")]
LinkGbpsOpt = Annotated[float | None, typer.Option(
    "--link-gbps", help="--parallel auto: GB/s between two GPUs (default: the device profile's).")]
ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", metavar="FILE", help="Device profile for the predicted step time: a file dmap calibrate wrote, or "
                                      "table:NAME (h100-sxm, l40s, ...). Default: this machine's calibrated one, else "
                                      "dmap's defaults.")]
QueueOpt = Annotated[int, typer.Option("--queue", metavar="N", help="Prompts the predicted time per queue counts.")]


def plan(
    ctx: typer.Context,
    source: SourceArg,
    max_memory: MaxMemoryOpt = None,
    strategy: Strategy = typer.Option("auto", "--strategy", parser=word_parser(Strategy, "--strategy"),
                                      help="auto | sequential | balanced | balanced_low_0."),
    mode: ModeOpt = "auto",
    height: PlanHeightOpt = None,
    width: WidthOpt = None,
    batch_size: int = typer.Option(1, "--batch-size", help="Prompts per call."),
    num_images: NumImagesOpt = 1,
    guidance_scale: GuidanceScaleOpt = None,
    negative_prompt: NegativePromptOpt = None,
    image: ImageOpt = None,
    last_image: LastImageOpt = None,
    last_image_size: str | None = typer.Option(None, "--last-image-size", metavar="WxH",
                                               help="The last frame's size only (a plan needs no pixels)."),
    image_size: list[str] | None = typer.Option(None, "--image-size", metavar="WxH",
                                                help="An input image's size only (a plan needs no pixels); repeatable."),
    max_sequence_length: MaxSequenceLengthOpt = None,
    frames: FramesOpt = None,
    fps: FpsOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    overhead: OverheadOpt = None,
    component: ComponentOpt = None,
    output: PlanOutputOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    no_check: bool = typer.Option(False, "--no-check", help="Skip the split check on the meta device."),
    binary: BinaryOpt = False,
    no_cache: NoCacheOpt = False,
    world_size: int = typer.Option(1, "--world-size", help="torchrun ranks to plan for (rank r on GPU r); 1: one process."),
    parallel: PlanParallelOpt = None,
    device_tflops: DeviceTflopsOpt = None,
    link_gbps: LinkGbpsOpt = None,
    profile: ProfileOpt = None,
    steps: StepsOpt = None,  # the predicted time per image counts them
    queue: QueueOpt = 1,
    prompt: PlanPromptOpt = None,
    in_flight: int | None = typer.Option(None, "--in-flight", metavar="K",
                                         help="--parallel pipeline: queue prompts in flight (default --world-size)."),
    pipeline: PipelineOpt = None,
    component_file: ComponentFileOpt = None,
    lora: LoraOpt = None,
    cache: CacheOpt = None,
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
    from dm_cli.api import plan as make_plan
    from dm_cli.planning.plan_file import write_plan
    from dm_cli.render.queue import TickingStatus

    if output:
        _claim_output(ctx, output, overwrite)
    # the spinner names each step (which component, which trace) with its seconds, redrawn every second
    with TickingStatus(f"Planning {source}", enabled=not quiet) as progress:
        result = make_plan(source, max_memory=max_memory, height=height, width=width, batch_size=batch_size,
                           num_images=num_images, guidance_scale=guidance_scale,
                           max_sequence_length=max_sequence_length, strategy=strategy, mode=mode, dtype=dtype,
                           overhead=overhead, component=component, check=not no_check, use_cache=not no_cache,
                           num_frames=frames, fps=fps, weights=weights, negative_prompt=negative_prompt, image=image, image_size=image_size,
                           last_image=last_image, last_image_size=last_image_size,
                           on_progress=progress, world_size=world_size, parallel=parallel,
                           device_tflops=device_tflops, link_gbps=link_gbps, in_flight=in_flight, pipeline=pipeline,
                           component_files=component_file, lora=lora, cache=cache, profile=profile, steps=steps,
                           queue=queue, prompt=prompt, **(settings or {}))
    if output:
        write_plan(result, output)
    return _show(result, output, as_json, quiet, binary)


def _show(result, output: str | None, as_json: bool, quiet: bool, binary: bool) -> int:
    """The plan as JSON, quietly (split-check problems only) or rendered; exit 1 when the split check failed."""
    if as_json:
        from dm_cli.cli._output import print_json

        print_json(result.to_json())
    elif quiet:
        import sys

        for problem in result.check.get("problems", []):
            print(f"Split check: {problem}", file=sys.stderr)
        if output:
            print(f"Plan written to {output}.")
    else:
        from dm_cli.render.plan import render_plan

        render_plan(result, binary=binary, output=output)
    return 1 if result.check.get("problems") else 0


def _claim_output(ctx, output: str, overwrite: bool) -> None:
    """--output claimed until the command ends (a second `dmap plan -o` of it stops, naming this one), then checked
    against the overwrite policy (dm_cli.io.atomic.refuse_existing)."""
    from dm_cli.io.atomic import refuse_existing
    from dm_cli.io.claims import claim_outputs

    ctx.with_resource(claim_outputs([output], "dmap plan"))
    refuse_existing([output], overwrite)

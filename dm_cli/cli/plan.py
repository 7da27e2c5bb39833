"""Plan where every component and block goes, for this input size, on these devices (checked on meta)."""

from __future__ import annotations

import typer


def plan(
    source: str = typer.Argument(..., metavar="SOURCE", help="Pipeline/component folder, .safetensors, index JSON, preset or Hub repo id."),
    max_memory: str | None = typer.Option(None, "--max-memory", "-m",
                                          help="Target devices, e.g. 0=16GB,1=16GB,cpu=64GB,disk (default: this machine)."),
    strategy: str = typer.Option("auto", "--strategy", help="auto | sequential | balanced | balanced_low_0."),
    mode: str = typer.Option("auto", "--mode", help="auto | resident (all loaded at once) | staged (per stage)."),
    height: int | None = typer.Option(None, "--height", help="Height in pixels (default: the pipeline's, as dmap run: e.g. 1024 for FLUX, 480 for Wan); 0 = weights only (no activations, no GPU overhead unless --overhead)."),
    width: int | None = typer.Option(None, "--width", help="Width in pixels (default: --height, else the pipeline's)."),
    batch_size: int = typer.Option(1, "--batch-size", help="Prompts per call."),
    num_images: int = typer.Option(1, "--num-images", help="Images per prompt."),
    guidance_scale: float | None = typer.Option(None, "--guidance-scale", help="CFG scale (default: the pipeline's)."),
    max_sequence_length: int | None = typer.Option(None, "--max-sequence-length", help="T5 tokens (default: the pipeline's)."),
    frames: int | None = typer.Option(None, "--frames", help="Video pipelines: frames to generate, 4k+1 for Wan (default: the pipeline's, 81)."),
    fps: int | None = typer.Option(None, "--fps", help="Video pipelines: frames per second of the video (default: the pipeline's)."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: as stored, bf16 for configs)."),
    weights: str | None = typer.Option(None, "--weights", "-w",
                                       help="Store weights as fp8 | int8 and compute in --dtype (every component but the VAE), or per component: transformer=fp8,text_encoder=fp8."),
    overhead: str | None = typer.Option(None, "--overhead",
                                        help="Per-device overhead, e.g. 0=600MB,1=600MB (default 600MB per GPU, 0 for cpu)."),
    component: str | None = typer.Option(None, "--component", "-c", help="Plan this component only."),
    output: str | None = typer.Option(None, "--output", "-o", help="Write the plan JSON (dmap-plan v1; v2 when a decode is tiled) here."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan JSON instead of tables."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No tables: only errors (and where the plan was written)."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the split check on the meta device."),
    binary: bool = typer.Option(False, "--binary", help="Print sizes in GiB instead of GB."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Rebuild skeletons and traces instead of using the cache."),
) -> int:
    from dm_cli.api import plan as make_plan
    from dm_cli.io.atomic import refuse_existing
    from dm_cli.planning.make import write_plan
    from dm_cli.render.queue import TickingStatus

    if output:
        refuse_existing([output], overwrite)
    # the spinner names each step (which component, which trace) with its seconds, redrawn every second
    with TickingStatus(f"Planning {source}", enabled=not quiet) as progress:
        result = make_plan(source, max_memory=max_memory, height=height, width=width, batch_size=batch_size,
                           num_images=num_images, guidance_scale=guidance_scale,
                           max_sequence_length=max_sequence_length, strategy=strategy, mode=mode, dtype=dtype,
                           overhead=overhead, component=component, check=not no_check, use_cache=not no_cache,
                           num_frames=frames, fps=fps, weights=weights, on_progress=progress)
    if output:
        write_plan(result, output)
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

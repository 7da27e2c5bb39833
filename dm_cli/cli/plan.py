"""Plan where every component and block goes, for this input size, on these devices (checked on meta)."""

from __future__ import annotations

import sys

import typer

from dm_cli.api import plan as make_plan
from dm_cli.cli._cli_utils import table_options
from dm_cli.cli._output import print_json
from dm_cli.io.atomic import refuse_existing
from dm_cli.io.claims import claim_outputs
from dm_cli.planning.modes import CompileMode, Mode, Parallel, Strategy
from dm_cli.planning.plan_file import write_plan
from dm_cli.render.plan import render_plan
from dm_cli.render.queue import TickingStatus


# every parameter but ctx and settings is its row of dm_cli.run.options: its type and default as the table has
# them (table_options checks), its flags and help added from the table
@table_options("plan")
def plan(
    ctx: typer.Context,
    source: str, max_memory: str | None = None, strategy: Strategy = "auto", mode: Mode = "auto",
    height: int | None = None, width: int | None = None, batch_size: int = 1, num_images: int | None = 1,
    guidance_scale: float | None = None, negative_prompt: str | None = None, image: list[str] | None = None,
    last_image: str | None = None, last_image_size: str | None = None, image_size: list[str] | None = None,
    max_sequence_length: int | None = None, frames: int | None = None, fps: int | None = None, dtype: str | None = None,
    weights: str | None = None, overhead: str | None = None, component: str | None = None, output: str | None = None,
    overwrite: bool = False, as_json: bool = False, quiet: bool = False, no_check: bool = False, binary: bool = False,
    no_cache: bool = False, world_size: int = 1, parallel: Parallel | None = None, device_tflops: float | None = None,
    link_gbps: float | None = None, profile: str | None = None, steps: int | None = None, queue: int = 1,
    prompt: str | None = None, in_flight: int | None = None, pipeline: str | None = None,
    component_file: list[str] | None = None, lora: list[str] | None = None, cache: str | None = None,
    compile: CompileMode = "none",
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
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
                           queue=queue, prompt=prompt, compile=compile, **(settings or {}))
    if output:
        write_plan(result, output)
    return _show(result, output, as_json, quiet, binary)


def _show(result, output: str | None, as_json: bool, quiet: bool, binary: bool) -> int:
    """The plan as JSON, quietly (split-check problems only) or rendered; exit 1 when the split check failed."""
    if as_json:
        print_json(result.to_json())
    elif quiet:
        for problem in result.check.get("problems", []):
            print(f"Split check: {problem}", file=sys.stderr)
        if output:
            print(f"Plan written to {output}.")
    else:
        render_plan(result, binary=binary, output=output)
    return 1 if result.check.get("problems") else 0


def _claim_output(ctx, output: str, overwrite: bool) -> None:
    """--output claimed until the command ends (a second `dmap plan -o` of it stops, naming this one), then checked
    against the overwrite policy (dm_cli.io.atomic.refuse_existing)."""
    ctx.with_resource(claim_outputs([output], "dmap plan"))
    refuse_existing([output], overwrite)

"""Generate images: staged encode -> denoise -> decode across the devices of a plan (the demo without SOURCE).

With --prompts FILE, a whole queue: stage-major in chunks, resumable, spread over ranks under torchrun."""

from __future__ import annotations

import typer

from dm_cli.cli._cli_utils import table_options
from dm_cli.cli._errors import usage_error
from dm_cli.cli._output import print_json
from dm_cli.planning.modes import CompileMode, Mode, Parallel
from dm_cli.render.queue import QueueView
from dm_cli.render.run import RunView
from dm_cli.run.distributed import Ranks, select_gpus
from dm_cli.run.request import RunRequest
from dm_cli.run.sessions import single  # the module: tests patch its run
from dm_cli.run.sessions.queue_runner import QueueEvents, QueueRequest, run_queue
from dm_cli.run.settle.settle import check_options, check_run_request, refuse_single_only


# every parameter but ctx and settings is its row of dm_cli.run.options: its type and default as the table has
# them (table_options checks), its flags and help added from the table
@table_options("run")
def run(
    ctx: typer.Context,
    source: str | None = None, prompt: str | None = None, prompts: str | None = None,
    negative_prompt: str | None = None, image: list[str] | None = None, last_image: str | None = None,
    device_map: str = "auto", max_memory: str | None = None, mode: Mode = "auto", overhead: str | None = None,
    steps: int | None = None, guidance_scale: float | None = None, seed: int = 0, height: int | None = None,
    width: int | None = None, num_images: int | None = None, max_sequence_length: int | None = None,
    frames: int | None = None, fps: int | None = None, output: str | None = None, save_latents: str | None = None,
    dtype: str | None = None, weights: str | None = None, simulate: bool = False, overwrite: bool = False,
    track_activations: bool = False, resume: bool = True, chunk_size: int | None = None,
    chunk_memory: str | None = None, gpus_per_rank: int | None = None, parallel: Parallel | None = None,
    pipeline: str | None = None, component_file: list[str] | None = None, lora: list[str] | None = None,
    cache: str | None = None, compile: CompileMode = "none", as_json: bool = False, quiet: bool = False,
    binary: bool = False,
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
    _refuse_early(ctx, prompt, prompts, dtype, steps=steps, num_images=num_images, height=height, width=width,
                  max_sequence_length=max_sequence_length, frames=frames, fps=fps)

    # the checks before the request is made (`RunRequest.of` reads the images and LoRAs), in settle's order
    queue, plan = prompts is not None, None
    if queue:
        refuse_single_only(num_images=num_images, save_latents=save_latents, frames=frames, fps=fps,
                           settings=settings or {}, track_activations=track_activations, parallel=parallel)
    else:
        if gpus_per_rank is not None:  # this rank's GPUs chosen before anything is checked or loaded
            select_gpus(Ranks.from_env(), gpus_per_rank)
        output = output or "dmap.png"  # the outputs checked before anything is loaded; the plan file read here, once
        plan = check_run_request(output, save_latents, num_images, seed, device_map)
    # one RunRequest for one prompt and for a queue alike (a queue's items may bring their images; its output unused)
    request = RunRequest.of(
        source, prompt or "", device_map=device_map, settings=dict(settings or {}), seed=seed,
        negative_prompt=negative_prompt, max_memory=max_memory, overhead=overhead, mode=mode, steps=steps,
        guidance_scale=guidance_scale, height=height, width=width, num_images=num_images,
        max_sequence_length=max_sequence_length, num_frames=frames, fps=fps, save_latents=save_latents, dtype=dtype,
        simulate=simulate, overwrite=overwrite, track_activations=track_activations, weights=weights,
        images=image or None, last_image=last_image, parallel=parallel, pipeline=pipeline,
        component_files=component_file or None, loras=lora or None, cache=cache, compile=compile,
        output=None if queue else output, per_prompt_images=queue)
    if queue:
        return _run_queue(QueueRequest(prompts=prompts, run=request, output_dir=output or "dmap-out",
                                       resume=resume and not overwrite, chunk_size=chunk_size,
                                       chunk_memory=chunk_memory, gpus_per_rank=gpus_per_rank), as_json, quiet, binary)
    return _run_one(request, plan, as_json, quiet, binary)


def _refuse_early(ctx, prompt, prompts, dtype, *, steps, num_images, height, width, max_sequence_length, frames,
                  fps) -> None:
    """--prompt or --prompts, said in Typer's words; then what no run could use (dm_cli.run.settle.settle.check_options),
    before outputs, plans or SOURCE are touched."""
    if (prompt is None) == (prompts is None):
        which = "Missing option '--prompt'" if prompt is None else "Both --prompt and --prompts given"
        raise usage_error(f"{which}: give --prompt TEXT for one image or --prompts FILE for a queue.", ctx)

    check_options(dtype, steps=steps, num_images=num_images, height=height, width=width,
                  max_sequence_length=max_sequence_length, frames=frames, fps=fps)


def _run_one(request: RunRequest, plan, as_json: bool, quiet: bool, binary: bool) -> int:
    """One prompt, its outputs checked and its plan file read: the run, printed as JSON or drawn live by the
    renderer."""
    if not Ranks.from_env().is_main:  # torchrun's other ranks (sharing each step: rank 0 writes) report nothing
        single.run(request, plan=plan)
        return 0
    if as_json:
        result = single.run(request, plan=plan)

        print_json(result.to_json())
        return 0

    with RunView(quiet=quiet, binary=binary, plan_file=_source_from(request)) as view:
        result = single.run(request, on_plan=view.show_plan, on_step=view.step, on_status=view.status, plan=plan)
    view.summary(result)
    return 0


def _source_from(request) -> str | None:
    """The plan file whose SOURCE this run takes (none given), to say so first."""
    return request.plan_file if request.source is None else None


def _run_queue(request, as_json: bool, quiet: bool, binary: bool) -> int:
    if as_json:
        print_json(run_queue(request).to_json())
        return 0

    with QueueView(quiet=quiet, binary=binary, plan_file=_source_from(request.run)) as view:
        result = run_queue(request, QueueEvents(on_plan=view.show_plan, on_start=view.start, on_item=view.item,
                                                on_step=view.step, on_chunk=view.chunk, on_status=view.status))
    view.summary(result)
    return 0

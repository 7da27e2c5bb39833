"""Generate images: staged encode -> denoise -> decode across the devices of a plan (the demo without SOURCE).

With --prompts FILE, a whole queue: stage-major in chunks, resumable, spread over ranks under torchrun."""

from __future__ import annotations

import typer


def run(
    ctx: typer.Context,
    source: str | None = typer.Argument(None, metavar="SOURCE", help="Pipeline folder, preset or Hub repo id (default: the bundled random-weight FLUX demo)."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="What to draw."),
    prompts: str | None = typer.Option(None, "--prompts",
                                       help="A queue: a text file (one prompt a line) or JSONL (prompt, negative_prompt, "
                                            "seed, steps, guidance_scale, output per line); item i gets seed --seed + i."),
    negative_prompt: str | None = typer.Option(None, "--negative-prompt", help="What to avoid (CFG and true-CFG pipelines)."),
    device_map: str = typer.Option("auto", "--device-map", "-d",
                                   help="auto | balanced | balanced_low_0 | sequential (plan now), or a plan JSON from dmap plan."),
    max_memory: str | None = typer.Option(None, "--max-memory", "-m",
                                          help="Devices to plan for, e.g. 0=16GB,1=16GB,cpu=64GB (default: this machine)."),
    mode: str = typer.Option("auto", "--mode", help="auto | resident | staged (when planning here)."),
    overhead: str | None = typer.Option(None, "--overhead", help="Per-device overhead when planning, e.g. 0=600MB."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Denoising steps (default: the pipeline's)."),
    guidance_scale: float | None = typer.Option(None, "--guidance-scale", help="Guidance (default: the pipeline's)."),
    true_cfg_scale: float | None = typer.Option(
        None, "--true-cfg-scale", help="True CFG with --negative-prompt: a second denoiser call per step (Qwen-Image; default 4.0)."),
    guidance_scale_2: float | None = typer.Option(
        None, "--guidance-scale-2", help="Two-expert pipelines (Wan 2.2 A14B): guidance of the low-noise expert "
                                         "(default: --guidance-scale)."),
    seed: int = typer.Option(0, "--seed", help="Random seed, 0 to 2^64-1: same seed, same image."),
    height: int | None = typer.Option(None, "--height", help="Image height in pixels (default: the pipeline's)."),
    width: int | None = typer.Option(None, "--width", help="Image width in pixels (default: the pipeline's)."),
    num_images: int | None = typer.Option(None, "--num-images", min=1, help="Images for the prompt (out-0.png, out-1.png, ...; default 1, or the plan's)."),
    max_sequence_length: int | None = typer.Option(None, "--max-sequence-length", help="T5 tokens (FLUX, SD3)."),
    frames: int | None = typer.Option(None, "--frames", help="Video pipelines: frames to generate, 4k+1 for Wan (default: the pipeline's, 81)."),
    fps: int | None = typer.Option(None, "--fps", help="Video pipelines: frames per second of the video (default: the pipeline's, 16 for Wan)."),
    output: str | None = typer.Option(None, "--output", "-o",
                                      help="Image to write, in the format its suffix names: .png (default dmap.png), .jpg/.jpeg or .webp "
                                           "(prompt, seed and plan in its metadata); videos: "
                                           "out.mp4 (the default dmap.mp4), out.webp, out.gif or a folder out/ of PNG frames, "
                                           "each with a JSON sidecar; with --prompts the folder (default dmap-out)."),
    save_latents: str | None = typer.Option(None, "--save-latents", help="Also write the final latents (safetensors)."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default: the plan's, as stored)."),
    weights: str | None = typer.Option(None, "--weights", "-w",
                                       help="Store weights as fp8 | int8, compute in --dtype (every component but the VAE), or per component: transformer=fp8 (default: the plan's)."),
    simulate: bool = typer.Option(False, "--simulate",
                                  help="Run every planned device on this CPU with the split check (plans for GPUs you lack)."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace --output (and --save-latents) if they exist; with --prompts: --no-resume."),
    track_activations: bool = typer.Option(False, "--track-activations",
                                           help="Measure activations op by op on CPU (slower; default: the process's peak RSS)."),
    resume: bool = typer.Option(True, "--resume/--no-resume",
                                help="--prompts: skip items whose PNG is complete and made for them (default), or redo all."),
    chunk_size: int | None = typer.Option(None, "--chunk-size", min=1,
                                          help="--prompts, staged: prompts per chunk (default: what --chunk-memory holds)."),
    chunk_memory: str | None = typer.Option(None, "--chunk-memory",
                                            help="--prompts, staged: RAM for embeddings and latents waiting between "
                                                 "stages (default: 10% of available RAM)."),
    gpus_per_rank: int | None = typer.Option(None, "--gpus-per-rank", min=0,
                                             help="Under torchrun: local rank r uses GPUs r*K .. r*K+K-1 of its node."),
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and the written paths: no plan, tables or progress."),
    binary: bool = typer.Option(False, "--binary", help="Print sizes in GiB instead of GB."),
) -> int:
    from dm_cli.errors import UsageError

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

    def _request(output):
        """The run options, one RunRequest for one prompt and for a queue alike."""
        from dm_cli.run.request import RunRequest

        return RunRequest(
            source=source, prompt=prompt or "", negative_prompt=negative_prompt, device_map=device_map,
            max_memory=max_memory, overhead=overhead, mode=mode, steps=steps, guidance_scale=guidance_scale,
            true_cfg_scale=true_cfg_scale, guidance_scale_2=guidance_scale_2, seed=seed, height=height, width=width,
            num_images=num_images, max_sequence_length=max_sequence_length, num_frames=frames, fps=fps, output=output,
            save_latents=save_latents, dtype=dtype, simulate=simulate, overwrite=overwrite,
            track_activations=track_activations, weights=weights,
        )

    if prompts is not None:
        from dm_cli.run.queue_runner import QueueRequest

        if num_images not in (None, 1):
            raise UsageError("--num-images is for one prompt: with --prompts, repeat a line with another seed instead.")
        if save_latents or frames or fps or guidance_scale_2 is not None or track_activations:
            raise UsageError("--save-latents, --frames, --fps, --guidance-scale-2 and --track-activations are for one "
                             "prompt, not --prompts.")
        queue = QueueRequest(prompts=prompts, run=_request(output=None), output_dir=output or "dmap-out",
                             resume=resume and not overwrite, chunk_size=chunk_size, chunk_memory=chunk_memory,
                             gpus_per_rank=gpus_per_rank)
        return _run_queue(queue, as_json, quiet, binary)
    if gpus_per_rank is not None:
        from dm_cli.run.distributed import Ranks, select_gpus

        select_gpus(Ranks.from_env(), gpus_per_rank)
    from dm_cli.run.checks import check_run_request

    check_run_request(output or "dmap.png", save_latents, num_images, seed, device_map)  # before anything is loaded
    from dm_cli.run.single import run as run_pipeline

    request = _request(output=output or "dmap.png")
    if as_json:
        result = run_pipeline(request)
        from dm_cli.cli._output import print_json

        print_json(result.to_json())
        return 0
    from dm_cli.render.run import RunView

    with RunView(quiet=quiet, binary=binary) as view:
        result = run_pipeline(request, on_plan=view.show_plan, on_step=view.step, on_status=view.status)
    view.summary(result)
    return 0


def _run_queue(request, as_json: bool, quiet: bool, binary: bool) -> int:
    from dm_cli.run.queue_runner import QueueEvents, run_queue

    if as_json:
        from dm_cli.cli._output import print_json

        print_json(run_queue(request).to_json())
        return 0
    from dm_cli.render.queue import QueueView

    with QueueView(quiet=quiet, binary=binary) as view:
        result = run_queue(request, QueueEvents(on_plan=view.show_plan, on_start=view.start, on_item=view.item,
                                                on_step=view.step, on_chunk=view.chunk, on_status=view.status))
    view.summary(result)
    return 0

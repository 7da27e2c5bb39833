"""Serve a planned pipeline over HTTP (OpenAI's images API): loaded once, requests batched stage-major.

POST /v1/images/generations (videos: /v1/videos/generations), GET /v1/models, GET /metrics, GET /health.
Binds to 127.0.0.1 unless --host says otherwise; SIGTERM finishes the running batch and stops (a second Ctrl-C
stops at once)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dm_cli.cli._cli_utils import (
    CacheOpt,
    ComponentFileOpt,
    DtypeOpt,
    FpsOpt,
    FramesOpt,
    GpusPerRankOpt,
    GuidanceScaleOpt,
    HeightOpt,
    LoraOpt,
    MaxMemoryOpt,
    MaxSequenceLengthOpt,
    ModeOpt,
    NegativePromptOpt,
    OverheadOpt,
    ParallelOpt,
    PipelineOpt,
    QuietOpt,
    RunSourceArg,
    ServeStepsOpt,
    SimulateOpt,
    WeightsOpt,
    WidthOpt,
)

# the options only `dmap serve` takes (the shared ones are in _cli_utils)
ServeDeviceMapOpt = Annotated[str, typer.Option(
    "--device-map", "-d", help="auto | balanced | balanced_low_0 | sequential (plan now), or a plan JSON from dmap plan.")]
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")]
PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port, printed).")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar="DMAP_API_KEY", show_envvar=True,
    help="Require 'Authorization: Bearer KEY' on every route but /health.")]
QueueSizeOpt = Annotated[int, typer.Option(
    "--queue-size", help="Images that may wait; a request that does not fit is answered 429 (400 when it asks for "
                         "more images than the whole queue holds).")]
MaxBatchOpt = Annotated[int, typer.Option(
    "--max-batch", help="Images generated together at most, stage-major (and at most what 10% of RAM holds between "
                        "stages); within it, the batch size measured fastest (1 to start on a CPU).")]
MaxBodyOpt = Annotated[int, typer.Option("--max-body", help="Largest request body in bytes (base64 input images).")]
MaxConnectionsOpt = Annotated[int | None, typer.Option(
    "--max-connections", help="Open connections at most; at the bound the oldest idle one makes room (default: what "
                              "the file limit, ulimit -n, leaves room for, at most 4096).")]
ReadTimeoutOpt = Annotated[float, typer.Option(
    "--read-timeout", help="Seconds a client has to send a whole request head, and the longest its body may pause.")]
BodyTimeoutOpt = Annotated[float, typer.Option(
    "--body-timeout", help="Seconds a request body may take in all.")]
ModelNameOpt = Annotated[str | None, typer.Option(
    "--model-name", help="The model id /v1/models lists and requests may name (default: SOURCE, or demo).")]


def serve(
    source: RunSourceArg = None,
    device_map: ServeDeviceMapOpt = "auto",
    max_memory: MaxMemoryOpt = None,
    mode: ModeOpt = "auto",
    overhead: OverheadOpt = None,
    steps: ServeStepsOpt = None,
    guidance_scale: GuidanceScaleOpt = None,
    negative_prompt: NegativePromptOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    max_sequence_length: MaxSequenceLengthOpt = None,
    frames: FramesOpt = None,
    fps: FpsOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    simulate: SimulateOpt = False,
    parallel: ParallelOpt = None,
    gpus_per_rank: GpusPerRankOpt = None,
    pipeline: PipelineOpt = None,
    component_file: ComponentFileOpt = None,
    lora: LoraOpt = None,
    cache: CacheOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    queue_size: QueueSizeOpt = 64,
    max_batch: MaxBatchOpt = 8,
    max_body: MaxBodyOpt = 64 * 2**20,
    model_name: ModelNameOpt = None,
    max_connections: MaxConnectionsOpt = None,
    read_timeout: ReadTimeoutOpt = 10.0,
    body_timeout: BodyTimeoutOpt = 300.0,
    quiet: QuietOpt = False,
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
    from dm_cli.inputs import check_counts
    from dm_cli.run.request import RunRequest
    from dm_cli.serve.server import ServeRequest
    from dm_cli.serve.server import serve as serve_forever

    check_counts(steps=steps, num_images=None, height=height, width=width, max_sequence_length=max_sequence_length,
                 num_frames=frames, fps=fps)
    run = RunRequest.of(source, "", device_map=device_map, max_memory=max_memory, mode=mode, overhead=overhead,
                        steps=steps, guidance_scale=guidance_scale, negative_prompt=negative_prompt, height=height,
                        width=width, max_sequence_length=max_sequence_length, num_frames=frames, fps=fps, dtype=dtype,
                        weights=weights, simulate=simulate, parallel=parallel or "none", pipeline=pipeline,
                        component_files=component_file or None, loras=lora or None, cache=cache, settings=dict(settings or {}),
                        output=None, per_prompt_images=True)
    request = ServeRequest(run, host, port, api_key, queue_size, max_batch, max_body, model_name, gpus_per_rank,
                           max_connections, read_timeout, body_timeout)

    from dm_cli.run.distributed import Ranks

    ranks = Ranks.from_env()
    prefix = f"[rank {ranks.rank}/{ranks.world_size}] " if ranks.distributed else ""  # as a queue's lines under torchrun

    def say(message: str | None) -> None:
        if message and not quiet:
            print(prefix + message, file=sys.stderr, flush=True)

    def ready(url: str, session) -> None:
        job = session.defaults
        for notice in session.notices:
            say(notice)
        kind = "videos" if job.num_frames else "images"
        if session.source_from_plan:
            say(f"Running {session.source.spec} from {run.plan_file}")
        print(f"Serving {request.model or session.source.spec} ({session.source.pipeline_class}, {job.width}x{job.height} "
              f"{kind}, plan {session.plan.mode} {session.plan_digest}) on {url}; SIGTERM or Ctrl-C stops.",
              flush=True)

    served = serve_forever(request, on_status=say, on_ready=ready)
    say(f"Stopped after {served} image(s).")
    return 0

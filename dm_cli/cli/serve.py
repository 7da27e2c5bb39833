"""Serve a planned pipeline over HTTP (OpenAI's images API): loaded once, requests batched stage-major.

POST /v1/images/generations (videos: /v1/videos/generations), GET /v1/models, GET /metrics, GET /health.
Binds to 127.0.0.1 unless --host says otherwise; SIGTERM finishes the running batch and stops (a second Ctrl-C
stops at once)."""

from __future__ import annotations

import sys

from dm_cli.cli._cli_utils import table_options
from dm_cli.inputs import check_counts
from dm_cli.planning.modes import CompileMode, Mode, Parallel
from dm_cli.run.distributed import Ranks
from dm_cli.run.request import RunRequest
from dm_cli.serve.server import ServeRequest, launch_sigterm_notice, startup_lines
from dm_cli.serve.server import serve as serve_forever


# every parameter but ctx and settings is its row of dm_cli.run.options: its type and default as the table has
# them (table_options checks), its flags and help added from the table
@table_options("serve")
def serve(
    source: str | None = None, device_map: str = "auto", max_memory: str | None = None, mode: Mode = "auto",
    overhead: str | None = None, steps: int | None = None, guidance_scale: float | None = None,
    negative_prompt: str | None = None, height: int | None = None, width: int | None = None,
    max_sequence_length: int | None = None, frames: int | None = None, fps: int | None = None, dtype: str | None = None,
    weights: str | None = None, simulate: bool = False, parallel: Parallel | None = None,
    gpus_per_rank: int | None = None, pipeline: str | None = None, component_file: list[str] | None = None,
    lora: list[str] | None = None, cache: str | None = None, compile: CompileMode = "none", host: str = "127.0.0.1",
    port: int = 8000, api_key: str | None = None, queue_size: int = 64, max_batch: int = 8, max_body: int = 64 * 2**20,
    model_name: str | None = None, max_connections: int | None = None, read_timeout: float = 10.0,
    body_timeout: float = 300.0, quiet: bool = False,
    settings: dict | None = None,  # the families' own options (--true-cfg-scale, ...): _cli_utils.with_family_settings
) -> int:
    check_counts(steps=steps, num_images=None, height=height, width=width, max_sequence_length=max_sequence_length,
                 num_frames=frames, fps=fps)
    run = RunRequest.of(source, "", device_map=device_map, max_memory=max_memory, mode=mode, overhead=overhead,
                        steps=steps, guidance_scale=guidance_scale, negative_prompt=negative_prompt, height=height,
                        width=width, max_sequence_length=max_sequence_length, num_frames=frames, fps=fps, dtype=dtype,
                        weights=weights, simulate=simulate, parallel=parallel, pipeline=pipeline,
                        component_files=component_file or None, loras=lora or None, cache=cache, compile=compile,
                        settings=dict(settings or {}),
                        output=None, per_prompt_images=True)
    request = ServeRequest(run, host, port, api_key, queue_size, max_batch, max_body, model_name, gpus_per_rank,
                           max_connections, read_timeout, body_timeout)

    # under torchrun rank 0 speaks for the server (every rank loads, plans and warms up alike; rank 0 alone listens and
    # counts what it answered); another rank says only what is its own, an error, prefixed "[rank r/N]" (cli._errors)
    speaks = Ranks.from_env().is_main

    def say(message: str | None) -> None:
        if message and speaks and not quiet:
            print(message, file=sys.stderr, flush=True)

    def ready(url: str, session) -> None:
        for notice in session.notices:
            say(notice)
        if session.source_from_plan:
            say(f"Running {session.source.spec} from {run.plan_file}")
        say(launch_sigterm_notice())
        for line in startup_lines(request, session, url):  # plain print: never wrapped, the URL on a line of its own
            print(line, flush=True)

    served = serve_forever(request, on_status=say, on_ready=ready)
    say(f"Stopped after {served} image(s).")
    return 0

"""The Starlette application of `dmap serve`: routes, the API key, bounded bodies, disconnects, metrics.

Every answer is JSON but /metrics (Prometheus' text format); every error is OpenAI's shape,
{"error": {"message": ONE SENTENCE, "type": ..., "code": ...}}, never a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import sys
import time
from dataclasses import dataclass

from dm_cli.errors import DiskFullError, UsageError
from dm_cli.io.strict_json import json_text
from dm_cli.serve.requests import Served, parse_body, parse_request
from dm_cli.serve.worker import Batcher, Failure, Ticket

MAX_MESSAGE_CHARS = 1000  # an error message echoes parts of the request: bounded
DISCONNECT_POLL_S = 0.2
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


@dataclass
class AppState:
    served: Served
    session: object  # dm_cli.run.sessions.session.Session
    batcher: Batcher
    api_key: str | None = None
    max_body: int = 64 * 2**20
    started: float = 0.0
    connections: object = None  # dm_cli.serve.connections.ConnectionGuard: its bound and what it closed (/metrics)


def json_response(body, status_code: int = 200, headers: dict | None = None):
    """A JSON answer written by dmap's one strict writer (io/strict_json.py), as Starlette's JSONResponse writes it."""
    from starlette.responses import Response  # lazy: starlette (optional)

    text = json_text(body, ensure_ascii=False, separators=(",", ":"))
    return Response(text.encode("utf-8"), status_code=status_code, headers=headers, media_type="application/json")


def error(status: int, message: str, headers: dict | None = None):
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "…"
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}}
    return json_response(body, status_code=status, headers=headers)


def make_app(state: AppState):
    """The ASGI application over `state` (its batcher already started by the caller)."""
    from starlette.applications import Starlette  # lazy: starlette (optional)
    from starlette.exceptions import HTTPException  # lazy: starlette (optional)
    from starlette.responses import PlainTextResponse  # lazy: starlette (optional)
    from starlette.routing import Route  # lazy: starlette (optional)

    def authorised(request) -> bool:
        if state.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), state.api_key.encode())

    def refused():
        return error(401, "Missing or wrong API key: send the header 'Authorization: Bearer KEY' (the key dmap serve "
                          "was given with --api-key or DMAP_API_KEY).", {"WWW-Authenticate": "Bearer"})

    async def health(request):
        return json_response({"status": "stopping" if state.batcher.stopping else "ok",
                             "queue_depth": state.batcher.depth, "running": state.batcher.running})

    def model_object() -> dict:
        return {"id": state.served.model, "object": "model", "created": int(state.started), "owned_by": "dmap"}

    async def models(request):
        if not authorised(request):
            return refused()
        return json_response({"object": "list", "data": [model_object()]})

    async def model(request):
        """GET /v1/models/{id}: OpenAI's `client.models.retrieve(ID)`."""
        if not authorised(request):
            return refused()
        asked = request.path_params["model_id"]
        if asked != state.served.model:
            return error(404, f"No model {asked[:200]!r} here: this server serves {state.served.model!r} "
                              "(GET /v1/models).")
        return json_response(model_object())

    async def metrics(request):
        if not authorised(request):
            return refused()
        return PlainTextResponse(metrics_text(state), media_type="text/plain; version=0.0.4")

    async def images(request):
        return await generate(request, state, video=False, authorised=authorised(request), refused=refused)

    async def videos(request):
        return await generate(request, state, video=True, authorised=authorised(request), refused=refused)

    async def http_error(request, exc):
        return error(exc.status_code, {404: f"No such route: {request.url.path[:200]} (see GET /v1/models, "
                                            "POST /v1/images/generations, GET /health, GET /metrics).",
                                       405: f"{request.method[:20]} is not allowed on {request.url.path[:200]}."}
                     .get(exc.status_code, str(exc.detail)))

    async def internal(request, exc):
        full = DiskFullError.of(exc)  # no room on this server's disk: 507, not a bug
        return error(507, str(full)) if full else error(500, f"Internal error ({type(exc).__name__}: {exc}).")

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/images/generations", images, methods=["POST"]),
              Route("/v1/videos/generations", videos, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal})


async def read_body(request, limit: int) -> bytes:
    """The body, refused (UsageError with 413) past `limit` bytes, whatever Content-Length says."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"The request body is over {limit:,} bytes (dmap serve --max-body): send smaller input "
                         "images.")


async def generate(request, state: AppState, *, video: bool, authorised: bool, refused):
    """POST /v1/images/generations and /v1/videos/generations: checked, queued, answered when generated."""
    from starlette.concurrency import run_in_threadpool  # lazy: starlette (optional)
    from starlette.requests import ClientDisconnect  # lazy: starlette (optional)

    if not authorised:
        return refused()
    served = state.served
    if video != served.video:
        route = "/v1/videos/generations" if served.video else "/v1/images/generations"
        return error(400, f"This server makes {'videos' if served.video else 'images'} "
                          f"({served.model}): POST {route}.")
    try:
        body = await read_body(request, state.max_body)
    except _TooLarge as too_large:
        return error(413, str(too_large))
    except ClientDisconnect:  # one line, not uvicorn's traceback (and told once with a count: RepeatedLines)
        logging.getLogger("uvicorn.error").warning("A client went away while sending its request body.")
        return error(400, "The client disconnected while sending its request body.")
    try:
        parsed = await run_in_threadpool(lambda: parse_request(parse_body(body), served, state.session))
    except UsageError as refusal:
        return error(400, str(refusal))
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(result) -> None:  # from the worker thread
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    ticket = Ticket(parsed, deliver)
    refusal = state.batcher.submit(ticket)
    if refusal is not None:
        return error(refusal.status, refusal.message, {"Retry-After": "1"} if refusal.status == 429 else None)
    while not future.done():
        await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
        if not future.done() and await request.is_disconnected():
            state.batcher.cancel(ticket)
            return error(400, "The client disconnected before its images were made.")
    result = future.result()
    if isinstance(result, Failure):
        return error(result.status, result.message)
    kind = "video" if video else "image"
    data = [{"b64_json": base64.b64encode(out.data).decode("ascii"), "seed": out.seed,
             "seconds": round(out.seconds, 4)} for out in result]
    return json_response({"created": int(time.time()), "data": data, "output_format": parsed.output_format.lower(),
                         "size": f"{served.width}x{served.height}", "mime_type": parsed.mime, "kind": kind,
                         "model": served.model})


def metrics_text(state: AppState) -> str:
    """Prometheus' text format: the queue, requests, per-stage times and loads, planned and measured peaks."""
    batcher, lines = state.batcher, []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP dmap_{name} {help_text}")
        lines.append(f"# TYPE dmap_{name} {kind}")
        for labels, value in samples:
            shown = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"dmap_{name}{{{shown}}} {_number(value)}" if shown else f"dmap_{name} {_number(value)}")

    counters = dict(batcher.counters)
    metric("queue_depth", "gauge", "Images waiting in the queue.", [({}, batcher.depth)])
    metric("queue_capacity", "gauge", "Images the queue holds (dmap serve --queue-size).", [({}, batcher.max_queue)])
    metric("running_images", "gauge", "Images in the running batch.", [({}, batcher.running)])
    metric("images_total", "counter", "Images (or videos) generated and answered.", [({}, counters.get("images", 0))])
    metric("batches_total", "counter", "Batches run.", [({}, counters.get("batches", 0))])
    metric("batch_limit", "gauge", "Images the next batch takes at most: the batch size measured fastest, or its "
                                   "double once to measure it (at most --max-batch).", [({}, batcher.sizer.limit)])
    metric("batch_step_seconds", "gauge", "Seconds per image-step by batch size, as measured.",
           [({"batch": size}, seconds) for size, seconds in sorted(batcher.sizer.per_step.items())])
    metric("batch_images_total", "counter", "Images over all batches.", [({}, counters.get("batch_images", 0))])
    metric("disconnects_total", "counter", "Requests whose client went away.", [({}, counters.get("disconnects", 0))])
    guard = state.connections
    if guard is not None:
        metric("connections_open", "gauge", "Open client connections.", [({}, guard.open)])
        metric("connections_limit", "gauge", "The bound on open connections (dmap serve --max-connections).",
               [({}, guard.max_connections)])
        metric("connections_closed_total", "counter", "Connections the server closed: a request head or body late "
               "(head_timeout, body_stalled, body_timeout), the oldest idle one at the bound (made_room), a new one "
               "at the bound when every connection had a request (refused).",
               [({"reason": reason}, count) for reason, count in sorted(guard.closed.items())])
    metric("request_seconds", "summary", "From arrival to the last image encoded, over answered requests.", [])
    lines.append(f"dmap_request_seconds_sum {_number(counters.get('answered_s', 0.0))}")
    lines.append(f"dmap_request_seconds_count {_number(counters.get('answered', 0))}")
    totals = {name: dict(values) for name, values in state.session.stage_totals.items()}
    metric("stage_seconds_total", "counter", "Time per stage: loading its components, and running it.",
           [({"stage": name, "phase": phase}, values[f"{phase}_s"]) for name, values in totals.items()
            for phase in ("load", "run")])
    metric("stage_loads_total", "counter", "How often each stage loaded its components.",
           [({"stage": name}, values["loads"]) for name, values in totals.items()])
    metric("planned_peak_bytes", "gauge", "The plan's peak per stage and device.",
           [({"stage": stage.name, "device": str(device)}, peak) for stage in state.session.plan.stages
            for device, peak in stage.peak_bytes.items()])
    metric("device_peak_bytes", "gauge", "Measured peak per device since start: CUDA's max allocated, the "
                                         "process's peak RSS for cpu.", [({"device": d}, v) for d, v in _peaks()])
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return str(int(value)) if isinstance(value, (int, bool)) or float(value).is_integer() else f"{value:.6f}"


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")[:200]


def _peaks() -> list[tuple[str, int]]:
    import resource  # lazy: resource is POSIX only

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peaks = [("cpu", rss)]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks += [(f"cuda:{i}", torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())]
    return peaks

"""`dmap serve`: the session loaded once (planned here, or from a plan file, exactly as `dmap run` does) and warmed
up by one image before the server says it serves, the worker, and uvicorn on a socket bound before anything loads,
its connections bounded and timed (`serve.connections`). SIGTERM (or Ctrl-C) says what it finishes, answers the
waiting requests 503, finishes the running batch and answers it while /health says "stopping" (new work 503), and
stops (exit 0); a second Ctrl-C stops at once (the running requests 503, exit 130)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

from dm_cli.devices import device_key, device_label, device_rank, is_gpu
from dm_cli.errors import UsageError
from dm_cli.planning.modes import CompileMode
from dm_cli.run.distributed import Ranks, select_gpus
from dm_cli.run.options import option
from dm_cli.run.request import RunRequest
from dm_cli.run.sessions.session import Session
from dm_cli.run.settle import settle as settling  # the module: tests patch its settle
from dm_cli.run.settle.settle import Entry
from dm_cli.serve.app import AppState, make_app
from dm_cli.serve.connections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    Acceptor,
    ConnectionGuard,
    RepeatedLines,
    guarded_protocol,
    max_connections,
)
from dm_cli.serve.requests import Served
from dm_cli.serve.worker import Batcher, BatchSizer, RankCompute

# the server's defaults are its rows of the options table, declared there once (its --help and this request's)
DEFAULT_HOST = option("host").default
DEFAULT_PORT = option("port").default
DEFAULT_QUEUE_SIZE = option("queue_size").default
DEFAULT_MAX_BATCH = option("max_batch").default
DEFAULT_MAX_BODY = option("max_body").default
STOPPED_AT_ONCE = 130  # the exit status of a second Ctrl-C (or SIGTERM): 128 + SIGINT, as a shell says of Ctrl-C


@dataclass
class ServeRequest:
    """What `dmap serve` was asked for: the run options (its prompt unused; steps, guidance, negative prompt and
    the family's settings are each request's defaults) and the server's own."""

    run: RunRequest
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    max_batch: int = DEFAULT_MAX_BATCH
    max_body: int = DEFAULT_MAX_BODY
    model: str | None = None  # the id /v1/models lists (default: SOURCE as given, "demo" without one)
    gpus_per_rank: int | None = None
    max_connections: int | None = None  # None: what the file limit leaves room for (serve.connections)
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be from 0 to 65535 (0: any free port), not {self.port}.")
        for flag, value, low in (("--queue-size", self.queue_size, 1), ("--max-batch", self.max_batch, 1),
                                 ("--max-body", self.max_body, 1024)):
            if value < low:
                raise UsageError(f"{flag} must be at least {low}, not {value}.")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("--api-key (or DMAP_API_KEY) is empty: give a key, or leave it out for no key.")
        if self.api_key is not None and not all(" " <= char <= "~" for char in self.api_key.strip()):
            raise UsageError("--api-key (or DMAP_API_KEY) must be printable ASCII: an HTTP header cannot carry "
                             "other characters, so no client could ever send it.")
        for flag, seconds in (("--read-timeout", self.read_timeout), ("--body-timeout", self.body_timeout)):
            if not 0 < seconds <= 86400:  # NaN too
                raise UsageError(f"{flag} must be more than 0 and at most 86400 seconds, not {seconds}.")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads: a port in use is one sentence now, not after minutes."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise UsageError(f"--host {host!r} is not an address this machine can listen on ({error}).") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise UsageError(f"Cannot listen on {host}:{port}: {error.strerror or error}.") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_lines(request: ServeRequest, session, url: str) -> tuple[str, str]:
    """What the server says when it listens, as two lines: what it serves (the model, the size, steps and kind of
    output, the plan's mode and digest, its devices, the step cache, and --compile's, or eager), then the URL
    alone, whole whatever the terminal's width (a script reads the line that starts with http)."""
    job, plan = session.defaults, session.plan
    devices = sorted({device_key(d) for comp in plan.components.values() for d in comp.device_map.values()},
                     key=device_rank)
    where = ", ".join(device_label(d) for d in devices)
    if session.simulate and any(is_gpu(d) for d in devices):
        where += " (simulated on this CPU)"
    sharing = session.sharing
    if sharing is not None:
        where += f", {sharing.layout} over {sharing.ranks.world_size} torchrun ranks"
    frames = f", {job.num_frames} frames" if job.num_frames else ""
    cache = session.generation.cache
    line = (f"Serving {request.model or session.source.spec} ({session.source.pipeline_class}): "
            f"{job.width}x{job.height}{frames} {'videos' if job.num_frames else 'images'}, {job.steps} steps; "
            f"{plan.mode} plan {session.plan_digest} on {where}; step cache {cache.label if cache else 'none'}; "
            f"{compiled_words(session)}; SIGTERM or Ctrl-C stops. Listening on:")
    return line, url


def compiled_words(session) -> str:
    """How the served denoiser runs: compiled (--compile, during the warm-up) or eager."""
    mode = getattr(getattr(session, "settled", None), "compile", CompileMode.NONE)
    return "eager (no compile)" if mode is CompileMode.NONE else f"compiled ({mode}, at the warm-up)"


def serve(request: ServeRequest, on_plan: Callable | None = None, on_status: Callable[[str | None], None] | None = None,
          on_ready: Callable[[str, object], None] | None = None) -> int:
    """Load, serve until SIGTERM or Ctrl-C, stop; returns the number of images answered. `on_ready(url, session)`
    when the server listens (rank 0)."""

    request.check()
    ranks = Ranks.from_env()
    if ranks.is_main:  # the file limit's room, before anything loads
        request = replace(request, max_connections=max_connections(request.max_connections))
    select_gpus(ranks, request.gpus_per_rank)
    if ranks.distributed:
        _stop_with_launcher()
    sock = bind(request.host, request.port) if ranks.is_main else None
    try:
        # its LoRAs stay unfused: each request chooses among them (dm_cli.serve.requests), switched per batch
        session = Session(settling.settle(replace(request.run, switch_loras=True), entry=Entry.SERVE, on_plan=on_plan,
                                 on_status=on_status), on_status=on_status)
    except BaseException:
        if sock is not None:
            sock.close()
        raise

    try:
        warm_up(session, on_status or (lambda message: None))
        ranks.join()  # one session per rank (a --parallel session has joined already)
        compute = RankCompute(session, ranks)
        if not ranks.is_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 stops the ranks when its batch is done
            compute.follow()
            return 0
        return _serve_main(request, session, compute, sock, on_ready, on_status)
    finally:
        session.close()
        ranks.leave()


def _stop_with_launcher() -> None:
    """A torchrun rank gets SIGTERM when its launcher dies (Linux): a launch stopped by SIGTERM (torchrun started with
    `--signals-to-handle` without SIGTERM ends at once, with no traceback) leaves no rank serving on."""
    if not sys.platform.startswith("linux"):
        return

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


LAUNCH_SIGTERM = ("torchrun handles SIGTERM itself here: a SIGTERM to it stops the server cleanly, but torchrun then "
                  "ends in its own traceback and exit 1 (and kills a batch still running after its --shutdown-timeout, "
                  "30 s). For a clean stop, start torchrun with --signals-to-handle SIGINT,SIGHUP,SIGQUIT (or set "
                  "PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT).")


def launch_sigterm_notice(env=None) -> str | None:
    """What rank 0 says when its torchrun handles SIGTERM (its default: torchrun raises its SignalException, prints
    its traceback and exits 1 whatever the ranks do); None where SIGTERM is left to its default (torchrun ends at
    once, exit 143, and the ranks stop with it, `_stop_with_launcher`), or outside a torchrun that says."""
    env = os.environ if env is None else env
    handled = env.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # set for its ranks by a torchrun with --signals-to-handle
    if handled is None or "TORCHELASTIC_RUN_ID" not in env:
        return None
    return LAUNCH_SIGTERM if "SIGTERM" in (name.strip().upper() for name in handled.split(",")) else None


def warm_up(session, say: Callable[[str | None], None]) -> None:
    """One image of the served defaults before the server says it serves: what the plan keeps resident loads, and the
    libraries make their first calls (the first request would pay seconds for them while /health said ok). A family
    that needs an input image gets a grey one. Every rank warms up (ranks sharing each step, together)."""
    job, started = session.defaults, time.monotonic()
    image = None
    if session.family.min_input_images:
        from PIL import Image  # lazy: PIL (heavy, off start-up)

        image = Image.new("RGB", (job.width, job.height), (128, 128, 128))
    compiling = " and compiling the denoiser" if compiled_words(session).startswith("compiled") else ""
    say(f"Warming up: one image of the defaults (loading what the plan keeps resident{compiling})…")
    try:
        for _ in session.generate("warm-up", seed=0, image=image, chunk_size=1):
            pass
    except UsageError as refusal:
        say(f"No warm-up ({refusal}): the first request loads the model.")
        return
    say(f"Warmed up in {time.monotonic() - started:.1f} s.")


def runs_on_gpu(plan) -> bool:
    """Whether any stage of the plan runs on a GPU (a batch pays there: one pass over the weights for its images)."""
    return any(is_gpu(device_key(device)) for stage in plan.stages for device in stage.peak_bytes if device != "disk")


def _served(request: ServeRequest, session):
    job = session.defaults
    model = request.model or session.source.spec  # SOURCE as given, the plan's (-d without one), or "demo"
    loras = tuple((lora.name, lora.scale) for lora in session.generation.loras)
    family = session.family
    return Served(model, job.width, job.height, bool(job.num_frames), family.max_input_images or 0, loras,
                  settings=tuple(setting.name for setting in family.settings), negative_prompt=family.negative_prompt,
                  last_image=family.takes_last_image)


class Stopping:
    """What SIGTERM and Ctrl-C do to the server (in place of uvicorn's `handle_exit`): say what is finished, answer
    the waiting requests 503, finish and answer the running batch while the server still answers (/health
    "stopping", new work 503), then stop. A second Ctrl-C stops at once: the running requests are answered 503 and the
    command ends (exit 130); a repeated SIGTERM changes nothing (service managers repeat it; their SIGKILL is what
    stops at once). Unlike uvicorn's, the signal is not raised again after the shutdown."""

    def __init__(self, batcher, say: Callable[[str | None], None]):
        self.batcher, self.say = batcher, say
        self.draining = False  # a first signal came: the running batch finishes while /health says "stopping"
        self.at_once = False  # a second Ctrl-C came: the running requests were answered 503, the batch is dropped

    def signal(self, server, sig: int) -> None:
        """A signal to the uvicorn `server`."""
        batcher, name = self.batcher, signal.Signals(sig).name
        if self.draining or server.should_exit:
            if sig != signal.SIGINT:
                return
            self.at_once = True
            answered = batcher.abort()
            self.say(f"Stopping at once (Ctrl-C again): the running batch is dropped, {answered} request(s) "
                     "answered 503.")
            server.should_exit = True
            asyncio.get_event_loop().call_later(2.0, setattr, server, "force_exit", True)  # the 503s are sent by then
            return
        waiting, running, requests = batcher.depth, batcher.running, batcher.running_requests()
        batcher.stop()
        self.draining = True
        finishing = (f"finishing the running batch ({running} image(s) of {requests} request(s))" if running
                     else "no batch is running")
        self.say(f"Stopping ({name}): {finishing}; {waiting} waiting image(s) answered 503; /health says "
                 "\"stopping\" and new requests get 503 meanwhile; Ctrl-C again stops at once.")

    def done(self) -> bool:
        """The running batch is finished and answered: uvicorn may stop."""
        return self.draining and self.batcher.finished


def _serve_main(request: ServeRequest, session, compute, sock, on_ready, on_status=None) -> int:
    import uvicorn  # lazy: uvicorn (optional)

    say = on_status or (lambda message: None)
    heartbeat_s = max(1.0, min(600.0, compute.ranks.timeout_s / 4))
    max_batch = min(request.max_batch, session.chunk_size(request.max_batch)[0])  # what the chunk memory holds
    # on a CPU a batch seldom pays: one image at a time until a larger batch is measured faster (BatchSizer)
    sizer = BatchSizer(max_batch, max_batch if runs_on_gpu(session.plan) else 1)
    batcher = Batcher(compute, request.queue_size, max_batch, compute.heartbeat, heartbeat_s, sizer,
                      session.defaults.steps or 1)
    guard = ConnectionGuard(request.max_connections, request.read_timeout, request.body_timeout)
    api_key = request.api_key.strip() if request.api_key is not None else None  # a header's value has no outer spaces
    state = AppState(_served(request, session), session, batcher, api_key, request.max_body, time.time(), guard)
    # the h11 protocol, told to the guard; a head over 16 KiB is a 400 (h11's bound, said here so it stays one)
    config = uvicorn.Config(make_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=None, server_header=False, ws="none",
                            http=guarded_protocol(guard), h11_max_incomplete_event_size=16 * 1024)
    repeats = RepeatedLines()
    logs = [logging.getLogger(name) for name in ("uvicorn.error", "asyncio")]
    stopping = Stopping(batcher, say)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            """uvicorn listens on nothing (`sockets=[]`): the Acceptor takes `sock`'s connections within the guard's
            bound, and a watch closes the late ones."""
            await super().startup(sockets=[])
            loop = asyncio.get_running_loop()

            def protocol():
                return config.http_protocol_class(config=config, server_state=self.server_state,
                                                  app_state=self.lifespan.state, _loop=loop)

            self.acceptor = Acceptor(loop, sock, protocol, guard)
            self.acceptor.start()
            self.watch = loop.create_task(guard.watch(repeats))

        async def shutdown(self, sockets=None) -> None:
            self.acceptor.stop()
            try:
                await super().shutdown(sockets=[])  # the watch still closes the bodies that stall meanwhile
            finally:
                self.watch.cancel()

        def handle_exit(self, sig, frame) -> None:
            stopping.signal(self, sig)

        async def on_tick(self, counter: int) -> bool:
            if stopping.done():
                self.should_exit = True
            return await super().on_tick(counter)

    server = Server(config)
    for logger in logs:
        logger.addFilter(repeats)
    batcher.start()
    if on_ready is not None:
        on_ready(url_of(sock), session)
    try:
        server.run(sockets=[])
        if stopping.at_once:  # the worker still runs the dropped batch: the process ends now, not when it is done
            say(f"Stopped at once after {int(batcher.counters.get('images', 0))} image(s).")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STOPPED_AT_ONCE)
    finally:
        batcher.stop()
        batcher.join()
        compute.finish()
        sock.close()
        repeats.tell()  # the repeats not told yet
        for logger in logs:
            logger.removeFilter(repeats)
    return int(batcher.counters.get("images", 0))

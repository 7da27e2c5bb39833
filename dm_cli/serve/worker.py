"""The bounded queue of `dmap serve` and the one thread that runs the session.

Requests wait in arrival order, counted in images (a request of n images takes n places); a request that does not
fit the queue is refused at once (429; 400 when it is larger than the whole queue: it never fits). The worker takes
the oldest request and those waiting with its LoRA adapters and scales, whole requests in arrival order up to the
batch limit (`BatchSizer`: at most `max_batch` images, as many as measured to pay), and generates them together: `Session.generate` runs them stage-major (a staged plan loads each
stage's components once per batch), the same code and the same pixels as `dmap run --prompts`. Each request is
answered as soon as its last image is encoded. A batch that fails runs each request it left unanswered again on its
own: one request's failure is never another's. A request whose client went away while it waited leaves the queue
(its places freed); one already running is finished and dropped.

Under torchrun rank 0 takes the requests and broadcasts each batch; with one session per rank (no `--parallel`)
rank r generates the batch's images i with i % WORLD_SIZE == r, as a queue splits its items, and rank 0 gathers
them; with `--parallel` every rank runs every image, sharing each step. No Starlette here.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from dm_cli.errors import DiskFullError, UsageError
from dm_cli.io.images import image_save_options
from dm_cli.io.input_images import size_decode_budget
from dm_cli.io.outputs import save_video
from dm_cli.planning.placement import budgets  # the module: tests patch its available_ram

USAGE = "UsageError:"  # a rank's problem that is the request's fault (a 400), as gathered to rank 0
STOPPING = "The server is stopping (SIGTERM): this request had not started; send it again to another server."
STOPPED = ("The server was stopped at once (a second Ctrl-C) before this request's images were made: send it "
           "again to another server.")


@dataclass(frozen=True)
class Output:
    """One encoded image (or video) of a request."""

    index: int  # its place in the request
    seed: int
    data: bytes
    seconds: float  # its stages' time (loads shared by the batch are not counted)


@dataclass(frozen=True)
class Failure:
    status: int  # the HTTP status the request is answered with
    message: str  # one sentence


@dataclass(eq=False)
class Ticket:
    """One request waiting or running: `deliver` is called once, from the worker, with its outputs or a Failure."""

    request: object  # dm_cli.serve.requests.ServedRequest
    deliver: Callable[[object], None]
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    answered: bool = False  # the worker delivered its images or its Failure

    @property
    def size(self) -> int:
        return len(self.request.items)


class BatchSizer:
    """How many images a batch takes, learnt from the batches run: per batch size, the seconds per image-step
    (averaged); the limit is the size measured fastest, and the double of it (up to `max_batch`) is tried once. On a
    GPU a batch pays (one pass over the weights for all its images); on a CPU it often does not (the images' work
    adds up, and they all wait for the batch's last one): there it starts at 1 and grows only when measured faster."""

    def __init__(self, max_batch: int, start: int | None = None):
        self.max_batch = max_batch
        self.limit = max(1, min(max_batch, start or max_batch))
        self.per_step: dict[int, float] = {}  # batch size -> seconds per image-step

    def measured(self, size: int, seconds: float, steps: int) -> None:
        """A batch of `size` images ran `steps` image-steps in all in `seconds`."""
        if size < 1 or steps < 1 or seconds <= 0:
            return
        now = seconds / steps
        before = self.per_step.get(size)
        self.per_step[size] = now if before is None else (before + now) / 2
        best = min(self.per_step, key=lambda k: (self.per_step[k], k))
        bigger = min(best * 2, self.max_batch)
        self.limit = bigger if bigger not in self.per_step else best


class Batcher:
    """The queue and its worker thread. `compute(pairs)` generates [(QueueItem, format)] and yields
    (batch index, Output) as each is encoded; `heartbeat()` is called when idle for `heartbeat_s` (torchrun ranks
    waiting for the next batch must hear from rank 0 within their collective timeout). `sizer` (None: every batch up
    to `max_batch`) learns the batch limit; `default_steps` counts the image-steps of items that give none."""

    def __init__(self, compute: Callable, max_queue: int, max_batch: int, heartbeat: Callable[[], None] | None = None,
                 heartbeat_s: float = 60.0, sizer: BatchSizer | None = None, default_steps: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self._compute, self.max_queue, self.max_batch = compute, max_queue, max_batch
        self.sizer = sizer or BatchSizer(max_batch)
        self._default_steps, self._clock = default_steps, clock
        self._batch: list[Ticket] = []  # the running batch's requests
        self._heartbeat, self._heartbeat_s = heartbeat, heartbeat_s
        self._cond = threading.Condition()
        self._pending: deque[Ticket] = deque()
        self.depth = 0  # images waiting
        self.running = 0  # images in the running batch
        self.stopping = False
        self.counters: Counter = Counter()  # images, batches, batch_images, disconnects, answered_s
        self._thread = threading.Thread(target=self._run, name="dmap-serve-worker", daemon=True)

    # --- the web side ---------------------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> Failure | None:
        """Queue `ticket`, or the Failure that answers it now: 429 when its images do not fit, 503 when stopping."""
        with self._cond:
            if self.stopping:
                return Failure(503, STOPPING)
            if ticket.size > self.max_queue:
                return Failure(400, f"The request asks for {ticket.size} images, more than this server's whole queue "
                                    f"holds ({self.max_queue}, dmap serve --queue-size): ask for at most "
                                    f"{self.max_queue} per request.")
            if self.depth + ticket.size > self.max_queue:
                return Failure(429, f"The queue is full ({self.depth} of {self.max_queue} images waiting): try "
                                    "again shortly.")
            self._pending.append(ticket)
            self.depth += ticket.size
            self._cond.notify()
        return None

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: a waiting ticket leaves the queue; a running one is dropped when done."""
        with self._cond:
            ticket.cancelled = True
            self.counters["disconnects"] += 1
            if ticket in self._pending:
                self._pending.remove(ticket)
                self.depth -= ticket.size

    def stop(self) -> None:
        """No new requests; the waiting ones are answered 503; the running batch finishes."""
        with self._cond:
            if self.stopping:
                return
            self.stopping = True
            waiting, self.depth = list(self._pending), 0
            self._pending.clear()
            self._cond.notify_all()
        for ticket in waiting:
            ticket.deliver(Failure(503, STOPPING))

    def abort(self) -> int:
        """Stop at once: the running batch's requests are answered 503 now (its images are dropped); returns how many
        requests that answered."""
        self.stop()
        with self._cond:
            running = [ticket for ticket in self._batch if not ticket.cancelled and not ticket.answered]
            for ticket in running:
                ticket.cancelled = True
        for ticket in running:
            ticket.deliver(Failure(503, STOPPED))
        return len(running)

    def running_requests(self) -> int:
        with self._cond:
            return sum(not ticket.cancelled and not ticket.answered for ticket in self._batch)

    @property
    def finished(self) -> bool:
        """The worker is done: stopping, and no batch runs."""
        return self.stopping and not self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the worker -----------------------------------------------------------------------------------------

    def _take(self) -> list[Ticket] | None:
        """The next batch: whole requests in arrival order, up to max_batch images (one request may be larger), all
        with the oldest one's LoRA adapters and scales (a batch runs one adapter set; the others keep their places,
        and the oldest of them heads the next batch); None when stopping."""
        while True:
            with self._cond:
                if not self._pending and not self.stopping:
                    self._cond.wait(self._heartbeat_s)
                if self.stopping:
                    return None
                if self._pending:
                    batch, size = [], 0
                    limit = self.sizer.limit
                    adapters = _adapters(self._pending[0])
                    for ticket in list(self._pending):  # the oldest first, then the later ones with its adapters
                        if batch and size + ticket.size > limit:
                            break
                        if _adapters(ticket) == adapters:
                            self._pending.remove(ticket)
                            batch.append(ticket)
                            size += ticket.size
                    self.depth -= size
                    self.running = size
                    self._batch = batch
                    return batch
            if self._heartbeat is not None:
                self._heartbeat()

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._run_batch(batch)
            finally:
                with self._cond:
                    self.running = 0
                    self._batch = []

    def _run_batch(self, batch: list[Ticket]) -> None:
        """Run the batch; when it fails, every request it left unanswered runs again on its own, so that a request
        whose own values fail inside the model is the only one refused (the others get the bytes they get alone:
        a batch makes the same pixels as one request at a time)."""
        failure, left = self._attempt(batch)
        if failure is not None and len(batch) > 1:
            self.counters["batch_retries"] += 1
            for ticket in left:
                if not ticket.cancelled:
                    failure_alone, _ = self._attempt([ticket])
                    if failure_alone is not None and not ticket.cancelled:
                        ticket.answered = True
                        ticket.deliver(failure_alone)
            return
        for ticket in left:
            if not ticket.cancelled:
                ticket.answered = True
                ticket.deliver(failure or Failure(500, "Internal error: the batch ended without this request's images."))

    def _attempt(self, batch: list[Ticket]) -> tuple[Failure | None, list[Ticket]]:
        """Generate the batch's requests together, delivering each as soon as its last image is encoded: the Failure
        that stopped it (None: none) and the requests it did not answer."""
        pairs, owner = [], {}
        for ticket in batch:
            for item in ticket.request.items:
                owner[len(pairs)] = (ticket, item.index)
                pairs.append((replace(item, index=len(pairs)), ticket.request.output_format))
        got: dict[int, dict[int, Output]] = {id(ticket): {} for ticket in batch}
        done: set[int] = set()
        failure = None
        started = self._clock()
        try:
            for n, output in self._compute(pairs):
                ticket, place = owner[n]
                outputs = got[id(ticket)]
                outputs[place] = replace(output, index=place)
                if len(outputs) == ticket.size:
                    done.add(id(ticket))
                    self.counters["images"] += ticket.size
                    self.counters["answered_s"] += time.monotonic() - ticket.arrived
                    self.counters["answered"] += 1
                    if not ticket.cancelled:
                        ticket.answered = True
                        ticket.deliver([outputs[i] for i in range(ticket.size)])
        except UsageError as error:  # what the plan cannot run, found only when it runs: the requests' fault
            failure = Failure(400, str(error))
        except Exception as error:  # noqa: BLE001 - every request is answered; the server goes on
            full = DiskFullError.of(error)  # no room for an MP4: 507, the request can be sent again later
            failure = Failure(507, str(full)) if full else Failure(500, f"Internal error ({type(error).__name__}: {error}).")
        self.counters["batches"] += 1
        self.counters["batch_images"] += len(pairs)
        if failure is None:
            steps = sum(item.steps or self._default_steps for item, _ in pairs)
            self.sizer.measured(len(pairs), self._clock() - started, steps)
        return failure, [ticket for ticket in batch if id(ticket) not in done]


def _adapters(ticket: Ticket) -> tuple:
    """The LoRA adapters (and scales) a waiting request's images run with: a batch shares them."""
    return getattr(ticket.request, "adapters", ())


# --- computing a batch -----------------------------------------------------------------------------------------


def encode(generated, fmt: str, fps: int | None) -> bytes:
    """A generated image as the bytes `dmap run` writes to a file of that format (the same metadata, the same
    encoder options: dm_cli.io.images.image_save_options), or a video as the MP4 it writes."""
    if fmt == "MP4":
        with tempfile.TemporaryDirectory(prefix="dmap-serve-") as folder:
            path = Path(folder) / "video.mp4"
            save_video(generated.images[0], str(path), fps, generated.metadata)
            return path.read_bytes()

    image = generated.images[0]
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **image_save_options(fmt, generated.metadata))
    return buffer.getvalue()


# The share of the RAM left once the session is loaded that the input images of concurrent requests may take while
# they are decoded (dm_cli.io.input_images.DECODE_BUDGET): the rest is the batches' (chunk memory) and the stages'.
DECODE_RAM_SHARE = 0.25


def decode_room() -> int:
    """Bytes the server's concurrent decodes of input images may take: a share of the RAM its loaded plan leaves."""

    return int(budgets.available_ram() * DECODE_RAM_SHARE)


class RankCompute:
    """`compute` for the Batcher over this process's session, and under torchrun over every rank's."""

    def __init__(self, session, ranks):
        self.session, self.ranks = session, ranks
        self.split = session.sharing is None  # one session per rank: the batch's images split among the ranks
        self.decode_pixels = size_decode_budget(decode_room())


    def share(self, pairs: list) -> Iterator[tuple[int, Output]]:
        """This rank's images of the batch, generated stage-major and encoded (rank 0; other ranks' shared steps
        make no images)."""
        if self.split and self.ranks.distributed:
            pairs = [pair for pair in pairs if pair[0].index % self.ranks.world_size == self.ranks.rank]
        if not pairs:
            return
        formats = {item.index: fmt for item, fmt in pairs}
        for generated in self.session.generate([item for item, _ in pairs], chunk_size=len(pairs)):
            if generated.images:
                yield generated.index, Output(generated.index, generated.seed,
                                              encode(generated, formats[generated.index], self.session.fps),
                                              generated.seconds)

    def __call__(self, pairs: list) -> Iterator[tuple[int, Output]]:
        if not self.ranks.distributed:
            yield from self.share(pairs)
            return
        self._broadcast(pairs)
        error = None
        try:
            yield from self.share(pairs)
        except Exception as raised:  # noqa: BLE001 - the other ranks wait for the gather: join it, then raise
            error = raised
        parts = self.ranks.gather(([], None))
        if error is not None:
            raise error
        for outputs, problem in parts[1:]:
            if problem is not None:
                if problem.startswith(USAGE):
                    raise UsageError(problem[len(USAGE):])
                raise RuntimeError(problem)
            yield from outputs

    def heartbeat(self) -> None:
        if self.ranks.distributed:
            self._broadcast([])

    def finish(self) -> None:
        """Rank 0 is done: the other ranks' `follow` loops end."""
        if self.ranks.distributed:
            self._broadcast(None)

    def _broadcast(self, value):
        import torch  # lazy: torch (heavy, off start-up)
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        box = [value]
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
        return box[0]

    def follow(self) -> None:
        """Ranks other than 0: each batch rank 0 broadcasts, this rank's share, its outputs gathered to rank 0; until
        rank 0 finishes."""
        while (pairs := self._broadcast(None)) is not None:
            if not pairs:  # rank 0's heartbeat
                continue
            outputs, problem = [], None
            try:
                outputs = list(self.share(pairs))
            except UsageError as error:
                problem = f"{USAGE}{error}"
            except Exception as error:  # noqa: BLE001 - rank 0 answers the requests: it hears of it
                problem = f"Rank {self.ranks.rank}: internal error ({type(error).__name__}: {error})."
            self.ranks.gather((outputs, problem))

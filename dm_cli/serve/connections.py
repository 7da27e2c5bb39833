"""What keeps one client from locking the others out of `dmap serve`.

- a bound on open connections below the process's file limit (`RLIMIT_NOFILE`, less room for the model's files);
- at the bound, a new connection takes the place of the one doing least: the oldest still waiting for a request
  head, else the oldest still sending a body (so `GET /health` is answered while an attacker holds every place);
  when every connection has a whole request in hand, the new one is closed at once;
- a request head must arrive whole within the read timeout (slowloris), a body may not pause longer than it nor
  take longer than the body timeout (uvicorn's h11 protocol has no such timeouts: a subclass tells the guard where
  each request stands, a sweep closes the late ones);
- dmap accepts the connections itself (asyncio's accept loop logs and retries without end when the process is out
  of files): out of files, it lets the oldest idle connection go and waits a moment;
- `RepeatedLines`: a line the server logs again and again is told once, then its count once a minute and at stop.

Imports uvicorn and h11 inside functions: `dmap --help` imports neither.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict

from dm_cli.errors import UsageError
from dm_cli.run.options import option

DEFAULT_READ_TIMEOUT_S = option("read_timeout").default  # --read-timeout's, declared once in the options table
DEFAULT_BODY_TIMEOUT_S = option("body_timeout").default
DEFAULT_MAX_CONNECTIONS = 4096  # when the file limit leaves room for more
RESERVED_FILES = 64  # at least: the model's files, the worker's, pipes; and the connections accepted per wake-up
ACCEPT_BATCH = 32  # connections accepted per wake-up of the loop (each may close one waiting to close)
ACCEPT_RETRY_S = 0.1  # out of files: the pause before accepting again
CONNECTING_WAIT_S = 0.005  # at the bound, the connections just accepted not placed yet: the pause till they are
SWEEP_S = 0.25
REPEATS_EVERY_S = 60.0
OUT_OF_RESOURCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn's handler on stderr

CLOSED = {
    "head_timeout": "Closed a connection that sent no whole request head within %g s (--read-timeout).",
    "body_stalled": "Closed a connection whose request body paused for over %g s (--read-timeout).",
    "body_timeout": "Closed a connection whose request body took over %g s (--body-timeout).",
    "made_room": "At the connection limit (%d, --max-connections): closed the oldest connection that had no whole "
                 "request yet, for a new one.",
    "refused": "At the connection limit (%d, --max-connections), every connection has a request in hand: refused a "
               "new one.",
}


def open_files() -> int:
    """Files this process holds now."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return RESERVED_FILES


def connection_room() -> tuple[int, int]:
    """(the connections the file limit leaves room for, the limit): the soft `RLIMIT_NOFILE`, less the files
    open now and a reserve (a quarter of the limit, at least `RESERVED_FILES`) for the files the session opens
    while serving and the connections accepted in one wake-up."""
    import resource  # lazy: resource is POSIX only

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 2**24:
        soft = 2**24
    return soft - open_files() - max(RESERVED_FILES, soft // 4), soft


def max_connections(requested: int | None) -> int:
    """The bound on open connections: `requested` (--max-connections) if the file limit leaves room for it, else
    the room (at most DEFAULT_MAX_CONNECTIONS)."""
    room, soft = connection_room()
    if requested is not None and requested < 1:
        raise UsageError(f"--max-connections must be at least 1, not {requested}.")
    if room < 1 or (requested is not None and requested > room):
        wanted = f"--max-connections {requested:,}" if requested is not None else "Serving"
        raise UsageError(f"{wanted} needs more files than the process may open (ulimit -n is {soft:,}, room for "
                         f"{max(room, 0):,} connections): raise it (ulimit -n 4096) or give a lower --max-connections.")
    return requested if requested is not None else min(room, DEFAULT_MAX_CONNECTIONS)


class ConnectionGuard:
    """The bound and the timeouts, over every connection of one server (all on the event loop's thread)."""

    def __init__(self, max_connections: int, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.body_timeout_s = body_timeout_s
        self.live: set = set()  # the protocols of the open connections
        self.connecting = 0  # accepted, their protocol not made yet
        self.heads: OrderedDict = OrderedDict()  # protocol -> since when it waits for a request head (oldest first)
        self.bodies: dict = {}  # protocol -> since when it sends a body (oldest first)
        self.closed: Counter = Counter()  # reason -> connections closed for it

    @property
    def open(self) -> int:
        return len(self.live) + self.connecting

    def opened(self, protocol) -> None:
        self.connecting -= 1
        self.live.add(protocol)
        self.heads[protocol] = time.monotonic()

    def place(self, protocol, phase: str | None) -> None:
        """`phase`: "head" (no whole request head yet), "body" (the client sends its body), None (the request is
        whole: it is being answered)."""
        now = time.monotonic()
        if phase == "head":
            if protocol not in self.heads:  # the time runs from the first byte it waited for, not the last
                self.heads[protocol] = now
        else:
            self.heads.pop(protocol, None)
        if phase == "body":
            self.bodies.setdefault(protocol, now)
        else:
            self.bodies.pop(protocol, None)

    def lost(self, protocol) -> None:
        self.live.discard(protocol)
        self.heads.pop(protocol, None)
        self.bodies.pop(protocol, None)

    def make_room(self) -> bool:
        """Close the connection doing least, for a new one: the oldest still waiting for a request head, else the
        oldest still sending a body. False when every connection has a whole request in hand."""
        for waiting in (self.heads, self.bodies):
            if waiting:
                self.close(next(iter(waiting)), "made_room", self.max_connections)
                return True
        return False

    def close(self, protocol, reason: str, value) -> None:
        self.lost(protocol)
        self.closed[reason] += 1
        log.warning(CLOSED[reason], value)
        protocol.transport.abort()  # at once: a client that reads nothing cannot hold it open

    def sweep(self, now: float) -> None:
        """Close the connections past their time."""
        while self.heads:
            protocol, since = next(iter(self.heads.items()))
            if now - since < self.read_timeout_s:
                break
            self.close(protocol, "head_timeout", self.read_timeout_s)
        for protocol, since in list(self.bodies.items()):
            if protocol.flow is not None and protocol.flow.read_paused:
                protocol.heard = now  # the server paused reading (its buffer is full): not the client's pause
            if now - protocol.heard > self.read_timeout_s:
                self.close(protocol, "body_stalled", self.read_timeout_s)
            elif now - since > self.body_timeout_s:
                self.close(protocol, "body_timeout", self.body_timeout_s)

    async def watch(self, repeats: RepeatedLines | None = None) -> None:
        """Sweep a few times a second; tell the repeated log lines once a minute."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            try:
                self.sweep(now)
            except Exception as error:  # the sweep must go on: say it, once (RepeatedLines)
                log.error("The connection sweep failed (%s: %s).", type(error).__name__, error)
            if repeats is not None and now - repeats.told >= REPEATS_EVERY_S:
                repeats.tell()


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's h11 protocol, telling `guard` when bytes arrive and where its request stands."""
    import h11  # lazy: h11 (optional)
    from uvicorn.protocols.http.h11_impl import H11Protocol  # lazy: uvicorn (optional)

    def phase(conn) -> str | None:
        state = conn.their_state
        return "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None

    class GuardedH11Protocol(H11Protocol):
        heard = 0.0  # when the client's last bytes arrived (monotonic)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.heard = time.monotonic()
            guard.opened(self)

        def data_received(self, data: bytes) -> None:
            self.heard = time.monotonic()
            super().data_received(data)
            if self in guard.live:
                guard.place(self, phase(self.conn))

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self in guard.live:  # a body still coming after the answer (a 413, a 401) stays under its timeouts
                guard.place(self, phase(self.conn))

        def connection_lost(self, exc) -> None:
            guard.lost(self)
            super().connection_lost(exc)

    return GuardedH11Protocol


class Acceptor:
    """Accepts the listening socket's connections into `protocol_factory`'s protocols, within the guard's bound."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock, protocol_factory, guard: ConnectionGuard):
        self.loop, self.sock, self.protocol_factory, self.guard = loop, sock, protocol_factory, guard
        sock.setblocking(False)  # accept() says when nobody waits, instead of waiting
        self.retry: asyncio.TimerHandle | None = None
        self.stopped = False

    def start(self) -> None:
        self.retry = None
        if not self.stopped:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def stop(self) -> None:
        self.stopped = True
        if self.retry is not None:
            self.retry.cancel()
        self.loop.remove_reader(self.sock.fileno())

    def _accept(self) -> None:
        guard = self.guard
        for _ in range(ACCEPT_BATCH):
            full = guard.open >= guard.max_connections
            if full and not (guard.heads or guard.bodies) and guard.connecting:
                self._pause(CONNECTING_WAIT_S)  # those accepted a moment ago have no protocol yet: wait for them
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as error:
                log.warning("Cannot accept a connection (%s): trying again in %g s.", error.strerror or error,
                            ACCEPT_RETRY_S)
                if error.errno in OUT_OF_RESOURCE:
                    guard.make_room()  # out of files (or memory): let the oldest idle connection go
                self._pause(ACCEPT_RETRY_S)  # and accept again in a moment, not at once and without end
                return
            if full and not guard.make_room():
                conn.close()
                guard.closed["refused"] += 1
                log.warning(CLOSED["refused"], guard.max_connections)
                continue
            guard.connecting += 1
            self.loop.create_task(self._connect(conn))

    async def _connect(self, conn) -> None:
        try:
            await self.loop.connect_accepted_socket(self.protocol_factory, conn)
        except OSError:  # before its protocol was made (GuardedH11Protocol.connection_made counts it as open)
            conn.close()
            self.guard.connecting -= 1

    def _pause(self, seconds: float) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.retry = self.loop.call_later(seconds, self.start)


class RepeatedLines(logging.Filter):
    """Lets each kind of line through once (its first line, numbers and addresses aside, its logger, level and
    exception); the repeats are counted, and `tell` says each count in one line (once a minute while serving, and at
    stop). At most MAX_KINDS kinds: the others count as one."""

    MAX_KINDS = 256

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.first: dict = {}  # kind -> (logger name, level, the first line as logged)
        self.repeats: Counter = Counter()
        self.told = time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "dmap_repeats", False):
            return True
        line = record.getMessage().split("\n", 1)[0][:300]
        exception = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        kind = (record.name, record.levelno, re.sub(r"0x[0-9a-fA-F]+|\d+", "#", line), exception)
        with self.lock:
            if kind not in self.first and len(self.first) >= self.MAX_KINDS:
                kind, line = (record.name, record.levelno, "", ""), "(other lines)"
            if kind in self.first:
                self.repeats[kind] += 1
                return False
            self.first[kind] = (record.name, record.levelno, line + (f" ({exception})" if exception else ""))
            return True

    def tell(self) -> None:
        """One line per kind repeated since the last time."""
        with self.lock:
            counts, self.repeats = self.repeats, Counter()
            seconds, self.told = time.monotonic() - self.told, time.monotonic()
        for kind, count in counts.items():
            name, level, line = self.first[kind]
            logging.getLogger(name).log(level, "(%s more time(s) in the last %.0f s) %s", f"{count:,}", seconds, line,
                                        extra={"dmap_repeats": True})

"""`dmap serve` against clients that hold connections: a real server process (the 64x64 random-weight demo) whose
file limit is 256 (`RLIMIT_NOFILE`, set for the child), so that the connection counts stay small.

Idle sockets past the file limit, full heads with stalled bodies past it, a slowloris head, a stalled body, an
endless body, clients that leave mid-body: after each, /health and a normal request are answered, the server holds
no more connections than its bound, and its log says each kind of line once (then a count), never a traceback.
"""

import errno
import http.client
import json
import logging
import os
import re
import resource
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_process import port_of, start_serve, stop_serve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FILE_LIMIT = 256
READ_TIMEOUT_S, BODY_TIMEOUT_S = 2, 4
SERVE_ARGS = ["--height", "64", "--width", "64", "--steps", "2", "--port", "0",
              "--read-timeout", str(READ_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)]
POST_HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: dmap\r\nContent-Type: application/json\r\n"


def _low_file_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


class Server:
    """`dmap serve` in a child process with a file limit of 256; its stderr in a file (a pipe nobody reads would
    stop a server that logs without end, instead of showing it)."""

    def __init__(self, tmp_path_factory):
        cache = os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")
        self.stderr_path = tmp_path_factory.mktemp("serve-connections") / "stderr.txt"
        self.stderr = open(self.stderr_path, "w")
        env = {**os.environ, "DMAP_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
        self.proc, url = start_serve(SERVE_ARGS, cwd=REPO, env=env, stderr=self.stderr, preexec_fn=_low_file_limit)
        self.port = port_of(url)

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def request(self, method, path, body=None, timeout=120):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=None if body is None else json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith(b"{") else raw.decode()
        finally:
            connection.close()

    def metric(self, name: str) -> float:
        _, text = self.request("GET", "/metrics", timeout=10)
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"dmap_{name}"))

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def answers(self) -> None:
        """/health within seconds, and a normal request."""
        status, data = self.request("GET", "/health", timeout=10)
        assert status == 200 and data["status"] == "ok", data
        status, data = self.request("POST", "/v1/images/generations", {"prompt": "a red fox", "seed": 3})
        assert status == 200 and len(data["data"]) == 1, data

    def stop(self):
        code = stop_serve(self.proc)
        self.stderr.close()
        return code, self.log()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(tmp_path_factory)
    served.answers()  # the first generation warms up (seconds): the tests time the attacks, not that
    yield served
    served.stop()


def _closed_by_server(sock: socket.socket, wait_s: float = 0.0) -> bool:
    sock.settimeout(wait_s) if wait_s else sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except (BlockingIOError, TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def _told(log: str, words: str) -> int:
    """The lines that say `words` themselves (not a count of their repeats)."""
    return sum(words in line and "more time(s) in the last" not in line for line in log.splitlines())


def _send_slowly(sock: socket.socket, data: bytes, every_s: float) -> bool:
    """Send `data` a byte at a time; True when the server closed the connection before the last byte."""
    try:
        for byte in data:
            sock.sendall(bytes([byte]))
            time.sleep(every_s)
            if _closed_by_server(sock):
                return True
    except OSError:
        return True
    return False


def test_idle_sockets_past_the_file_limit_leave_health_and_requests_answered(server):
    limit = int(server.metric("connections_limit"))
    assert 0 < limit < FILE_LIMIT - 32  # below the file limit, room left for the model's files
    extra = 100
    idle = [server.connect() for _ in range(limit + extra)]  # more sockets than the server may open files
    try:
        status, data = server.request("GET", "/health", timeout=10)
        assert status == 200 and data["status"] == "ok"
        # the oldest idle ones made room for the new ones (or ran out of time): never more open than the bound
        assert sum(_closed_by_server(sock) for sock in idle) >= extra
        assert server.metric("connections_open") <= limit
        assert server.metric('connections_closed_total{reason="made_room"}') > 0
        server.answers()
    finally:
        for sock in idle:
            sock.close()
    log = server.log()
    assert "Traceback" not in log and len(log) < 20_000
    assert _told(log, "At the connection limit") == 1  # each kind of line once (then a count, once a minute)


def test_stalled_bodies_past_the_limit_leave_health_answered(server):
    limit = int(server.metric("connections_limit"))
    stalled = []
    try:
        for _ in range(limit + 20):
            sock = server.connect()
            sock.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            stalled.append(sock)
        assert server.request("GET", "/health", timeout=10)[0] == 200
        assert server.metric("connections_open") <= limit
        server.answers()
    finally:
        for sock in stalled:
            sock.close()


def test_a_slowloris_head_is_closed_after_the_read_timeout(server):
    before = server.metric('connections_closed_total{reason="head_timeout"}')
    with server.connect() as sock:
        head = b"GET /health HTTP/1.1\r\nHost: dmap\r\nX-Slow: " + b"a" * 200  # 50 s at 4 bytes a second
        assert _send_slowly(sock, head, 0.25)
    assert server.metric('connections_closed_total{reason="head_timeout"}') > before
    server.answers()


def test_a_stalled_body_and_an_endless_one_are_closed(server):
    with server.connect() as sock:
        sock.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        assert _closed_by_server(sock, wait_s=30)  # no answer: closed after READ_TIMEOUT_S without a byte
    assert server.metric('connections_closed_total{reason="body_stalled"}') >= 1
    with server.connect() as sock:  # a chunked body, a byte every 0.25 s (never stalls, never ends)
        sock.sendall(POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        assert _send_slowly(sock, b" " * 200, 0.25)
    assert server.metric('connections_closed_total{reason="body_timeout"}') >= 1
    with server.connect() as sock:  # answered 404 at once, then a body that never ends
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: dmap\r\nContent-Length: 100000\r\n\r\n")
        assert _send_slowly(sock, b" " * 200, 0.25)
    server.answers()


def test_clients_leaving_mid_body_log_one_line_not_a_traceback_each(server):
    for _ in range(30):
        with server.connect() as sock:
            sock.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.05)
    server.answers()
    log = server.log()
    assert _told(log, "A client went away while sending its request body.") == 1
    assert "Traceback" not in log and "ClientDisconnect" not in log


def test_stopping_tells_how_often_each_line_repeated(server):
    """Last in this file: it stops the server."""
    for _ in range(3):
        with server.connect() as sock:
            sock.sendall(POST_HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.05)
    time.sleep(0.5)
    code, log = server.stop()
    assert code == 0, log
    counts = re.findall(r"\(([\d,]+) more time\(s\) in the last \d+ s\) A client went away while sending its "
                        r"request body\.", log)
    assert counts and int(counts[-1].replace(",", "")) >= 3, log
    assert _told(log, "A client went away") == 1 and "Traceback" not in log and len(log) < 20_000


@pytest.mark.parametrize("key, env", [("clé-secrète", False), ("ключ", True)])
def test_a_non_ascii_api_key_is_refused_at_start(key, env):
    from conftest import run_dmap

    args = ["serve", "--port", "0"] + ([] if env else ["--api-key", key])
    code, _, err = run_dmap(*args, env={"DMAP_API_KEY": key} if env else None)
    assert code == 2 and "--api-key (or DMAP_API_KEY) must be printable ASCII" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_accept_loop_waits_when_the_process_is_out_of_files():
    """The error asyncio's own accept loop logs and retries without end (1.35 M times in 40 s): here it pauses the
    accepting, lets the oldest idle connection go, and says so once; the connection waiting is accepted after."""
    import asyncio

    from dm_cli.serve.connections import ACCEPT_RETRY_S, Acceptor, ConnectionGuard, RepeatedLines

    class OutOfFilesSocket(socket.socket):
        failures, calls = 5, 0

        def accept(self):
            OutOfFilesSocket.calls += 1
            if OutOfFilesSocket.calls <= self.failures:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return super().accept()

    class Idle:
        class transport:
            aborted = 0

            @classmethod
            def abort(cls):
                cls.aborted += 1

    made = []

    class Recording(asyncio.Protocol):
        def connection_made(self, transport):
            made.append(transport)
            guard.opened(self)
            transport.close()

    guard = ConnectionGuard(max_connections=8)
    guard.live.add(Idle)
    guard.heads[Idle] = 0.0
    repeats, records = RepeatedLines(), []
    log = logging.getLogger("uvicorn.error")
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log.addFilter(repeats)
    log.addHandler(handler)

    async def serve():
        with OutOfFilesSocket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen(8)
            acceptor = Acceptor(asyncio.get_running_loop(), listening, Recording, guard)
            acceptor.start()
            client = socket.create_connection(listening.getsockname()[:2])
            await asyncio.sleep(ACCEPT_RETRY_S * (OutOfFilesSocket.failures + 3))
            acceptor.stop()
            client.close()

    try:
        asyncio.run(serve())
        repeats.tell()
    finally:
        log.removeFilter(repeats)
        log.removeHandler(handler)
    assert len(made) == 1  # accepted once the files were back
    assert OutOfFilesSocket.calls <= OutOfFilesSocket.failures + 3  # one try per pause, not a spin
    assert Idle.transport.aborted == 1  # the one idle connection let go to free a file
    lines = [record.getMessage() for record in records if "Cannot accept" in record.getMessage()]
    assert len(lines) == 2 and "Too many open files" in lines[0]
    assert lines[1].startswith(f"({OutOfFilesSocket.failures - 1} more time(s) in the last")


@pytest.mark.parametrize("args, words", [
    (["--max-connections", "100000000"], "--max-connections 100,000,000 needs more files than the process may open"),
    (["--max-connections", "0"], "--max-connections must be at least 1"),
    (["--read-timeout", "0"], "--read-timeout must be more than 0"),
    (["--body-timeout", "nan"], "--body-timeout must be more than 0"),
])
def test_connection_options_past_what_can_be_kept_are_refused_at_start(args, words):
    from conftest import run_dmap

    code, _, err = run_dmap("serve", "--port", "0", *args)
    assert code == 2 and words in err and "Traceback" not in err

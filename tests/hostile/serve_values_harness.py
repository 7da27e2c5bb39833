"""`dmap serve`'s application in this process, as `dm_cli.serve.server` builds it (a Session, RankCompute, the
Batcher, AppState, make_app), driven through ASGI without sockets: for attacks on what a request carries, not on
the process."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from contextlib import contextmanager


def png_bytes(side: int, mode: str = "L") -> bytes:
    """A PNG of one colour: a few KB for millions of pixels (what a decode budget must bound)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (side, side), 7).save(buffer, "PNG")
    return buffer.getvalue()


def png_base64(side: int, mode: str = "RGB") -> str:
    """png_bytes as a request's "image" carries it."""
    return base64.b64encode(png_bytes(side, mode)).decode()


@contextmanager
def served_app(tmp_path_factory, source=None, size=64, steps=2, max_batch=8, start=True):
    """(app, state) of a server over `source` (None: the demo) at size x size, its worker started unless `start` is
    False (a test queues tickets first, so that they are batched together)."""
    import pytest

    from dm_cli.run.distributed import Ranks
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.session import Session
    from dm_cli.run.settle.settle import Entry, settle
    from dm_cli.serve.app import AppState, make_app
    from dm_cli.serve.server import ServeRequest, _served
    from dm_cli.serve.worker import Batcher, RankCompute

    cache = os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DMAP_CACHE_DIR", cache)
        patch.setenv("HF_HUB_OFFLINE", "1")
        run = RunRequest.of(source, "", height=size, width=size, steps=steps, mode="staged", output=None,
                            per_prompt_images=True)
        session = Session(settle(run, entry=Entry.SERVE))
        compute = RankCompute(session, Ranks.from_env())
        batcher = Batcher(compute, 16, max_batch)
        state = AppState(_served(ServeRequest(run), session), session, batcher)
        if start:
            batcher.start()
        try:
            yield make_app(state), state
        finally:
            batcher.stop()
            batcher.join(60)
            session.close()


def call(app, method: str, path: str, body=None) -> tuple[int, object]:
    """(status, JSON body) of one request to the ASGI `app`; `body` a dict (sent as JSON) or bytes."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    data = data or b""

    async def run():
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()  # the client stays connected

        messages = []

        async def send(message):
            messages.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
        await app(scope, receive, send)
        return messages

    messages = asyncio.run(run())
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return status, json.loads(raw)


def post(app, body) -> tuple[int, object]:
    return call(app, "POST", "/v1/images/generations", body)


def assert_one_sentence(status: int, data, low: int = 400, high: int = 499) -> str:
    """The refusal is a 4xx with one sentence (no traceback) in OpenAI's error shape; returns the sentence."""
    assert low <= status <= high, (status, data)
    message = data["error"]["message"]
    assert "Traceback" not in message and message.endswith(".") and "\n" not in message, message
    return message

"""`dmap serve` as a client meets it: a real server process on loopback, a real HTTP client (http.client), the
random-weight demo pipeline at 64x64.

A served image is `dmap run`'s file byte for byte (pixels and metadata) for the same seed; refusals are 400s with
one sentence; a full queue is 429; a client that goes away frees its places; SIGTERM answers the waiting requests
503, finishes the running batch and stops; the API key guards every route but /health.
"""

import base64
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_process import start_serve, stop_serve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE, STEPS, SEED = 64, 2, 3
SERVE_ARGS = ["--height", str(SIZE), "--width", str(SIZE), "--steps", str(STEPS), "--mode", "staged", "--port", "0"]


def _cache_dir(tmp_path_factory) -> str:
    return os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")


class Server:
    def __init__(self, tmp_path_factory, *args, env=None):
        self.env = {**os.environ, "DMAP_CACHE_DIR": _cache_dir(tmp_path_factory), "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc, self.url = start_serve([*SERVE_ARGS, *args], cwd=REPO, env=self.env, stderr=subprocess.PIPE)
        self.host, self.port = urlsplit(self.url).hostname, urlsplit(self.url).port

    def request(self, method, path, body=None, headers=None, timeout=120):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            raw = response.read()
            kind = response.getheader("Content-Type", "")
            return response.status, json.loads(raw) if kind.startswith("application/json") else raw.decode(), response
        finally:
            connection.close()

    def post(self, body, **kwargs):
        status, data, _ = self.request("POST", "/v1/images/generations", body, **kwargs)
        return status, data

    def metric(self, name, headers=None):
        _, text, _ = self.request("GET", "/metrics", headers=headers)
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"dmap_{name} "))

    def stop(self):
        return stop_serve(self.proc), self.proc.stderr.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(tmp_path_factory, "--queue-size", "4")
    yield served
    served.stop()


def _in_background(call, *args, **kwargs) -> dict:
    box: dict = {}

    def target():
        box["result"] = call(*args, **kwargs)

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def _until(condition, seconds=60.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_served_image_is_dmap_runs_file_byte_for_byte(server, tmp_path):
    from conftest import run_dmap
    from PIL import Image

    from dm_cli.io.images import read_image_metadata

    code, _, err = run_dmap("run", "-p", "a red fox", "--height", SIZE, "--width", SIZE, "--steps", STEPS,
                            "--seed", SEED, "--mode", "staged", "-o", tmp_path / "fox.png", "--quiet")
    assert code == 0, err
    status, data = server.post({"prompt": "a red fox", "seed": SEED, "n": 2, "model": "demo", "size": "64x64",
                                "response_format": "b64_json"})
    assert status == 200, data
    assert [item["seed"] for item in data["data"]] == [SEED, SEED + 1]  # n images: seeds seed, seed + 1, as a queue
    served = base64.b64decode(data["data"][0]["b64_json"])
    assert served == (tmp_path / "fox.png").read_bytes()
    (tmp_path / "second.png").write_bytes(base64.b64decode(data["data"][1]["b64_json"]))
    with Image.open(tmp_path / "fox.png") as first, Image.open(tmp_path / "second.png") as second:
        ran, other = read_image_metadata(first), read_image_metadata(second)
    assert other == {**ran, "seed": str(SEED + 1)}
    assert server.metric("images_total") >= 2


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not JSON"),
    ([1, 2], "not a JSON object"),
    ({"prompt": "a fox", "bogus": 1}, "unknown key(s) 'bogus'"),
    ({"prompt": "a fox", "size": "128x128"}, "over what this server's plan holds (64x64)"),
    ({"prompt": "a fox", "size": "32x32"}, "not this server's size"),
    ({"prompt": "a fox", "steps": 0}, "'steps' must be a whole number >= 1"),
    ({"prompt": "a fox", "n": 11}, "'n' must be an integer from 1 to 10"),
    ({"prompt": "a fox", "response_format": "url"}, "keeps no file to link to"),
    ({"prompt": "a fox", "output_format": "gif"}, "'output_format' must be png, jpeg or webp"),
    ({"prompt": "a fox", "model": "<script>" * 50}, "this server serves 'demo'"),
    ({"prompt": "a fox", "image": "bm90IGFuIGltYWdl"}, "takes no input image"),
    ({"prompt": "a fox", "seed": -1}, "seed"),
    ({"prompt": "x" * 10_001}, "more than the 10,000"),
    ({"prompt": "a fox", "lora": "/etc/passwd"}, "not among the adapters loaded at start: none was"),
    ({"prompt": ""}, "non-empty string 'prompt'"),
])
def test_what_the_plan_cannot_run_is_a_400_with_one_sentence(server, body, words):
    status, data = server.post(body)
    assert status == 400, data
    message = data["error"]["message"]
    assert words in message and "Traceback" not in message and "\n" not in message
    assert len(message) <= 1001


def test_routes_health_models_metrics_and_bounds(server):
    status, data, _ = server.request("GET", "/health")
    assert status == 200 and data["status"] == "ok"
    status, data, _ = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in data["data"]] == ["demo"]
    status, text, response = server.request("GET", "/metrics")
    assert status == 200 and "dmap_queue_depth 0" in text and 'dmap_stage_seconds_total{stage="denoise"' in text
    assert 'dmap_planned_peak_bytes{stage="denoise",device="cpu"}' in text and "dmap_device_peak_bytes" in text
    status, data, _ = server.request("GET", "/nowhere")
    assert status == 404 and "No such route" in data["error"]["message"]
    status, data, _ = server.request("GET", "/v1/images/generations")
    assert status == 405
    status, data, _ = server.request("POST", "/v1/videos/generations", {"prompt": "a fox"})
    assert status == 400 and "makes images" in data["error"]["message"]
    status, data = server.post(b"x" * (64 * 2**20 + 1))
    assert status == 413 and "--max-body" in data["error"]["message"]


def test_a_full_queue_is_429_and_a_client_that_goes_away_frees_its_places(server):
    running = _in_background(server.post, {"prompt": "a long one", "steps": 12, "seed": 1})
    assert _until(lambda: server.metric("running_images") == 1)
    # four images wait (the queue holds 4), on a connection this client then drops
    gone = http.client.HTTPConnection(server.host, server.port, timeout=60)
    gone.request("POST", "/v1/images/generations", body=json.dumps({"prompt": "gone", "n": 4}).encode(),
                 headers={"Content-Type": "application/json"})
    assert _until(lambda: server.metric("queue_depth") == 4)
    status, data, response = server.request("POST", "/v1/images/generations", {"prompt": "one more"})
    assert status == 429 and "queue is full" in data["error"]["message"]
    assert response.getheader("Retry-After") == "1"
    gone.sock.close()  # the client goes away: its four places are freed before its images are made
    assert _until(lambda: server.metric("queue_depth") == 0, 10)
    assert server.metric("disconnects_total") >= 1
    after = _in_background(server.post, {"prompt": "after", "seed": 2})
    running["thread"].join(120)
    after["thread"].join(120)
    assert running["result"][0] == 200 and after["result"][0] == 200
    assert _until(lambda: server.metric("running_images") == 0) and server.metric("queue_depth") == 0


def test_sigterm_finishes_the_running_batch_answers_the_waiting_503_and_stops(tmp_path_factory):
    served = Server(tmp_path_factory, "--model-name", "fox-server", env={"DMAP_API_KEY": "s3cret"})
    key = {"Authorization": "Bearer s3cret"}
    try:
        assert served.request("GET", "/health")[0] == 200  # /health needs no key
        status, data, response = served.request("GET", "/v1/models")
        assert status == 401 and "API key" in data["error"]["message"]
        assert served.request("GET", "/metrics", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert served.post({"prompt": "a fox"})[0] == 401
        status, data, _ = served.request("GET", "/v1/models", headers=key)
        assert status == 200 and data["data"][0]["id"] == "fox-server"
        running = _in_background(served.post, {"prompt": "running", "steps": 6}, headers=key)
        assert _until(lambda: served.metric("running_images", key) == 1)
        waiting = _in_background(served.post, {"prompt": "waiting"}, headers=key)
        assert _until(lambda: served.metric("queue_depth", key) == 1)
        served.proc.send_signal(signal.SIGTERM)
        waiting["thread"].join(60)
        status, data = waiting["result"]
        assert status == 503 and "stopping" in data["error"]["message"]
        running["thread"].join(120)
        status, data = running["result"]
        assert status == 200 and len(data["data"]) == 1
    finally:
        code, err = served.stop()
    assert code == 0, err
    assert "Stopped after 1 image(s)." in err and "Traceback" not in err


def test_bad_options_are_refused_before_anything_loads(tmp_path):
    from conftest import run_dmap

    code, _, err = run_dmap("serve", "--port", "70000")
    assert code == 2 and "--port must be from 0 to 65535" in err
    code, _, err = run_dmap("serve", "--api-key", " ")
    assert code == 2 and "--api-key (or DMAP_API_KEY) is empty" in err
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = run_dmap("serve", "--port", port)
    assert code == 2 and f"Cannot listen on 127.0.0.1:{port}" in err

"""Issue 44 C: small files, big images. Concurrent requests each carrying a tiny PNG of many pixels decode under one
pixel budget shared by every request (the most pixels decoded at once is bounded, and so is the process's peak
RSS), a waiting request holds its image's bytes, not its decoded pixels, and the served image is still `dmap run
--image`'s file byte for byte. The server answers a normal request after the attack."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from serve_values_harness import png_bytes, post, served_app

pytest.importorskip("torch")
pytest.importorskip("starlette")
from PIL import Image  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SIZE, STEPS = 32, 2




@pytest.fixture(scope="module")
def img2img(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux-img2img", tmp_path_factory.mktemp("i2i") / "tiny", seed=0)
    with served_app(tmp_path_factory, source=str(folder), size=SIZE, steps=STEPS) as (app, state):
        yield folder, app, state


def test_concurrent_big_images_decode_under_one_budget_and_wait_encoded(img2img, monkeypatch):
    from dm_cli.io import input_images
    from dm_cli.serve.requests import parse_request

    _, app, state = img2img
    side, requests = 2048, 4
    budget = input_images.DecodeBudget(side * side)  # one image's pixels at a time
    monkeypatch.setattr(input_images, "DECODE_BUDGET", budget)
    data = png_bytes(side)
    body = {"prompt": "a fox", "seed": 3, "image": base64.b64encode(data).decode()}

    parsed = parse_request(body, state.served, state.session)
    image = parsed.items[0].images[0]
    assert image.pixels is None and image.encoded == data and image.size == (side, side)

    answers = []
    barrier = threading.Barrier(requests)

    def client():
        barrier.wait()
        answers.append(post(app, body))

    threads = [threading.Thread(target=client) for _ in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [status for status, _ in answers] == [200] * requests, answers
    # each request decoded its image twice (checked when received, decoded when its batch ran), never two at once
    assert budget.peak == side * side and budget.in_use == 0
    same = {answer["data"][0]["b64_json"] for _, answer in answers}
    assert len(same) == 1  # the same request, the same bytes, batched or not
    status, normal = post(app, {"prompt": "a fox", "seed": 4, "image": base64.b64encode(png_bytes(16, "RGB")).decode()})
    assert status == 200, normal


def test_a_served_image_with_an_input_is_dmap_runs_file_byte_for_byte(img2img, tmp_path):
    """The served input is kept encoded and decoded when its batch runs, exactly as `dmap run --image` reads the
    file: the same pixels and the same metadata (the input's digest is of the file's bytes, as the run's)."""
    from conftest import run_dmap

    folder, app, _ = img2img
    picture = tmp_path / "in.png"
    Image.effect_mandelbrot((40, 24), (-2, -1, 1, 1), 50).convert("RGB").save(picture)
    status, data = post(app, {"prompt": "a fox", "seed": 9, "image": base64.b64encode(picture.read_bytes()).decode()})
    assert status == 200, data
    code, _, err = run_dmap("run", folder, "--prompt", "a fox", "--seed", 9, "--image", picture, "--height", SIZE,
                            "--width", SIZE, "--steps", STEPS, "--mode", "staged", "-o", tmp_path / "run.png")
    assert code == 0, err
    import numpy as np

    from dm_cli.io.images import read_image_metadata

    served, ran = Image.open(io.BytesIO(base64.b64decode(data["data"][0]["b64_json"]))), Image.open(tmp_path / "run.png")
    assert np.array_equal(np.array(served), np.array(ran))
    served_meta, ran_meta = read_image_metadata(served), read_image_metadata(ran)
    # the server planned for an input of its output's size, the run for this one: only the plan's digest differs
    del served_meta["plan_digest"], ran_meta["plan_digest"]
    assert served_meta == ran_meta and any(picture_digest(picture) in value for value in ran_meta.values())


def picture_digest(path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


RSS_PROBE = r"""
import base64, io, json, resource, sys, threading  # noqa: E401
from PIL import Image
from dm_cli.io import input_images
from dm_cli.serve.requests import _decoded

side, count = int(sys.argv[1]), int(sys.argv[2])
buffer = io.BytesIO()
Image.new("L", (side, side), 7).save(buffer, "PNG")
text = base64.b64encode(buffer.getvalue()).decode()
input_images.DECODE_BUDGET = input_images.DecodeBudget(side * side)
_decoded(text, "warm-up")  # the plugins imported, as in a server that has decoded before
page = resource.getpagesize()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
base = rss()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # the peak RSS (VmHWM) starts again from here

def peak_rss():
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
barrier, held = threading.Barrier(count), []

def receive():
    barrier.wait()
    held.append(_decoded(text, "The request's 'image'"))

threads = [threading.Thread(target=receive) for _ in range(count)]
[t.start() for t in threads]
[t.join() for t in threads]
peak = peak_rss()
print(json.dumps({"peak_growth": peak - base, "held_growth": rss() - base, "file_bytes": len(buffer.getvalue()),
                  "held": len(held), "budget_peak": input_images.DECODE_BUDGET.peak}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_process_peak_rss_stays_within_the_budget_not_the_request_count(tmp_path):
    """The issue's attack, scaled down: four concurrent requests each with a tiny PNG of 8192x8192 (64 MiB decoded in
    its stored mode, 192 MiB as RGB). Under a budget of one image they take about one decode's memory at the peak,
    not four (the unbounded decodes took 4 x (64 + 192) MiB and held 4 x 192 MiB afterwards), and nothing after."""
    side, count = 8192, 4
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", RSS_PROBE, str(side), str(count)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)
    one = side * side  # bytes of one decode in mode L
    assert measured["held"] == count and measured["file_bytes"] < 200_000 and measured["budget_peak"] == one
    assert measured["peak_growth"] < 1.5 * one, measured  # unbounded: `count` decodes at once
    # the waiting requests hold their bytes, not pixels, and the freed pixels went back to the system
    assert measured["held_growth"] < one // 4, measured

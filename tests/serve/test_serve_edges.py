"""Issue 41, `dmap serve`'s edges: stopping (a first signal says what it finishes and the server still answers
/health "stopping"; a second stops at once, the running client answered 503, no traceback); random seeds below
2^53; a request larger than the queue is a 400; the model warmed up before the `Serving` line; a client's JSON
keys named as keys; OpenAI's model retrieval and keys; the batch limit learnt from measured batches."""

from __future__ import annotations

import signal
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hostile.serve_values_harness import assert_one_sentence, call, post, served_app  # noqa: E402
from test_serve import Server, _in_background, _until  # noqa: E402 - after the skips


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_app(tmp_path_factory) as (app, state):
        yield app, state


def test_random_seeds_stay_below_2_to_the_53(served):
    """JavaScript's and jq's numbers hold whole numbers exactly up to 2^53: a seed sent back must be the same seed."""
    from dm_cli.serve.requests import parse_request

    _, state = served
    seeds = [item.seed for _ in range(200)
             for item in parse_request({"prompt": "a fox", "n": 10}, state.served, state.session).items]
    assert max(seeds) < 2**53 and len(set(seeds)) > 1000


def test_a_request_larger_than_the_whole_queue_is_a_400_not_a_429():
    from dm_cli.serve.worker import Batcher, Ticket

    batcher = Batcher(lambda pairs: iter(()), max_queue=2, max_batch=8)
    refusal = batcher.submit(Ticket(SimpleNamespace(items=(1, 2, 3)), lambda result: None))
    assert refusal.status == 400 and "more than this server's whole queue holds (2" in refusal.message
    assert batcher.submit(Ticket(SimpleNamespace(items=(1, 2)), lambda result: None)) is None  # one that fits waits


def test_refusals_name_json_keys_and_offer_only_this_models_keys(served):
    app, state = served
    assert not state.served.negative_prompt  # the demo is FLUX: guidance-distilled, no negative prompt
    message = assert_one_sentence(*post(app, {"prompt": "a fox", "negative_prompt": "blur"}))
    assert "drop 'negative_prompt'" in message and "--" not in message, message
    message = assert_one_sentence(*post(app, {"prompt": "a fox", "true_cfg_scale": 4}))
    assert "'true_cfg_scale' is for" in message and "--" not in message, message
    message = assert_one_sentence(*post(app, {"prompt": "a fox", "bogus": 1}))
    offered = message.split("this model takes ", 1)[1].rstrip(".").split(", ")
    assert "steps" in offered and "seed" in offered and "prompt" in offered, offered
    for refused_here in ("negative_prompt", "image", "last_image", "true_cfg_scale", "lora"):
        assert refused_here not in offered, offered


def test_openai_keys_one_rule_and_models_retrieve(served):
    """`user` changes no pixel: ignored. `quality`, `style`, ... would change pixels in a way dmap cannot honour:
    refused with the reason. client.models.retrieve(ID) is GET /v1/models/ID."""
    app, _ = served
    for key, value, why in (("quality", "hd", "give 'steps' instead"), ("style", "vivid", "say the style in 'prompt'"),
                            ("background", "transparent", "no transparent backgrounds")):
        message = assert_one_sentence(*post(app, {"prompt": "a fox", key: value}))
        assert f"OpenAI's '{key}'" in message and why in message, message
    status, data = post(app, {"prompt": "a fox", "seed": 1, "user": "someone"})
    assert status == 200 and len(data["data"]) == 1, data
    status, data = call(app, "GET", "/v1/models/demo")
    assert status == 200 and data["id"] == "demo" and data["object"] == "model", data
    status, data = call(app, "GET", "/v1/models/gpt-image-1")
    assert status == 404 and "this server serves 'demo'" in data["error"]["message"], data


def test_the_batch_limit_is_what_measured_batches_say_pays():
    """A fake device: each batch advances a fake clock by its cost. Where a batch costs more per image (a CPU) the
    batches stay at one image after one larger batch is measured; where it costs less (a GPU), they grow."""
    from dm_cli.inputs import Generation
    from dm_cli.run.sessions.queue import QueueItem
    from dm_cli.serve.worker import Batcher, BatchSizer, Output, Ticket

    def batches(cost, start):
        clock, sizes = [0.0], []

        def compute(pairs):
            sizes.append(len(pairs))
            clock[0] += cost(len(pairs))
            for item, _ in pairs:
                yield item.index, Output(item.index, 0, b"", 0.0)

        answered = []
        batcher = Batcher(compute, 64, 8, sizer=BatchSizer(8, start), clock=lambda: clock[0])
        for n in range(16):
            item = QueueItem(0, f"prompt {n}", n, "0.png", Generation(steps=2))
            batcher.submit(Ticket(SimpleNamespace(items=(item,), output_format="PNG"), answered.append))
        batcher.start()
        assert _until(lambda: len(answered) == 16, 30)
        batcher.stop()
        batcher.join(10)
        return sizes, batcher.sizer.limit

    sizes, limit = batches(lambda k: k * (1.0 if k == 1 else 1.3), start=1)  # a CPU: a batch costs more per image
    assert sizes[:2] == [1, 2] and set(sizes[2:]) == {1} and limit == 1, sizes
    sizes, limit = batches(lambda k: 1.0 + 0.1 * k, start=1)  # a GPU: one pass over the weights for the batch
    assert sizes[:4] == [1, 2, 4, 8] and limit == 8, sizes


def _lines(stream, into: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: [into.append(line) for line in stream], daemon=True)
    thread.start()
    return thread


def test_warmed_up_before_serving_and_two_ctrl_c_stop_at_once(tmp_path_factory):
    served = Server(tmp_path_factory)
    err: list[str] = []
    reader = _lines(served.proc.stderr, err)
    try:
        # loaded before the Serving line: the stages have loaded once; on a CPU batches start at one image
        assert served.metric("stage_loads_total{stage=\"denoise\"}") >= 1
        assert served.metric("batch_limit") == 1
        running = _in_background(served.post, {"prompt": "a long one", "steps": 2000, "seed": 1})
        assert _until(lambda: served.metric("running_images") == 1)
        served.proc.send_signal(signal.SIGINT)
        assert _until(lambda: any("finishing the running batch (1 image(s) of 1 request(s))" in line
                                  for line in err), 30), err
        status, data, _ = served.request("GET", "/health")  # still answered while it finishes
        assert status == 200 and data["status"] == "stopping", data
        status, data = served.post({"prompt": "new work"})
        assert status == 503 and "stopping" in data["error"]["message"], data
        served.proc.send_signal(signal.SIGINT)  # the second Ctrl-C: at once, not after 2000 steps
        code = served.proc.wait(60)
        running["thread"].join(30)
        status, data = running["result"]
        assert status == 503 and "stopped at once" in data["error"]["message"], data
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    reader.join(10)
    text = "".join(err)
    assert code == 130 and "Traceback" not in text and "CancelledError" not in text, text
    assert "Stopped at once after 0 image(s)." in text
    assert text.index("Warmed up in") < text.index("Stopping (SIGINT)")

"""Issue 44 B and H: a value that passed the checks then failed inside the model (a finite guidance of 1e308 that
overflows float32, a prompt with a lone surrogate the tokenizer raises on) is refused before anything loads, by one
check that `dmap run`, a queue line and `dmap serve` share, with the same sentence; a request that still fails
inside a batch fails alone (the request beside it gets the bytes it gets alone); a seed of 5000 digits is out of
range, not "not JSON". The server answers a normal request after each attack."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import run_dmap
from serve_values_harness import assert_one_sentence, post, served_app

pytest.importorskip("torch")
pytest.importorskip("starlette")

NORMAL = {"prompt": "a red fox", "seed": 5}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_app(tmp_path_factory) as (app, state):
        yield app, state


def _answers_normally(app) -> None:
    status, data = post(app, NORMAL)
    assert status == 200 and len(data["data"]) == 1, data


# the same bad value as `dmap run` options, a queue line's keys and a served body's keys, and what every path says
BAD_VALUES = {
    "finite guidance past float32": ({"guidance_scale": 1e308}, ["--guidance-scale", "1e308"],
                                     "must be a number from 0 to 1000, not 1e+308."),
    "negative guidance": ({"guidance_scale": -2}, ["--guidance-scale", "-2"], "must be a number from 0 to 1000, not -2"),
    "a lone surrogate in the prompt": ({"prompt": "a \ud800 fox"}, ["--prompt", "a \ud800 fox"],
                                       "is not valid Unicode text: character 3 is a lone surrogate (\\ud800); send "
                                       "UTF-8 text."),
    "a lone surrogate in the negative prompt": ({"negative_prompt": "blur \udfff"},
                                                ["--negative-prompt", "blur \udfff"],
                                                "is not valid Unicode text: character 6 is a lone surrogate (\\udfff); "
                                                "send UTF-8 text."),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_run_queue_and_serve_refuse_the_same_value_with_the_same_sentence(served, tmp_path, name):
    keys, options, sentence = BAD_VALUES[name]
    app, _ = served
    said = []
    options = options if "--prompt" in options else ["--prompt", "a fox", *options]
    code, _, err = run_dmap("run", *options, "-o", tmp_path / "one.png")
    assert code == 2 and "Traceback" not in err, err
    said.append(err.strip())
    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a fox", **keys}) + "\n")  # json.dumps writes a surrogate as \ud800
    code, _, err = run_dmap("run", "--prompts", queue, "-o", tmp_path / "out")
    assert code == 2 and "Traceback" not in err, err
    said.append(err.strip())
    status, data = post(app, {"prompt": "a fox", **keys})
    said.append(assert_one_sentence(status, data))
    for message in said:
        assert sentence in message and len(re.findall(r"\.( |$)", message)) == 1, said
    assert not (tmp_path / "one.png").exists() and not (tmp_path / "out").exists()
    _answers_normally(app)


def test_family_settings_share_the_bounds(tmp_path):
    """A family's own float settings (true_cfg_scale, guidance_scale_2, strength, ...) take the same check: a guidance
    scale from 0 to 1000, any other number within what every dtype holds; text settings must be encodable."""
    from dm_cli.errors import UsageError
    from dm_cli.families import Setting

    with pytest.raises(UsageError, match=r"^--true-cfg-scale must be a number from 0 to 1000, not 1e\+308\.$"):
        Setting("true_cfg_scale").check(1e308)
    with pytest.raises(UsageError, match="must be a number from -1000 to 1000"):
        Setting("frame_rate").check(1e300)
    with pytest.raises(UsageError, match="lone surrogate"):
        Setting("style", str).check("x\ud800")
    assert Setting("true_cfg_scale").check(4) == 4.0
    queue = tmp_path / "q.jsonl"
    queue.write_text(json.dumps({"prompt": "a", "true_cfg_scale": 1e308}) + "\n")
    code, _, err = run_dmap("run", "--prompts", queue, "-o", tmp_path / "out")
    assert code == 2 and "'true_cfg_scale' must be a number from 0 to 1000, not 1e+308." in err, err


def test_a_seed_of_5000_digits_is_out_of_range_not_json(served, tmp_path):
    app, _ = served
    digits = "9" * 5000
    status, data = post(app, f'{{"prompt": "a fox", "seed": {digits}}}'.encode())
    message = assert_one_sentence(status, data)
    assert "5,000 digits, which is out of range" in message and "not JSON" not in message, message
    _answers_normally(app)
    queue = tmp_path / "q.jsonl"
    queue.write_text(f'{{"prompt": "a fox", "seed": {digits}}}\n')
    code, _, err = run_dmap("run", "--prompts", queue, "-o", tmp_path / "out")
    assert code == 2 and "5,000 digits, which is out of range" in err, err


@pytest.mark.parametrize("raised, status", [(TypeError("the tokenizer choked"), 500),
                                            ("usage", 400)])
def test_a_request_that_fails_in_a_batch_fails_alone(tmp_path_factory, raised, status):
    """The hostile request waits ahead of an innocent one and they are batched: the batch fails, each request runs
    again alone, the innocent one gets the very bytes it gets alone, only the hostile one is refused (400 when the
    failure is a UsageError, the request's fault; 500 otherwise)."""
    from dm_cli.errors import UsageError
    from dm_cli.serve.requests import parse_request
    from dm_cli.serve.worker import Failure, Ticket

    with served_app(tmp_path_factory, start=False) as (app, state):
        real = state.batcher._compute

        def compute(pairs):
            if any("poison" in item.prompt for item, _ in pairs):  # a value no check foresaw, failing in the model
                raise UsageError("The poisoned request cannot run.") if raised == "usage" else raised
            yield from real(pairs)

        state.batcher._compute = compute
        answers = {}

        def ticket(name, body):
            request = parse_request(body, state.served, state.session)
            return Ticket(request, lambda result, name=name: answers.__setitem__(name, result))

        alone = ticket("alone", NORMAL)
        state.batcher.submit(alone)
        hostile, innocent = ticket("hostile", {"prompt": "poison", "seed": 1}), ticket("innocent", NORMAL)
        state.batcher.submit(hostile)
        state.batcher.submit(innocent)  # three requests waiting: the first batch takes them all
        state.batcher.start()
        end = time.monotonic() + 120
        while len(answers) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert state.batcher.counters["batches"] >= 2 and state.batcher.counters["batch_retries"] == 1
        assert isinstance(answers["hostile"], Failure) and answers["hostile"].status == status, answers
        assert isinstance(answers["innocent"], list) and isinstance(answers["alone"], list), answers
        assert answers["innocent"][0].data == answers["alone"][0].data
        _answers_normally(app)  # the worker goes on


"""Issue 40: served requests and queue items choose among the LoRA adapters loaded at start (`"lora": "NAME:SCALE"`,
a list of them, `[]` or `"none"`). Each image is `dmap run`'s with that set at those scales: the same pixels and
the same metadata (the adapters it ran with included) but the plan's digest, which names the plan made for every
adapter loaded. fp8 weights keep `dmap run`'s adapters unfused too (a fused adapter rounds otherwise). The value is
read by one parser on the three paths; a name not loaded, and a switch the plan fused away, are one sentence; the
server batches only requests with the same adapters; the plan counts every adapter loaded."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from conftest import run_dmap  # noqa: E402

from dm_cli.errors import UsageError  # noqa: E402

PROMPT, SEED, SIZE, STEPS = "a red fox", 3, 64, 2
ARGS = ["--height", SIZE, "--width", SIZE, "--steps", STEPS, "--mode", "staged", "--dtype", "float32",
        "--weights", "fp8"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(tiny FLUX.1 folder, fox-lora.safetensors, owl-lora.safetensors): two LoRAs of its transformer."""
    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("adapters")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    fox = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "fox-lora.safetensors",
                    diffusers.FluxPipeline, seed=1)
    owl = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "owl-lora.safetensors",
                    diffusers.FluxPipeline, seed=2)
    return folder, fox, owl


@pytest.fixture(scope="module")
def runs(adapters, tmp_path_factory):
    """`dmap run`'s image for each adapter set a request or an item chooses below."""
    folder, fox, owl = adapters
    out = tmp_path_factory.mktemp("runs")
    sets = {"fox:0.5": ["--lora", f"{fox}:0.5"], "none": [], "owl:0.8,fox:0.7": ["--lora", f"{owl}:0.8", "--lora", f"{fox}:0.7"]}
    made = {}
    for name, loras in sets.items():
        path = out / f"{name.replace(':', '_').replace(',', '+')}.png"
        code, _, err = run_dmap("run", folder, "-p", PROMPT, "--seed", SEED, *ARGS, *loras, "-o", path, "--quiet")
        assert code == 0, err
        made[name] = path
    return made


def _image(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.array(image), dict(image.text)


def _is_runs_image(data: bytes, path) -> dict:
    """`data` is the image `dmap run` wrote at `path`: its pixels, and its metadata but the plan's digest."""
    pixels, meta = _image(data)
    expected, expected_meta = _image(path.read_bytes())
    assert np.array_equal(pixels, expected)
    assert meta.pop("plan_digest") != expected_meta.pop("plan_digest")  # the plan made for both adapters
    assert meta == expected_meta
    return meta


def test_the_sets_differ(runs):
    """Each choice below makes its own image (a test of equality with a copy would prove nothing)."""
    images = [_image(path.read_bytes())[0] for path in runs.values()]
    assert all(not np.array_equal(a, b) for n, a in enumerate(images) for b in images[n + 1:])


def test_queue_items_choose_among_the_runs_adapters_each_as_dmap_run_makes_it(adapters, runs, tmp_path):
    folder, fox, owl = adapters
    prompts = tmp_path / "prompts.jsonl"
    # a name without a scale: the scale it was loaded with (fox's 0.7)
    items = [{"lora": "fox-lora.safetensors:0.5"}, {"lora": []}, {"lora": ["owl-lora:0.8", str(fox)]}, {}]
    prompts.write_text("".join(json.dumps({"prompt": PROMPT, "seed": SEED, **item}) + "\n" for item in items))
    out = tmp_path / "queue"
    code, stdout, err = run_dmap("run", folder, "--prompts", prompts, *ARGS, "--lora", f"{fox}:0.7", "--lora", owl,
                                 "-o", out, "--json")
    assert code == 0, err
    meta = _is_runs_image((out / "00000.png").read_bytes(), runs["fox:0.5"])
    assert meta["lora"].endswith(":0.5") and meta["lora_files"] == "fox-lora.safetensors"
    assert "lora" not in _is_runs_image((out / "00001.png").read_bytes(), runs["none"])
    meta = _is_runs_image((out / "00002.png").read_bytes(), runs["owl:0.8,fox:0.7"])
    assert meta["lora_files"] == "owl-lora.safetensors,fox-lora.safetensors"
    meta = _image((out / "00003.png").read_bytes())[1]  # no "lora": the run's own set at its scales
    assert meta["lora_files"] == "fox-lora.safetensors,owl-lora.safetensors" and "lora_fused" not in meta
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r.get("lora") for r in records] == [["fox-lora.safetensors:0.5"], None,
                                                 ["owl-lora.safetensors:0.8", "fox-lora.safetensors:0.7"],
                                                 ["fox-lora.safetensors:0.7", "owl-lora.safetensors:1"]]


def test_a_queue_item_naming_an_adapter_not_loaded_exits_2_naming_the_loaded_ones(adapters, tmp_path):
    folder, fox, owl = adapters
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "lora": "cat:0.5"}) + "\n")
    code, _, err = run_dmap("run", folder, "--prompts", prompts, *ARGS, "--lora", fox, "--lora", owl,
                            "-o", tmp_path / "q")
    assert code == 2 and "Traceback" not in err, err
    assert "the loaded ones are fox-lora.safetensors, owl-lora.safetensors" in err, err


def test_a_plan_that_fused_the_adapters_refuses_a_switch_in_one_sentence(adapters, tmp_path):
    """Fused adapters are merged into the weights and unloaded: nothing is left to switch."""
    folder, fox, owl = adapters
    plan = tmp_path / "plan.json"  # float weights, resident: the plan fuses
    code, _, err = run_dmap("plan", folder, "--height", SIZE, "--width", SIZE, "--dtype", "float32", "--lora", fox,
                            "--lora", owl, "-o", plan)
    assert code == 0, err
    assert all(entry["fused"] for entry in json.loads(plan.read_text())["loras"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "lora": "fox-lora"}) + "\n")
    code, _, err = run_dmap("run", folder, "-d", plan, "--prompts", prompts, "--steps", STEPS, "--lora", fox,
                            "--lora", owl, "-o", tmp_path / "q")
    assert code == 2 and "fused adapters cannot be switched per image" in err and "Traceback" not in err, err


@pytest.mark.parametrize("value,words", [
    (":1e999", "the scale must be a finite number, not 1e999"),
    (":-5000", "the scale -5000 is oversized"),
    (":nan", "the scale after ':' must be a finite number"),
])
def test_the_lora_value_is_read_by_one_parser_on_the_cli_a_queue_and_a_request(adapters, tmp_path, value, words):
    """`--lora FILE:SCALE`, a queue item's and a served request's "lora": "NAME:SCALE": the same sentence."""
    from dm_cli.serve.requests import parse_request

    folder, fox, _ = adapters
    code, _, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", "--lora", f"{fox}{value}")
    assert code == 2 and words in err, err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "lora": f"fox-lora{value}"}) + "\n")
    code, _, err = run_dmap("run", folder, "--prompts", prompts, "-o", tmp_path / "q")
    assert code == 2 and words in err and "'lora' fox-lora" in err, err
    served = SimpleNamespace(model="demo", width=SIZE, height=SIZE, video=False, max_n=10)
    with pytest.raises(UsageError, match=words.replace("(", r"\(")) as refused:
        parse_request({"prompt": PROMPT, "lora": [f"fox-lora{value}"]}, served, None)
    assert str(refused.value).startswith("The request: 'lora' fox-lora")


def test_the_server_batches_only_requests_with_the_same_adapters():
    """Waiting A(fox), B(owl), C(fox), D(fox): the oldest heads each batch, with the later ones of its set."""
    from dm_cli.inputs import Generation
    from dm_cli.run.sessions.queue import QueueItem
    from dm_cli.serve.worker import Batcher, Output, Ticket

    batches = []

    def compute(pairs):
        batches.append([item.prompt for item, _ in pairs])
        for item, _ in pairs:
            yield item.index, Output(item.index, 0, b"", 0.0)

    answered = []
    batcher = Batcher(compute, 16, 8)
    for name, adapters in (("A", ("fox",)), ("B", ("owl",)), ("C", ("fox",)), ("D", ("fox",)), ("E", ())):
        item = QueueItem(0, name, 0, "0.png", Generation(steps=1))
        batcher.submit(Ticket(SimpleNamespace(items=(item,), output_format="PNG", adapters=adapters), answered.append))
    batcher.start()
    try:
        from test_serve import _until

        assert _until(lambda: len(answered) == 5, 30)
    finally:
        batcher.stop()
        batcher.join(10)
    assert batches == [["A", "C", "D"], ["B"], ["E"]]


def test_the_plan_counts_every_adapter_loaded_and_keeps_them_switchable(adapters):
    """A server's (or a choosing queue's) plan holds every adapter loaded, unfused, beside the layers it patches."""
    from dataclasses import replace

    from dm_cli.inputs import Generation, PlacementSpec
    from dm_cli.model.lora import read_loras
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    folder, fox, owl = adapters
    base = PlanOptions(PlacementSpec(max_memory="cpu=8GB"), generation=Generation(height=SIZE, width=SIZE), check=False)
    loras = read_loras([str(fox), f"{owl}:0.5"])
    bare = make_plan(str(folder), base)
    with_loras = replace(base.generation, loras=loras)
    switched = make_plan(str(folder), replace(base, generation=with_loras, switch_loras=True))
    fused = make_plan(str(folder), replace(base, generation=with_loras))
    added = switched.components["transformer"].weights_bytes - bare.components["transformer"].weights_bytes
    assert added == sum(entry["bytes"] for entry in switched.loras) > 0
    assert [entry["fused"] for entry in switched.loras] == [False, False]
    assert any("choose among the adapters per image" in warning for warning in switched.warnings)
    assert [entry["fused"] for entry in fused.loras] == [True, True]  # without switching: fused, as before


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import Server

    folder, fox, owl = adapters
    served = Server(tmp_path_factory, str(folder), "--dtype", "float32", "--weights", "fp8", "--queue-size", "4",
                    "--lora", f"{fox}:0.7", "--lora", str(owl))
    yield served
    served.stop()


def test_a_served_request_chooses_among_the_servers_adapters_each_as_dmap_run_makes_it(server, runs):
    for lora, made in (("fox-lora:0.5", "fox:0.5"), ("none", "none"),
                       (["owl-lora.safetensors:0.8", "fox-lora"], "owl:0.8,fox:0.7")):
        status, data = server.post({"prompt": PROMPT, "seed": SEED, "lora": lora})
        assert status == 200, data
        _is_runs_image(base64.b64decode(data["data"][0]["b64_json"]), runs[made])
    status, data = server.post({"prompt": PROMPT, "lora": "cat"})
    message = data["error"]["message"]
    assert status == 400 and "the loaded ones are fox-lora.safetensors, owl-lora.safetensors" in message, data
    assert message.startswith("The request chooses the LoRA cat") and "--" not in message, message

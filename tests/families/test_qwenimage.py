"""Qwen-Image: plans for the real model, true CFG, and `dmap run` pixel-identical to QwenImagePipeline."""

import json

import numpy as np
import pytest
from conftest import run_dmap

from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT, NEGATIVE = "a red fox in the snow", "blurry"
SIZE, STEPS, SEED = 32, 2, 7


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS_DIR / "tiny-qwenimage", tmp_path_factory.mktemp("qwen") / "tiny", seed=0)


def units(module, prefix=""):
    """Placement units in registration order: ModuleLists expanded, wherever they sit."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList):
            out += [f"{prefix}{name}.{i}" for i in range(len(child))]
        elif any(isinstance(m, torch.nn.ModuleList) for m in child.modules()):
            out += units(child, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def split(names, devices):
    per = -(-len(names) // len(devices))
    return {u: devices[i // per] for i, u in enumerate(names)}


def hand_plan(folder, n_devices):
    """The transformer and the text encoder's language model split over n devices; the vision tower on the first."""
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    comps = {c.name: c for c in resolve_source(str(folder)).components}
    maps = {n: {"": "cpu"} for n in comps}
    if n_devices:
        devices = list(range(n_devices))
        den = comps["transformer"]
        maps["transformer"] = split(units(build_on_meta(den.library, den.cls, den.config)), devices)
        te = comps["text_encoder"]
        names = units(build_on_meta(te.library, te.cls, te.config))
        maps["text_encoder"] = {u: devices[0] for u in names if u.startswith("model.visual")}
        maps["text_encoder"] |= split([u for u in names if not u.startswith("model.visual")], devices[::-1])
        maps["vae"] = {"": devices[-1]}
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32", "strategy": "auto",
        "mode": "staged", "devices": {str(d): {"capacity_bytes": 10**9} for d in range(n_devices)} | {"cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1},
        "components": {n: {"class": comps[n].cls, "weights_bytes": 0, "device_map": maps[n]} for n in comps},
        "stages": [{"name": "encode", "components": ["text_encoder"], "peak_bytes": {}},
                   {"name": "denoise", "components": ["transformer"], "peak_bytes": {}},
                   {"name": "decode", "components": ["vae"], "peak_bytes": {}}],
    }


def oracle(folder, negative):
    pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPT, negative_prompt=negative, generator=torch.Generator().manual_seed(SEED),
                 num_inference_steps=STEPS, height=SIZE, width=SIZE).images[0]
    return np.array(image)


@pytest.mark.parametrize("negative", [None, NEGATIVE])
def test_run_is_pixel_identical_to_diffusers_unsplit_and_split(folder, tmp_path, negative):
    from PIL import Image

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    expected = oracle(folder, negative)
    for n_devices, simulate in ((0, False), (2, True), (3, True)):
        plan_path = tmp_path / f"plan-{n_devices}.json"
        plan_path.write_text(json.dumps(hand_plan(folder, n_devices)))
        out = tmp_path / f"{n_devices}.png"
        result = run(RunRequest.of(source=str(folder), prompt=PROMPT, negative_prompt=negative, device_map=str(plan_path),
                                steps=STEPS, height=SIZE, width=SIZE, seed=SEED, output=str(out), simulate=simulate))
        with Image.open(out) as image:
            pixels, text = np.array(image), dict(image.text)
        assert np.array_equal(pixels, expected), f"{n_devices} devices, negative={negative!r}"
        assert text["true_cfg_scale"] == "4.0" and text.get("negative_prompt") == negative
        if simulate:
            assert result.split_check and result.split_problems == [], result.split_problems
            assert set(map(str, range(n_devices))) <= set(result.device_peaks())


def test_true_cfg_runs_the_transformer_twice_per_step(folder, tmp_path, monkeypatch):
    """Two separate calls on the unchanged batch, not one call on a doubled batch."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    calls = []
    original = diffusers.QwenImageTransformer2DModel.forward

    def counting(self, hidden_states, *args, **kwargs):
        if hidden_states.device.type != "meta":  # not the planner's meta trace
            calls.append(hidden_states.shape[0])
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(diffusers.QwenImageTransformer2DModel, "forward", counting)
    for negative, scale, per_step in ((NEGATIVE, None, 2), (None, None, 1), (NEGATIVE, 1.0, 1)):
        calls.clear()
        run(RunRequest.of(source=str(folder), prompt=PROMPT, negative_prompt=negative, steps=STEPS,
                       settings={} if scale is None else {"true_cfg_scale": scale},
                       height=SIZE, width=SIZE, max_memory="cpu=8GB", output=None))
        assert calls == [1] * (STEPS * per_step), (negative, scale, calls)


def test_a_split_inside_a_qwen2_5_vl_layer_is_caught_and_layer_splits_pass(folder):
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import check_device_map

    source = resolve_source(str(folder))
    comp = source.component("text_encoder")
    good = {"model.visual": 0, "model.language_model.embed_tokens": 0, "model.language_model.layers.0": 0,
            "model.language_model.layers.1": 1, "model.language_model.norm": 1, "model.language_model.rotary_emb": 0,
            "lm_head": 1}
    inputs = InputSpec(SIZE, SIZE)
    assert check_device_map(comp, source.pipeline_class, inputs, "float32", good) == []
    bad = dict(good)
    bad["model.language_model.layers.1.self_attn.q_proj"] = 0  # q on GPU 0, k and v on GPU 1: attention mixes them
    problems = check_device_map(comp, source.pipeline_class, inputs, "float32", bad)
    assert problems and any("devices 0 and 1" in p for p in problems), problems


def test_refusals_name_the_family(folder, tmp_path):
    code, _, err = run_dmap("run", PRESETS_DIR / "tiny-sd15", "--prompt", PROMPT, "--true-cfg-scale", "4",
                             "--output", tmp_path / "no.png")
    assert code == 2 and "--true-cfg-scale" in err and "Qwen-Image" in err, err
    code, _, err = run_dmap("run", folder, "--prompt", PROMPT, "--height", 36, "--width", SIZE,
                             "--output", tmp_path / "no.png")
    assert code == 2 and "--height 36 is not a multiple of 8" in err and not (tmp_path / "no.png").exists()


def test_plan_qwen_image_traces_every_component_at_1024_and_fits_two_24gb_gpus():
    code, out, err = run_dmap("plan", "qwen-image", "--max-memory", "0=24GB,1=24GB,cpu=64GB", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert not [w for w in plan["warnings"] if "meta device" in w or "registration order" in w], plan["warnings"]
    assert all(c["activation_peak_bytes"] > 0 for c in plan["components"].values())
    assert plan["check"]["ran"] and plan["check"]["problems"] == [] and "transformer" in plan["check"]["components"]
    assert plan["inputs"]["height"] == 1024 and plan["dtype"] == "bfloat16"
    assert plan["offloaded_bytes"] == 0


def test_activation_estimate_of_a_reduced_qwen_image_transformer_matches_a_cpu_measurement():
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    config = measure_activations.reduced_qwenimage_config(heads=2, layers=2)
    measured, estimated = measure_activations.family_call_peaks("QwenImageTransformer2DModel", config,
                                                                "QwenImagePipeline", 256)
    assert measured > 1_000_000
    assert 0.8 <= estimated / measured <= 1.2, (estimated, measured)


def test_true_cfg_scale_reaches_the_api_and_queue_items(folder, tmp_path):
    """`true_cfg_scale` given to dm_cli.load(...).generate() and in a JSONL queue item: diffusers' pixels for it."""
    from PIL import Image

    import dm_cli

    pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    expected = np.array(pipe(PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=9.0, num_inference_steps=STEPS,
                             generator=torch.Generator().manual_seed(SEED), height=SIZE, width=SIZE).images[0])
    assert not np.array_equal(expected, oracle(folder, NEGATIVE))  # 9.0 is not the default 4.0's image
    with dm_cli.load(str(folder), max_memory="cpu=8GB", height=SIZE, width=SIZE) as session:
        (out,) = session.generate([PROMPT], seed=SEED, negative_prompt=NEGATIVE, steps=STEPS, true_cfg_scale=9.0)
    assert np.array_equal(np.array(out.image), expected) and out.metadata["true_cfg_scale"] == "9.0"
    line = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": SEED, "true_cfg_scale": 9.0, "output": "q.png"}
    (tmp_path / "queue.jsonl").write_text(json.dumps(line) + "\n")
    code, _, err = run_dmap("run", str(folder), "--prompts", str(tmp_path / "queue.jsonl"), "--steps", STEPS,
                            "--height", SIZE, "--width", SIZE, "--max-memory", "cpu=8GB", "--output", str(tmp_path / "q"),
                            "--json")
    assert code == 0, err
    with Image.open(tmp_path / "q" / "q.png") as image:
        assert np.array_equal(np.array(image), expected) and image.text["true_cfg_scale"] == "9.0"

"""Z-Image: exact sizes, plans for Z-Image-Turbo, CFG on a doubled batch, and `dmap run` pixel-identical to
ZImagePipeline unsplit and under --simulate splits."""

import json

import numpy as np
import pytest
from conftest import run_dmap

from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT, NEGATIVE = "a red fox in the snow", "blurry"
SIZE, STEPS, SEED = 32, 2, 7

# reference sizes.json (diffusers 0.42.1 / transformers 5.24.0, built on the meta device)
SIZES = {
    "z-image": {"text_encoder": ("Qwen3Model", 4_022_468_096),
                "transformer": ("ZImageTransformer2DModel", 6_154_908_736),
                "vae": ("AutoencoderKL", 83_819_683)},
    "tiny-zimage": {"text_encoder": ("Qwen3Model", 2_465_872),
                    "transformer": ("ZImageTransformer2DModel", 364_176),
                    "vae": ("AutoencoderKL", 680_371)},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS_DIR / "tiny-zimage", tmp_path_factory.mktemp("zimage") / "tiny", seed=0)


@pytest.mark.parametrize("preset", sorted(SIZES) + ["z-image-turbo"])
def test_inspect_counts_match_the_reference_exactly(preset):
    code, out, err = run_dmap("inspect", preset, "--json")
    assert code == 0, err
    got = {c["name"]: (c["class"], c["params"]) for c in json.loads(out)["components"]}
    assert got == SIZES.get(preset, SIZES["z-image"])


def hand_plan(folder, n_devices):
    """The transformer cut between its main layers: everything up to the first half of `layers` on device 0,
    the rest and the final layer on device 1 (the root joins image and caption tokens before the layers, so
    only there is a cut clean); the text encoder and the VAE whole on device 1."""
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    comps = {c.name: c for c in resolve_source(str(folder)).components}
    maps = {n: {"": "cpu"} for n in comps}
    if n_devices:
        den = comps["transformer"]
        model = build_on_meta(den.library, den.cls, den.config)
        half = len(model.layers) // 2
        maps["transformer"] = {name: 0 for name, _ in model.named_parameters(recurse=False)}
        for name, child in model.named_children():
            items = [f"{name}.{key}" for key in child.keys()] if isinstance(child, torch.nn.ModuleDict) else [name]
            if name == "layers":
                items = [f"layers.{i}" for i in range(len(child))]
            for item in items:
                late = item.startswith("all_final_layer") or item.startswith("layers.") and int(item[7:]) >= half
                maps["transformer"][item] = 1 if late else 0
        maps["text_encoder"] = maps["vae"] = {"": 1}
    devices = {str(d): {"capacity_bytes": 10**9} for d in range(n_devices)} | {"cpu": {"capacity_bytes": 10**10}}
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32", "strategy": "auto",
        "mode": "staged", "devices": devices, "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1},
        "components": {n: {"class": comps[n].cls, "weights_bytes": 0, "device_map": maps[n]} for n in comps},
        "stages": [{"name": "encode", "components": ["text_encoder"], "peak_bytes": {}},
                   {"name": "denoise", "components": ["transformer"], "peak_bytes": {}},
                   {"name": "decode", "components": ["vae"], "peak_bytes": {}}],
    }


def oracle(folder, negative, guidance):
    pipe = diffusers.ZImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    extra = {} if guidance is None else {"guidance_scale": guidance}
    image = pipe(PROMPT, negative_prompt=negative, generator=torch.Generator().manual_seed(SEED),
                 num_inference_steps=STEPS, height=SIZE, width=SIZE, **extra).images[0]
    return np.array(image)


@pytest.mark.parametrize("negative,guidance", [(None, None), (NEGATIVE, None), (None, 0.0)],
                         ids=["cfg-default", "cfg-negative", "turbo-no-cfg"])
def test_run_is_pixel_identical_to_diffusers_unsplit_and_split(folder, tmp_path, negative, guidance):
    from PIL import Image

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    expected = oracle(folder, negative, guidance)
    assert expected.std() > 0  # not a blank image that any run would match
    for n_devices, simulate in ((0, False), (2, True)):
        plan_path = tmp_path / f"plan-{n_devices}.json"
        plan_path.write_text(json.dumps(hand_plan(folder, n_devices)))
        out = tmp_path / f"{n_devices}.png"
        result = run(RunRequest.of(source=str(folder), prompt=PROMPT, negative_prompt=negative, device_map=str(plan_path),
                                steps=STEPS, height=SIZE, width=SIZE, seed=SEED, guidance_scale=guidance,
                                output=str(out), simulate=simulate))
        with Image.open(out) as image:
            pixels, text = np.array(image), dict(image.text)
        assert np.array_equal(pixels, expected), f"{n_devices} devices, negative={negative!r}, guidance={guidance}"
        assert float(text["guidance_scale"]) == (5.0 if guidance is None else guidance)
        if simulate:
            assert result.split_check and result.split_problems == [], result.split_problems
            assert {"0", "1"} <= set(result.device_peaks())


def test_cfg_doubles_the_transformer_batch_when_guidance_is_above_zero(folder, monkeypatch):
    """One call per step; with guidance_scale > 0 (the default 5.0) on conditional + unconditional items,
    with 0 (Z-Image-Turbo) on the prompt's alone: the planner's call spec says the same."""
    from dm_cli.families import call_spec, family_for
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    calls = []
    original = diffusers.ZImageTransformer2DModel.forward

    def counting(self, x, *args, **kwargs):
        if x[0].device.type != "meta":  # not the planner's meta trace
            calls.append(len(x))
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(diffusers.ZImageTransformer2DModel, "forward", counting)
    transformer = resolve_source(str(folder)).component("transformer")
    for guidance, batch in ((None, 2), (0.0, 1), (1.0, 2)):
        calls.clear()
        run(RunRequest.of(source=str(folder), prompt=PROMPT, steps=STEPS, guidance_scale=guidance, height=SIZE, width=SIZE,
                       max_memory="cpu=8GB", output=None))
        assert calls == [batch] * STEPS, (guidance, calls)
        spec = call_spec(transformer, "ZImagePipeline", InputSpec(SIZE, SIZE, guidance_scale=guidance))
        assert spec.kwargs["x"].shape[0] == spec.kwargs["cap_feats"].shape[0] == batch
    family = family_for("ZImagePipeline")
    assert family.denoiser_calls(InputSpec(SIZE, SIZE)) == 1


def test_defaults_and_size_rules_are_the_pipelines(folder, tmp_path):
    code, out, err = run_dmap("plan", "z-image", "-m", "0=80GB,cpu=64GB", "--height", "1000", "--width", "1024")
    assert code == 2 and "--height 1000 is not a multiple of 16" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_dmap("run", folder, "--prompt", PROMPT, "--height", 34, "--width", SIZE,
                            "--output", tmp_path / "no.png")
    assert code == 2 and "--height 34 is not a multiple of 4" in err and not (tmp_path / "no.png").exists(), err
    code, _, err = run_dmap("run", "z-image", "--prompt", PROMPT, "--output", tmp_path / "no.png")
    assert code == 2 and "preset" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def plans():
    out = {}
    for budget in ("0=12GB,cpu=32GB", "0=8GB,1=8GB"):
        code, text, err = run_dmap("plan", "z-image", "--max-memory", budget, "--json")
        assert code == 0, err
        out[budget] = json.loads(text)
    return out


@pytest.mark.parametrize("budget", ["0=12GB,cpu=32GB", "0=8GB,1=8GB"])
def test_plan_z_image_turbo_at_1024_fits_with_the_split_check_passed(plans, budget):
    plan = plans[budget]
    assert plan["inputs"]["height"] == plan["inputs"]["width"] == 1024 and plan["dtype"] == "bfloat16"
    assert plan["pipeline_class"] == "ZImagePipeline"
    assert not [w for w in plan["warnings"] if "meta device" in w or "no family" in w], plan["warnings"]
    assert all(c["activation_peak_bytes"] > 0 for c in plan["components"].values())
    assert plan["check"]["ran"] and plan["check"]["problems"] == [] and "transformer" in plan["check"]["components"]
    for stage in plan["stages"]:
        for device, peak in stage["peak_bytes"].items():
            assert peak <= plan["devices"][device]["capacity_bytes"], (stage["name"], device)
    transformer = plan["components"]["transformer"]
    if budget == "0=8GB,1=8GB":  # 12.3 GB of transformer over two 8 GB cards: split, nothing offloaded
        assert plan["offloaded_bytes"] == 0 and set(transformer["device_map"].values()) == {0, 1}
    else:  # one 12 GB card: what does not fit stays on the cpu, streamed block by block
        assert 0 < transformer.get("offloaded_bytes", 0) < transformer["weights_bytes"] / 2


def test_activation_estimate_of_a_reduced_z_image_transformer_matches_a_cpu_measurement():
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    config = json.loads((PRESETS_DIR / "z-image-turbo" / "transformer" / "config.json").read_text())
    config.update(dim=256, n_heads=2, n_kv_heads=2, n_layers=2, n_refiner_layers=1)  # Z-Image's 128-wide heads
    measured, estimated = measure_activations.family_call_peaks("ZImageTransformer2DModel", config, "ZImagePipeline", 256)
    assert measured > 1_000_000
    assert 0.8 <= estimated / measured <= 1.2, (estimated, measured)

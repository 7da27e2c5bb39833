"""Tiled VAE decode: planned only when the untiled decode does not fit (or offloads), recorded in the plan,
rendered, and followed by `dmap run` (pixel-identical to diffusers with `pipe.vae.enable_tiling()`)."""

import json

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.planning.plan_file import Plan, load_plan

torch = pytest.importorskip("torch")

# tiny-wan at 272x272 (above the Wan VAE's 256 px tile), 9 frames, fp32: the decode's activation estimate is
# 39.28 MB untiled and 37.08 MB tiled (2x2 tiles); the text encoder's stage needs 13.75 MB, the experts' 1.67 MB.
SIZE, FRAMES = 272, 9
TIGHT = "0=38.5MB"  # the VAE's weights (55 KB) + the tiled decode fit, the untiled one does not
PLAN_ARGS = ["--height", SIZE, "--width", SIZE, "--frames", FRAMES, "--dtype", "fp32", "--overhead", "0=0"]


def _plan(source, spec, *extra):
    code, out, err = run_dmap("plan", source, "--max-memory", spec, *PLAN_ARGS, *extra)
    return code, out, err


def test_a_decode_that_does_not_fit_untiled_is_planned_tiled_and_the_plan_says_so():
    code, out, err = _plan("tiny-wan", TIGHT, "--json")
    assert code == 0, err
    vae = json.loads(out)["components"]["vae"]
    assert vae["tiled_decode"] is True and vae["device_map"] == {"": 0}
    assert json.loads(out)["version"] == 2  # a reader that does not know tiling refuses it, not decodes untiled
    assert vae["untiled_activation_peak_bytes"] > vae["activation_peak_bytes"] > 0
    decode = json.loads(out)["stages"][-1]
    assert decode["name"] == "decode" and "vae: tiled decode" in decode["note"]
    assert decode["peak_bytes"]["0"] <= 38_500_000 < vae["weights_bytes"] + vae["untiled_activation_peak_bytes"]
    code, out, err = _plan("tiny-wan", TIGHT)
    assert code == 0, err
    text = " ".join(out.split())
    assert "vae: tiled decode, activations 37.08 MB instead of 39.28 MB" in text
    assert "vae decodes in tiles (AutoencoderKLWan.enable_tiling())" in text and "does not fit" in text


def test_a_decode_that_would_go_to_the_cpu_untiled_is_tiled_instead():
    code, out, err = _plan("tiny-wan", TIGHT + ",cpu=1GB", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["components"]["vae"]["tiled_decode"] is True and data["offloaded_bytes"] == 0
    assert any("would offload 55.44 KB instead of 0 B" in w for w in data["warnings"])


def test_a_decode_that_fits_is_never_tiled():
    code, out, err = _plan("tiny-wan", "0=1GB,cpu=1GB", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert "tiled_decode" not in data["components"]["vae"] and data["version"] == 1
    assert not any("tiles" in w for w in data["warnings"]) and "tiled" not in data["stages"][-1]["note"]


def test_a_vae_that_cannot_tile_is_named(monkeypatch, tmp_path):
    import dm_cli.planning.trace.trace

    monkeypatch.setattr(dm_cli.planning.trace.trace, "model_tiles", lambda model: False)  # a VAE class without enable_tiling
    monkeypatch.setenv("DMAP_CACHE_DIR", str(tmp_path))  # not the tiled trace other tests cached
    code, out, err = _plan("tiny-wan", TIGHT)
    assert code == 3 and "AutoencoderKLWan cannot decode in tiles (it has no enable_tiling)" in " ".join(err.split())
    code, out, err = _plan("tiny-wan", TIGHT + ",cpu=1GB", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["components"]["vae"]["device_map"] == {"": "cpu"} and "tiled_decode" not in data["components"]["vae"]
    assert any("AutoencoderKLWan cannot decode in tiles" in w for w in data["warnings"])


def test_which_classes_tile():
    from dm_cli.model.sources import ComponentSource, resolve_source
    from dm_cli.planning.trace.trace import can_tile

    wan = {c.name: c for c in resolve_source("tiny-wan").components}
    assert can_tile(wan["vae"]) and not can_tile(wan["text_encoder"]) and not can_tile(wan["transformer"])
    assert can_tile(resolve_source("tiny-sd15").component("vae"))  # AutoencoderKL
    temporal = ComponentSource("vae", "diffusers", "AutoencoderKLTemporalDecoder",
                               {"_class_name": "AutoencoderKLTemporalDecoder"}, None, None)
    assert not can_tile(temporal)


def test_the_tiled_trace_is_cached_apart_and_leaves_the_shared_meta_model_untiled():
    """tiny-sd15's AutoencoderKL tiles above its sample_size (32 px: latents above 16): 64x64 decodes in 4 tiles."""
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import _meta_model, trace_component

    vae = resolve_source("tiny-sd15").component("vae")
    inputs = InputSpec(64, 64)
    # traced here (not read from a warm cache), so the shared meta model really is tiled and untiled again
    tiled = trace_component(vae, "StableDiffusionPipeline", inputs, "fp32", tiled=True, use_cache=False)
    assert _meta_model(vae, "float32").use_tiling is False
    tiled = trace_component(vae, "StableDiffusionPipeline", inputs, "fp32", tiled=True)  # writes the cache entry
    untiled = trace_component(vae, "StableDiffusionPipeline", inputs, "fp32", use_cache=False)
    assert tiled.fallback_warning is None and 0 < tiled.activation_peak < untiled.activation_peak
    assert trace_component(vae, "StableDiffusionPipeline", inputs, "fp32", tiled=True).seconds == 0  # from the cache
    assert _meta_model(vae, "float32").use_tiling is False
    small = InputSpec(32, 32)  # one tile: tiling does not start, the same estimate
    assert trace_component(vae, "StableDiffusionPipeline", small, "fp32", tiled=True).activation_peak == \
        trace_component(vae, "StableDiffusionPipeline", small, "fp32").activation_peak


def test_plan_files_without_the_key_load_untiled_and_a_bad_value_is_refused(tmp_path):
    code, out, err = _plan("tiny-wan", TIGHT, "--json")
    data = json.loads(out)
    assert Plan.from_json(data).tiled_decode == {"vae": data["components"]["vae"]["untiled_activation_peak_bytes"]}
    del data["components"]["vae"]["tiled_decode"]
    assert Plan.from_json(data).tiled_decode == {}
    data["version"] = 3
    with pytest.raises(ValueError, match="not a dmap-plan v1 or v2 document"):
        Plan.from_json(data)
    data["version"] = 2
    data["components"]["vae"]["tiled_decode"] = "yes"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="tiled_decode must be true or false"):
        load_plan(tmp_path / "bad.json")


# --- dmap run follows the plan -------------------------------------------------------------------

PROMPT, STEPS, SEED = "a red fox in the snow", 2, 7


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    return write_random_pipeline(PRESETS_DIR / "tiny-wan", tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0)


def _tiled_decodes(monkeypatch):
    """Count the Wan VAE's tiled decodes (diffusers takes that path only with use_tiling and a frame above a tile)."""
    import diffusers

    calls = []
    original = diffusers.AutoencoderKLWan.tiled_decode

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.AutoencoderKLWan, "tiled_decode", counting)
    return calls


def test_run_with_a_tiled_plan_is_pixel_identical_to_diffusers_with_enable_tiling(tiny_wan, tmp_path, monkeypatch):
    import diffusers
    import numpy as np
    from PIL import Image

    from dm_cli.io.video import to_uint8

    plan_path = tmp_path / "plan.json"
    code, _, err = _plan(tiny_wan, TIGHT + ",cpu=1GB", "--output", plan_path)
    assert code == 0 and load_plan(plan_path).tiled_decode, err
    calls = _tiled_decodes(monkeypatch)
    code, _, err = run_dmap("run", tiny_wan, "--prompt", PROMPT, "--steps", STEPS, "--seed", SEED, "--device-map",
                            plan_path, "--simulate", "--output", tmp_path / "frames/")
    assert code == 0, err
    assert calls, "dmap run did not decode in tiles"
    sidecar = json.loads(next((tmp_path / "frames").glob("*.json")).read_text())
    assert sidecar.get("tiled_decode") == "vae", sidecar  # what a queue's resume compares
    got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / "frames").glob("frame-*.png"))])

    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    calls.clear()
    frames = pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                  generator=torch.Generator().manual_seed(SEED), output_type="np").frames
    assert calls and np.array_equal(got, to_uint8(frames[0]))


def test_run_refuses_a_plan_that_tiles_what_cannot_tile(tiny_wan, tmp_path, monkeypatch):
    plan_path = tmp_path / "plan.json"
    code, out, err = _plan(tiny_wan, TIGHT + ",cpu=1GB", "--json")
    data = json.loads(out)
    data["components"]["text_encoder"]["tiled_decode"] = True
    plan_path.write_text(json.dumps(data))
    args = ["run", tiny_wan, "--prompt", PROMPT, "--steps", 1, "--device-map", plan_path, "--simulate",
            "--output", tmp_path / "out/"]
    code, _, err = run_dmap(*args)
    assert code == 2 and "decodes 'text_encoder' in tiles, but T5EncoderModel cannot" in " ".join(err.split()), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    import dm_cli.planning.trace.trace

    del data["components"]["text_encoder"]["tiled_decode"]
    plan_path.write_text(json.dumps(data))
    monkeypatch.setattr(dm_cli.planning.trace.trace, "model_tiles", lambda model: False)  # a VAE class without enable_tiling
    code, _, err = run_dmap(*args)
    assert code == 2 and "decodes 'vae' in tiles, but AutoencoderKLWan cannot" in " ".join(err.split()), err


def test_dispatch_enables_tiling_where_the_plan_tiles(tiny_wan):
    """dm_cli.dispatch on a cpu-only plan whose decode fits only tiled: the pipeline's VAE tiles, nothing else."""
    import diffusers

    import dm_cli

    plan = dm_cli.plan(str(tiny_wan), max_memory="cpu=38.5MB", height=SIZE, width=SIZE, num_frames=FRAMES,
                       dtype="fp32")
    assert set(plan.tiled_decode) == {"vae"}
    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan)
    assert dm_cli.dispatch(pipe, plan) is pipe and pipe.vae.use_tiling is True
    untiled = dm_cli.plan(str(tiny_wan), max_memory="cpu=1GB", height=SIZE, width=SIZE, num_frames=FRAMES, dtype="fp32")
    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan)
    assert not untiled.tiled_decode and dm_cli.dispatch(pipe, untiled).vae.use_tiling is False

"""`dmap serve --cache` (and with a LoRA and fp8 weights): the features planned and applied as `dmap run`'s (one
Session, one code path), so a served image is `dmap run`'s file with the same options, byte for byte, metadata
(`step_cache`, `lora`) included."""

import base64

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import SEED, SIZE, Server  # noqa: E402  (after the skips: the server needs starlette and uvicorn)

STEPS = 6  # taylorseer's defaults compute the first 3 steps, then one in 5: some of 6 are predicted


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    served = Server(tmp_path_factory, "--cache", "taylorseer", "--queue-size", "2")
    yield served
    served.stop()


def test_a_served_image_with_a_cache_is_dmap_run_caches_file(cached_server, tmp_path):
    from conftest import run_dmap

    from dm_cli.io.outputs import read_metadata

    run = ["run", "-p", "a red fox", "--height", SIZE, "--width", SIZE, "--steps", STEPS, "--seed", SEED, "--mode",
           "staged", "--quiet"]
    code, _, err = run_dmap(*run, "--cache", "taylorseer", "-o", tmp_path / "cached.png")
    assert code == 0, err
    code, _, err = run_dmap(*run, "-o", tmp_path / "full.png")
    assert code == 0, err
    status, data = cached_server.post({"prompt": "a red fox", "seed": SEED, "steps": STEPS, "size": f"{SIZE}x{SIZE}",
                                       "response_format": "b64_json"})
    assert status == 200, data
    served = base64.b64decode(data["data"][0]["b64_json"])
    assert served == (tmp_path / "cached.png").read_bytes()
    assert served != (tmp_path / "full.png").read_bytes()
    assert read_metadata(tmp_path / "cached.png")["step_cache"].startswith("taylorseer")


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """(a server of tiny FLUX with magcache, a LoRA and fp8 weights, its folder, the options it was given)."""
    import diffusers
    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("composed")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    features = {"--cache": "magcache", "--lora": f"{lora}:0.7", "--weights": "fp8"}
    served = Server(tmp_path_factory, str(folder), "--dtype", "float32", "--queue-size", "2",
                    *[word for pair in features.items() for word in pair])
    yield served, folder, features
    served.stop()


def test_a_served_image_with_magcache_a_lora_and_fp8_is_dmap_runs_file(composed, tmp_path):
    """Each feature changes the image (dropping it gives other bytes), and all three together are dmap run's."""
    from conftest import run_dmap

    from dm_cli.io.outputs import read_metadata

    served_by, folder, features = composed
    steps = 8  # magcache skips some of 8 steps on FLUX (its ratios are FLUX's)
    run = ["run", folder, "-p", "a red fox", "--height", SIZE, "--width", SIZE, "--steps", steps, "--seed", SEED,
           "--mode", "staged", "--dtype", "float32", "--quiet"]

    def ran(name: str, dropped: str | None = None) -> bytes:
        given = [word for key, value in features.items() if key != dropped for word in (key, value)]
        code, _, err = run_dmap(*run, *given, "-o", tmp_path / name)
        assert code == 0, err
        return (tmp_path / name).read_bytes()

    status, data = served_by.post({"prompt": "a red fox", "seed": SEED, "steps": steps, "size": f"{SIZE}x{SIZE}",
                                   "response_format": "b64_json"})
    assert status == 200, data
    served = base64.b64decode(data["data"][0]["b64_json"])
    assert served == ran("all.png")
    meta = read_metadata(tmp_path / "all.png")
    assert meta["step_cache"].startswith("magcache") and "lora" in meta and "lora_fused" not in meta  # fp8: unfused
    for dropped in features:
        assert served != ran(f"without{dropped}.png", dropped), dropped

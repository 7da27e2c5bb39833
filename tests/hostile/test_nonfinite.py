"""A run whose latents turn NaN or infinite (issue 44, G and H): an all-NaN GGUF transformer used to run to exit 0
and an all-black video. The denoising loop checks the latents after every step and stops at the first non-finite
one: exit 2, one sentence naming the step and the likely cause, no warning, nothing written."""

import warnings

import pytest
from conftest import run_dmap

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("gguf")

PROMPT, SIZE, FRAMES, STEPS = "a red fox in the snow", 32, 9, 2


@pytest.fixture(scope="module")
def nan_gguf(tmp_path_factory):
    """(tiny Wan 2.2 pipeline folder, a GGUF of its high-noise transformer whose every value is NaN)."""
    from original_layouts import wan_name, write_gguf
    from safetensors.torch import load_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("nonfinite")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan", root / "tiny-wan", seed=0)
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    original = {wan_name(k): torch.full_like(v, float("nan")) for k, v in state.items()}
    return folder, write_gguf(root / "all-nan-F32.gguf", original, "wan", lambda array: None)


def test_an_all_nan_gguf_stops_at_the_first_step_instead_of_writing_a_black_video(nan_gguf, tmp_path):
    folder, gguf_file = nan_gguf
    out = tmp_path / "video.webp"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_dmap("run", gguf_file, "--pipeline", folder, "-p", PROMPT, "--steps", STEPS,
                                "--height", SIZE, "--width", SIZE, "--frames", FRAMES, "-o", out)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"Denoising step 1 of {STEPS}" in err and "NaN or infinite weights in the denoiser" in err, err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert not out.exists() and not list(tmp_path.iterdir()), list(tmp_path.iterdir())

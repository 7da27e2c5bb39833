"""LTX-2 image-to-video: `--image` on any LTX-2 folder runs LTX2ImageToVideoPipeline, its first frame VAE-encoded in
its own stage; pixel- and audio-sample-identical to diffusers' own LTX2ImageToVideoPipeline call, unsplit and under
--simulate with the transformer split on two devices, and with the pipeline's default H.264 re-compression (PyAV); the
plan traces the per-token timestep; the activation estimates of the transformer (image-to-video) and of both decodes
within 20% of the CPU profiler."""

import json
from importlib.util import find_spec

import numpy as np
import pytest
from conftest import run_dmap
from test_ltx2 import FRAMES, PROMPT, SEED, SEQ, SIZE, STEPS, TEXT_TO_VIDEO_STAGES, _run, folder, hand_plan  # noqa: F401

from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

IMAGE_TO_VIDEO_STAGES = [TEXT_TO_VIDEO_STAGES[0], ("encode_image", ["vae"], ["image"], ["image_latents"]),
                         ("denoise", ["connectors", "transformer"], ["embeds", "image_latents"],
                          ["latents", "audio_latents"]), *TEXT_TO_VIDEO_STAGES[2:]]


@pytest.fixture(scope="module")
def first_frame(tmp_path_factory):
    """A 48x40 picture (resized to the video's 32x32 by the pipeline): a bright square on a gradient."""
    from PIL import Image

    pixels = np.zeros((40, 48, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, 48, dtype=np.uint8)[None, :]
    pixels[..., 2] = np.linspace(255, 0, 40, dtype=np.uint8)[:, None]
    pixels[8:24, 12:30] = 250
    path = tmp_path_factory.mktemp("frame") / "first.png"
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def oracle(folder, first_frame):  # noqa: F811
    """diffusers' own call, image_crf=0 (no re-compression: the run's own path; the default is tested below)."""
    from PIL import Image

    from dm_cli.io.video import to_uint8

    pipe = diffusers.LTX2ImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=Image.open(first_frame).convert("RGB"), prompt=PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE,
               num_inference_steps=STEPS, max_sequence_length=SEQ, image_crf=0,
               generator=torch.Generator().manual_seed(SEED), output_type="np")
    return to_uint8(out.frames[0]), out.audio[0].float().numpy(), pipe.vocoder.config.output_sampling_rate


def test_first_frame_run_is_pixel_and_audio_identical_unsplit_and_split(folder, first_frame, oracle, tmp_path):  # noqa: F811
    from PIL import Image

    from dm_cli.io.outputs import read_metadata
    from dm_cli.io.video import AUDIO_NAME, read_wav

    frames, audio, rate = oracle
    assert frames.std() > 0 and audio.std() > 0 and audio.shape[0] == 2
    split_plan = hand_plan(folder, tmp_path, IMAGE_TO_VIDEO_STAGES)
    for name, extra in (("unsplit", {"max_memory": "cpu=8GB", "mode": "staged"}),
                        ("split", {"device_map": split_plan, "simulate": True})):
        result = _run(folder, tmp_path / name, images=[str(first_frame)], settings={"image_crf": 0}, **extra)
        got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / name).glob("frame-*.png"))])
        assert np.array_equal(got, frames), (name, np.abs(got.astype(int) - frames).max())
        wave, got_rate = read_wav(tmp_path / name / AUDIO_NAME)
        assert got_rate == rate and np.array_equal(wave, audio), (name, np.abs(wave - audio).max())
        meta = read_metadata(str(tmp_path / name))
        assert meta["image_crf"] == "0" and meta["input_images"].startswith("48x40:"), meta
        loads = {s.name: s.load_s for s in result.stages}
        assert [s.name for s in result.plan.stages] == [s[0] for s in IMAGE_TO_VIDEO_STAGES]
        if extra.get("simulate"):
            assert result.plan.components["transformer"].is_split
            assert result.split_check and result.split_problems == [], result.split_problems
        else:  # staged: the VAE loaded for the first frame, freed, loaded again for the decode
            assert loads["encode_image"] > 0 and loads["decode"] > 0, loads


def test_a_text_to_video_plan_refuses_a_first_frame_and_the_crf_is_checked(folder, first_frame, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    from dm_cli.errors import UsageError

    with pytest.raises(UsageError, match="no encode_image stage.*plan again"):
        _run(folder, tmp_path / "old", images=[str(first_frame)], settings={"image_crf": 0}, simulate=True,
             device_map=hand_plan(folder, tmp_path))  # a plan made before image-to-video
    code, _, err = run_dmap("plan", "ltx-2", "--image-size", "768x512", "--image-crf", "60", "--max-memory", "0=80GB")
    assert code == 2 and "--image-crf must be from 0" in err and len(err.strip().splitlines()) == 1, err
    with monkeypatch.context() as patch:  # a machine without PyAV: the default re-compression is refused up front
        patch.setattr("dm_cli.families.ltx2.find_spec", lambda name: None)
        with pytest.raises(UsageError, match="PyAV, which is not installed: pip install av.*--image-crf 0"):
            _run(folder, tmp_path / "no-av", images=[str(first_frame)], max_memory="cpu=8GB")
    assert not (tmp_path / "old").exists() and not (tmp_path / "no-av").exists()


def test_the_default_crf_re_compresses_through_pyav_as_diffusers_does(folder, first_frame, oracle, tmp_path):  # noqa: F811
    """No --image-crf: the pipeline's default (33 for Gemma-3 checkpoints) through PyAV (a pinned dependency), pixel-
    and audio-identical to diffusers' own call with its default image_crf, and unlike the run without it."""
    from PIL import Image

    from dm_cli.io.outputs import read_metadata
    from dm_cli.io.video import AUDIO_NAME, read_wav, to_uint8

    assert find_spec("av") is not None, "PyAV is pinned (scripts/requirements-pinned.txt): pip install av==18.1.0"
    pipe = diffusers.LTX2ImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=Image.open(first_frame).convert("RGB"), prompt=PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE,
               num_inference_steps=STEPS, max_sequence_length=SEQ, generator=torch.Generator().manual_seed(SEED),
               output_type="np")
    frames, audio = to_uint8(out.frames[0]), out.audio[0].float().numpy()
    assert not np.array_equal(frames, oracle[0])  # the re-compression changed the first frame, and so the video
    _run(folder, tmp_path / "crf", images=[str(first_frame)], max_memory="cpu=8GB", mode="staged")
    got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / "crf").glob("frame-*.png"))])
    assert np.array_equal(got, frames), np.abs(got.astype(int) - frames).max()
    wave, _ = read_wav(tmp_path / "crf" / AUDIO_NAME)
    assert np.array_equal(wave, audio), np.abs(wave - audio).max()
    assert "image_crf" not in read_metadata(str(tmp_path / "crf"))  # the pipeline's default (its text encoder's)


def test_plan_with_a_first_frame_traces_a_timestep_per_video_token():
    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source

    source = resolve_source("ltx-2")
    inputs = InputSpec(512, 768, num_frames=121, fps=24, image_sizes=((768, 512),))
    spec = call_spec(source.component("transformer"), "LTX2Pipeline", inputs)
    assert spec.kwargs["hidden_states"].shape == (2, 16 * 16 * 24, 128)  # no tokens added: frame 0 is the image
    assert spec.kwargs["timestep"].shape == (2, 16 * 16 * 24) and spec.kwargs["audio_timestep"].shape == (2,)
    assert "latent frame 0 the first frame" in spec.description
    args = ("--frames", FRAMES, "--height", SIZE, "--width", SIZE, "--dtype", "float32", "--max-memory", "0=2MB,1=2MB,cpu=1GB",
            "--overhead", "0=0,1=0", "--json")
    plans = {}
    for name, extra in (("text", ()), ("image", ("--image-size", "48x40"))):
        code, out, err = run_dmap("plan", "tiny-ltx2", *args, *extra)
        assert code == 0, err
        plans[name] = json.loads(out)
    image = plans["image"]
    assert [(s["name"], s["components"]) for s in image["stages"]][1] == ("encode_image", ["vae"])
    assert image["check"]["ran"] and image["check"]["problems"] == []
    peak = {n: p["components"]["transformer"]["activation_peak_bytes"] for n, p in plans.items()}
    assert peak["image"] > peak["text"], peak  # the per-token timestep embedding and modulation


# --- activation estimates against the CPU profiler ----------------------------------------------------------------


def _measured_and_estimated(name: str, cls: str, config: dict, inputs, siblings: dict) -> tuple[int, int]:
    """(profiled, traced) activation peak of the call the family specifies for one component (float32, one thread),
    the component in a folder beside its siblings' configs (the calls read the VAE's and the audio VAE's)."""
    import sys
    import tempfile
    from pathlib import Path

    from conftest import REPO

    from dm_cli.families import call_spec
    from dm_cli.families.calls import TensorSpec
    from dm_cli.model.models import build_model
    from dm_cli.model.sources import ComponentSource
    from dm_cli.planning.trace.trace import trace_component

    sys.path.insert(0, str(REPO / "scripts"))
    from measure_activations import profiled_call_peak

    with tempfile.TemporaryDirectory() as root:
        for sibling, sibling_config in {**siblings, name: config}.items():
            (Path(root) / sibling).mkdir()
            (Path(root) / sibling / "config.json").write_text(json.dumps(sibling_config))
        library = "ltx2" if cls == "LTX2Vocoder" else "diffusers"  # as model_index.json names it
        comp = ComponentSource(name, library, cls, config, None, Path(root) / name)
        spec = call_spec(comp, "LTX2Pipeline", inputs)
        estimated = trace_component(comp, "LTX2Pipeline", inputs, "float32", use_cache=False).activation_peak
    torch.manual_seed(0)
    model = build_model(library, cls, config).eval()
    method = getattr(model, spec.method)

    def make(value):
        if isinstance(value, TensorSpec):
            if value.kind == "long":
                return torch.ones(value.shape, dtype=torch.long)
            return torch.rand(value.shape) if len(value.shape) <= 2 else torch.randn(value.shape)
        return value

    return profiled_call_peak(method, spec.kwargs, make=lambda kwargs: {k: make(v) for k, v in kwargs.items()}), estimated


def _reduced_configs() -> dict:
    """LTX-2's own configs with fewer layers and channels (heads kept 128 and 64 wide), so a CPU runs each call."""
    real = {n: json.loads((PRESETS_DIR / "ltx-2" / n / "config.json").read_text())
            for n in ("transformer", "vae", "audio_vae", "vocoder")}
    real["transformer"].update(num_layers=2, num_attention_heads=4, cross_attention_dim=512, audio_num_attention_heads=4,
                               audio_cross_attention_dim=256, caption_channels=256)
    real["vae"].update(decoder_block_out_channels=[32, 64, 128], decoder_layers_per_block=[1, 1, 1, 1],
                       block_out_channels=[32, 64, 128, 128], layers_per_block=[1, 1, 1, 1, 1])
    real["audio_vae"].update(base_channels=32, ch_mult=[1, 2, 2])
    real["vocoder"].update(hidden_channels=128)
    return real


def test_activation_estimates_match_the_cpu_profiler_for_image_to_video_and_both_decodes():
    """The transformer's image-to-video call, the video VAE decode, the audio VAE decode and the vocoder at 64x96, 25
    frames (4 latent frames, 25 audio latent frames): every estimate within 20% of the measured peak."""
    from dm_cli.inputs import InputSpec

    configs = _reduced_configs()
    inputs = InputSpec(64, 96, num_frames=25, fps=24, max_sequence_length=64, image_sizes=((96, 64),))
    ratios = {}
    for name, cls in (("transformer", "LTX2VideoTransformer3DModel"), ("vae", "AutoencoderKLLTX2Video"),
                      ("audio_vae", "AutoencoderKLLTX2Audio"), ("vocoder", "LTX2Vocoder")):
        measured, estimated = _measured_and_estimated(name, cls, configs[name], inputs, configs)
        assert measured > 100_000, (name, measured)
        ratios[name] = estimated / measured
    assert all(0.8 <= r <= 1.2 for r in ratios.values()), ratios

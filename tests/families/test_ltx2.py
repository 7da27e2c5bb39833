"""LTX-2: exact sizes, the frames rule, plans for LTX-2 at its defaults, and `dmap run` of the tiny twin pixel- and
audio-sample-identical to LTX2Pipeline, unsplit and under --simulate with the transformer split on two devices."""

import json

import numpy as np
import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a red fox in the snow"
SIZE, FRAMES, STEPS, SEED, SEQ = 32, 9, 2, 7, 16

# reference sizes.json (diffusers 0.42.1 / transformers 5.24.0, built on the meta device); tiny-ltx2's text encoder
# is dmap's own tiny Gemma-3 (the reference has none: diffusers' test loads one from the Hub)
SIZES = {
    "ltx-2": {"audio_vae": ("AutoencoderKLLTX2Audio", 53_248_146), "connectors": ("LTX2TextConnectors", 1_431_475_200),
              "text_encoder": ("Gemma3ForConditionalGeneration", 12_187_325_040),
              "transformer": ("LTX2VideoTransformer3DModel", 18_876_174_592),
              "vae": ("AutoencoderKLLTX2Video", 1_222_479_601), "vocoder": ("LTX2Vocoder", 55_592_802)},
    "tiny-ltx2": {"audio_vae": ("AutoencoderKLLTX2Audio", 2446), "connectors": ("LTX2TextConnectors", 27328),
                  "text_encoder": ("Gemma3ForConditionalGeneration", 53680),
                  "transformer": ("LTX2VideoTransformer3DModel", 38056),
                  "vae": ("AutoencoderKLLTX2Video", 28330), "vocoder": ("LTX2Vocoder", 12218)},
}


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_inspect_counts_match_the_reference_exactly(preset):
    code, out, err = run_dmap("inspect", preset, "--json")
    assert code == 0, err
    got = {c["name"]: (c["class"], c["params"]) for c in json.loads(out)["components"]}
    assert got == SIZES[preset]


def test_the_tiny_text_encoder_feeds_the_connectors_what_they_expect():
    text = json.loads((PRESETS_DIR / "tiny-ltx2" / "text_encoder" / "config.json").read_text())["text_config"]
    connectors = json.loads((PRESETS_DIR / "tiny-ltx2" / "connectors" / "config.json").read_text())
    assert text["hidden_size"] == connectors["caption_channels"] == 32
    assert text["num_hidden_layers"] + 1 == connectors["text_proj_in_factor"]


_WRITTEN: dict = {}  # the random-weight twin (and its oracle), made once per session for this module and the ones importing it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    if "tiny" not in _WRITTEN:  # tmp_path_factory's folders live for the session
        _WRITTEN["tiny"] = write_random_pipeline(PRESETS_DIR / "tiny-ltx2", tmp_path_factory.mktemp("ltx2") / "tiny",
                                                 seed=0)
    return _WRITTEN["tiny"]


@pytest.fixture(scope="module")
def oracle(folder):
    """diffusers' LTX2Pipeline on the twin: (frames, audio, rate), made once per session for this module and
    tests/planning/test_ltx2_split_plan.py (same folder, same call; the arrays are only read)."""
    from dm_cli.io.video import to_uint8

    if "oracle" not in _WRITTEN:
        pipe = diffusers.LTX2Pipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        out = pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                   max_sequence_length=SEQ, generator=torch.Generator().manual_seed(SEED), output_type="np")
        _WRITTEN["oracle"] = (to_uint8(out.frames[0]), out.audio[0].float().numpy(),
                              pipe.vocoder.config.output_sampling_rate)
    return _WRITTEN["oracle"]


def _run(folder, output, **extra):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    options = {"steps": STEPS, "height": SIZE, "width": SIZE, "seed": SEED, "num_frames": FRAMES,
               "max_sequence_length": SEQ, **extra}
    return run(RunRequest.of(source=str(folder), prompt=PROMPT, output=str(output), **options))


TEXT_TO_VIDEO_STAGES = [("encode", ["text_encoder"], ["prompt"], ["embeds"]),
                        ("denoise", ["connectors", "transformer"], ["embeds"], ["latents", "audio_latents"]),
                        ("decode", ["vae"], ["latents"], ["images"]),
                        ("decode_audio", ["audio_vae", "vocoder"], ["audio_latents"], ["audio"])]


def hand_plan(folder, tmp_path, stages=TEXT_TO_VIDEO_STAGES):
    """The transformer cut between its two blocks: block 1 on device 1, everything else on device 0 (the root mixes
    the output norm with scale_shift_table and the timestep embedding, so those stay together); the rest whole on
    device 1. `stages` (name, components, consumes, produces): by default the four of a plan made before LTX-2 took
    a first frame (no encode_image), which text-to-video still runs."""
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    comps = {c.name: c for c in resolve_source(str(folder)).components}
    maps = {n: {"": 1} for n in comps}
    den = comps["transformer"]
    model = build_on_meta(den.library, den.cls, den.config)
    maps["transformer"] = {name: 0 for name, _ in model.named_parameters(recurse=False)}
    for name, child in model.named_children():
        if name == "transformer_blocks":
            maps["transformer"].update({f"{name}.{i}": i for i in range(len(child))})
        else:  # parameterless ones too (norm_out): their hook brings block 1's output back to device 0
            maps["transformer"][name] = 0
    plan = {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32", "strategy": "auto",
        "mode": "staged", "devices": {"0": {"capacity_bytes": 10**9}, "1": {"capacity_bytes": 10**9},
                                      "cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1, "num_frames": FRAMES},
        "components": {n: {"class": comps[n].cls, "weights_bytes": 0, "device_map": maps[n]} for n in comps},
        "stages": [{"name": n, "components": c, "consumes": i, "produces": o, "peak_bytes": {}} for n, c, i, o in stages],
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_run_is_pixel_and_audio_identical_unsplit_and_split(folder, oracle, tmp_path):
    from PIL import Image

    from dm_cli.io.outputs import read_metadata
    from dm_cli.io.video import AUDIO_NAME, read_wav

    frames, audio, rate = oracle
    assert frames.std() > 0 and audio.std() > 0 and audio.shape[0] == 2  # not silence any run would match
    for name, extra in (("unsplit", {"max_memory": "cpu=8GB", "mode": "staged"}),
                        ("split", {"device_map": hand_plan(folder, tmp_path), "simulate": True})):
        result = _run(folder, tmp_path / name, **extra)
        got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / name).glob("frame-*.png"))])
        assert np.array_equal(got, frames), name
        wave, got_rate = read_wav(tmp_path / name / AUDIO_NAME)
        assert got_rate == rate and np.array_equal(wave, audio), (name, np.abs(wave - audio).max())
        meta = read_metadata(str(tmp_path / name))
        assert meta["audio_sample_rate"] == str(rate) and meta["fps"] == "24" and meta["frame_rate"] == "24.0"
        assert [s.name for s in result.plan.stages] == (  # the hand plan: one written before encode_image
            ["encode", "denoise", "decode", "decode_audio"] if extra.get("simulate") else
            ["encode", "encode_image", "denoise", "decode", "decode_audio"])
        if not extra.get("simulate"):  # staged, no first frame: the image-encode stage loads nothing, decode does
            loads = {s.name: s.load_s for s in result.stages}
            assert loads["encode_image"] == 0.0 and loads["decode"] > 0.0, loads
        if extra.get("simulate"):
            assert result.plan.components["transformer"].is_split
            assert result.split_check and result.split_problems == [], result.split_problems


def test_mp4_carries_the_audio_track(folder, tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    import subprocess

    import imageio_ffmpeg

    from dm_cli.io.video import probe_mp4, read_mp4_metadata

    _run(folder, tmp_path / "fox.mp4", max_memory="cpu=8GB")
    assert probe_mp4(tmp_path / "fox.mp4") == (FRAMES, (SIZE, SIZE))
    probe = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(tmp_path / "fox.mp4")],
                           capture_output=True, text=True).stderr
    assert "Audio: aac" in probe and "16000 Hz" in probe, probe
    assert read_mp4_metadata(tmp_path / "fox.mp4")["audio_sample_rate"] == "16000"


def test_frames_rule_is_refused_in_one_sentence(folder, tmp_path):
    code, _, err = run_dmap("plan", "ltx-2", "--frames", "120", "--max-memory", "0=80GB")
    assert code == 2 and "--frames 120 is not 8k+1" in err and "use 113 or 121" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(UsageError, match="--frames 8 is not 2k\\+1.*use 7 or 9"):  # the tiny VAE compresses 2 frames
        _run(folder, tmp_path / "no.mp4", num_frames=8)
    code, _, err = run_dmap("plan", "ltx-2", "--height", "500", "--max-memory", "0=80GB")
    assert code == 2 and "--height 500 is not a multiple of 32" in err, err
    assert not list(tmp_path.iterdir())


def test_call_specs_cover_the_joint_sequence_and_both_decodes():
    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source

    source = resolve_source("ltx-2")
    inputs = InputSpec(512, 768, num_frames=121, fps=24)
    spec = call_spec(source.component("transformer"), "LTX2Pipeline", inputs)
    assert spec.kwargs["hidden_states"].shape == (2, 16 * 16 * 24, 128)  # CFG: a doubled batch
    assert spec.kwargs["audio_hidden_states"].shape == (2, 126, 128)  # 121 / 24 s at 25 audio latents a second
    assert spec.kwargs["encoder_hidden_states"].shape == (2, 1024, 3840)
    assert call_spec(source.component("vae"), "LTX2Pipeline", inputs).kwargs["z"].shape == (1, 128, 16, 16, 24)
    assert call_spec(source.component("audio_vae"), "LTX2Pipeline", inputs).kwargs["z"].shape == (1, 8, 126, 16)
    assert call_spec(source.component("vocoder"), "LTX2Pipeline", inputs).kwargs["hidden_states"].shape == (
        1, 2, 501, 64)
    assert call_spec(source.component("connectors"), "LTX2Pipeline", inputs).kwargs[
        "text_encoder_hidden_states"].shape == (2, 1024, 3840 * 49)


def test_plan_of_the_tiny_twin_declares_the_audio_stages_and_traces_every_component():
    code, out, err = run_dmap("plan", "tiny-ltx2", "--frames", FRAMES, "--height", SIZE, "--width", SIZE,
                              "--dtype", "float32", "--max-memory", "0=2MB,1=2MB,cpu=1GB", "--overhead", "0=0,1=0",
                              "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert [s["name"] for s in plan["stages"]] == ["encode", "encode_image", "denoise", "decode", "decode_audio"]
    assert [s["produces"] for s in plan["stages"]][1:] == [["image_latents"], ["latents", "audio_latents"], ["images"],
                                                           ["audio"]]
    assert plan["check"]["ran"] and plan["check"]["problems"] == []
    assert all(c["activation_peak_bytes"] > 0 for c in plan["components"].values())
    assert not [w for w in plan["warnings"] if "meta device" in w or "no family" in w], plan["warnings"]


def test_activation_estimate_of_a_reduced_ltx2_transformer_matches_a_cpu_measurement():
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    config = json.loads((PRESETS_DIR / "ltx-2" / "transformer" / "config.json").read_text())
    config.update(num_layers=2, num_attention_heads=4, cross_attention_dim=512, audio_num_attention_heads=4,
                  audio_cross_attention_dim=256, caption_channels=256)  # LTX-2's 128- and 64-wide heads
    measured, estimated = measure_activations.family_call_peaks("LTX2VideoTransformer3DModel", config, "LTX2Pipeline", 128)
    assert measured > 1_000_000
    assert 0.8 <= estimated / measured <= 1.2, (estimated, measured)

"""LTX-2 keyframes: `--image PATH@FRAME[:STRENGTH]` runs LTX2ConditionPipeline, every keyframe VAE-encoded in the
encode_image stage; pixel- and audio-sample-identical to diffusers' own LTX2ConditionPipeline call (its default
H.264 re-compression through PyAV included), unsplit and under --simulate with the transformer split on two devices;
the syntax ('@' in real paths), the frame rules and the other families' refusal, one sentence each; the tokens each
keyframe appends in the trace, within 20% of the CPU profiler for 0, 1 and 2 extra keyframes."""

import numpy as np
import pytest
from conftest import run_dmap
from test_ltx2 import FRAMES, PROMPT, SEED, SEQ, SIZE, STEPS, _run, folder, hand_plan  # noqa: F401
from test_ltx2_i2v import IMAGE_TO_VIDEO_STAGES, _measured_and_estimated, _reduced_configs

from dm_cli.errors import UsageError
from dm_cli.inputs import Generation, InputImage, InputSpec

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

# the tiny VAE encodes 2 frames into one latent frame: of 9 frames, keyframes go at 0, 1, 3, 5 or 7
KEYFRAMES = (("first.png", None, None), ("middle.png", 3, 0.8), ("last.png", 7, None))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Three 48x40 pictures (resized to cover the video's 32x32 and centre-cropped by the pipeline)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("keyframes")
    rng = np.random.default_rng(3)
    paths = []
    for name, _, _ in KEYFRAMES:
        pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        pixels[8:24, 12:30] = rng.integers(0, 256, 3, dtype=np.uint8)  # a flat square: something H.264 keeps
        Image.fromarray(pixels).save(root / name)
        paths.append(root / name)
    return paths


def _specs(pictures) -> list[str]:
    """The --image values: a plain path (frame 0), PATH@FRAME:STRENGTH, PATH@FRAME."""
    return [str(p) + ("" if frame is None else f"@{frame}") + ("" if strength is None else f":{strength}")
            for p, (_, frame, strength) in zip(pictures, KEYFRAMES)]


@pytest.fixture(scope="module")
def oracle(folder, pictures):  # noqa: F811
    """diffusers' own call with its default image_crf (33 for Gemma-3: H.264 through PyAV), and the same call with
    the first frame only (to show that the later keyframes change the video)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from PIL import Image

    from dm_cli.io.video import to_uint8

    pipe = diffusers.LTX2ConditionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    temporal = pipe.vae_temporal_compression_ratio
    conditions = [LTX2VideoCondition(frames=Image.open(p).convert("RGB"), index=0 if not f else (f - 1) // temporal + 1,
                                     strength=1.0 if s is None else s) for p, (_, f, s) in zip(pictures, KEYFRAMES)]
    outs = [pipe(conditions=chosen, prompt=PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE,
                 num_inference_steps=STEPS, max_sequence_length=SEQ, generator=torch.Generator().manual_seed(SEED),
                 output_type="np") for chosen in (conditions, conditions[:1])]
    (all_frames, first_only) = [to_uint8(out.frames[0]) for out in outs]
    return all_frames, outs[0].audio[0].float().numpy(), pipe.vocoder.config.output_sampling_rate, first_only


def test_keyframes_run_is_pixel_and_audio_identical_unsplit_and_split(folder, pictures, oracle, tmp_path):  # noqa: F811
    from PIL import Image

    from dm_cli.io.outputs import read_metadata
    from dm_cli.io.video import AUDIO_NAME, read_wav

    frames, audio, rate, first_only = oracle
    assert frames.std() > 0 and audio.std() > 0 and not np.array_equal(frames, first_only)  # the keyframes count
    split_plan = hand_plan(folder, tmp_path, IMAGE_TO_VIDEO_STAGES)
    for name, extra in (("unsplit", {"max_memory": "cpu=8GB", "mode": "staged"}),
                        ("split", {"device_map": split_plan, "simulate": True})):
        result = _run(folder, tmp_path / name, images=_specs(pictures), **extra)
        got = np.stack([np.array(Image.open(p)) for p in sorted((tmp_path / name).glob("frame-*.png"))])
        assert np.array_equal(got, frames), (name, np.abs(got.astype(int) - frames).max())
        wave, got_rate = read_wav(tmp_path / name / AUDIO_NAME)
        assert got_rate == rate and np.array_equal(wave, audio), (name, np.abs(wave - audio).max())
        meta = read_metadata(str(tmp_path / name))
        labels = meta["input_images"].split(",")  # the resume key: a keyframe moved to another frame is another job
        assert len(labels) == 3 and labels[0].startswith("48x40:") and "@" not in labels[0], meta
        assert labels[1].endswith("@3:0.8") and labels[2].endswith("@7"), meta
        assert [s.name for s in result.plan.stages] == [s[0] for s in IMAGE_TO_VIDEO_STAGES]
        if extra.get("simulate"):
            assert result.plan.components["transformer"].is_split
            assert result.split_check and result.split_problems == [], result.split_problems
        else:  # the run's own plan counts the two keyframes' tokens (16x16 latent pixels each); frame 0 adds none
            report = result.plan.input_images
            assert report["tokens"] == [0, 256, 256], report
            assert report["activation_peak_bytes"] > report["activation_peak_without_bytes"], report
            loads = {s.name: s.load_s for s in result.stages}
            assert loads["encode_image"] > 0 and loads["decode"] > 0, loads  # the VAE for the keyframes, then again


def test_keyframe_syntax_splits_only_a_parsable_suffix_of_a_path_that_is_not_a_file(pictures, tmp_path):
    import shutil

    from dm_cli.io.input_images import split_keyframe
    from dm_cli.run.request import input_images

    first = str(pictures[0])
    assert split_keyframe(first) == (first, None, None)
    assert split_keyframe(first + "@9") == (first, 9, None)
    assert split_keyframe(first + "@9:0.5") == (first, 9, 0.5) and split_keyframe(first + "@0:.25") == (first, 0, 0.25)
    odd = tmp_path / "shot@9"  # a real file whose name ends like the syntax is that file
    shutil.copy(first, odd)
    (image,) = input_images(str(odd))
    assert image.path == str(odd) and image.frame is None
    (image,) = input_images(f"{odd}@17")  # ...and takes a frame after a second '@'
    assert image.path == str(odd) and image.frame == 17
    assert split_keyframe("user@host/a.png") == ("user@host/a.png", None, None)  # no frame after the last '@'
    with pytest.raises(UsageError, match="does not exist"):
        input_images(str(tmp_path / "missing.png@9"))
    for bad in ("@x", "@-1", "@9:", "@9:0.5:1", "@1e3"):
        with pytest.raises(UsageError, match="after '@' give the frame index") as error:
            input_images(first + bad)
        assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match="strength must be a number above 0 and at most 1"):
        input_images(first + "@9:1.5")
    with pytest.raises(UsageError, match="strength must be a number above 0"):
        input_images(first + "@9:0")
    # the API's dict (its path taken as it is) and a PIL image at a frame
    from PIL import Image

    got = input_images([{"image": str(odd), "frame": 3, "strength": 0.5}, {"image": Image.open(first), "frame": 5}])
    assert [(i.path, i.frame, i.strength) for i in got] == [(str(odd), 3, 0.5), (None, 5, None)]
    with pytest.raises(UsageError, match="a keyframe is"):
        input_images([{"image": first, "frames": 3}])


def test_frame_rules_and_other_families_refuse_in_one_sentence(folder, pictures, tmp_path):  # noqa: F811
    first, second = str(pictures[0]), str(pictures[1])
    cases = [
        ([first + "@8"], [f"--image {first}@8 is at frame 8, which LTX-2 cannot condition: a keyframe goes at frame "
                          "0 or a frame 2k+1 up to 7 for --frames 9", ": use @7."]),
        ([first + "@4"], ["use @3 or @5."]),
        ([first + "@9"], ["is at frame 9, which", "use @7."]),
        ([first, second], [f"--image {first} and --image {second} are both at frame 0: LTX-2 conditions a frame on one "
                           "image"]),
        ([first + "@3", second + "@3:0.5"], ["are both at frame 3"]),
        ([first + "@x"], ["after '@' give the frame index"]),
    ]
    for images, messages in cases:
        args = [a for image in images for a in ("--image", image)]
        code, _, err = run_dmap("run", folder, "-p", PROMPT, *args, "--frames", FRAMES, "--height", SIZE, "--width",
                                SIZE, "--steps", STEPS, "-o", tmp_path / "no.mp4")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (images, err)
        assert all(message in err for message in messages), (images, err)
    assert not list(tmp_path.iterdir())
    from dm_cli.families import family_for

    keyframe = Generation(images=(InputImage(40, 24, frame=9),))
    for pipeline in ("FluxKontextPipeline", "Flux2Pipeline", "QwenImageEditPlusPipeline", "WanImageToVideoPipeline"):
        refusal = family_for(pipeline).refusal(keyframe)
        assert refusal and "take no frame index on an input image" in refusal and "drop @9" in refusal, refusal
    wan = family_for("WanImageToVideoPipeline")
    assert "drop @9" in wan.refusal(Generation(images=(InputImage(8, 8),), last_image=InputImage(8, 8, frame=9)))
    assert family_for("LTX2Pipeline").refusal(keyframe) is None


def test_keyframes_travel_through_plan_files_queue_items_and_the_resume_key(pictures, tmp_path):
    from dm_cli.run.sessions.queue import _item_images

    spec = InputSpec(512, 768, num_frames=121, image_sizes=((48, 40), (48, 40)), image_frames=(None, 113))
    data = spec.to_json()
    assert data["image_frames"] == [None, 113] and InputSpec.from_json(data) == spec
    assert "image_frames" not in InputSpec(512, 768, image_sizes=((48, 40),)).to_json()  # plans as they were
    with pytest.raises(UsageError, match="frame index"):
        InputSpec.from_json({**data, "image_frames": [None, -1]})
    items = _item_images([str(pictures[0]), str(pictures[1]) + "@3:0.8"], "line 1")  # a JSONL item's "image"
    assert [(i.frame, i.strength) for i in items] == [(None, None), (3, 0.8)]
    again = InputImage.from_json(items[1].to_json())
    assert again == items[1] and items[1].label == f"48x40:{items[1].digest}@3:0.8"
    assert items[0].to_json() == {"width": 48, "height": 40, "path": str(pictures[0]), "digest": items[0].digest}
    generation = Generation(images=items)
    assert generation.inputs().image_frames == (None, 3) and Generation(images=items[:1]).inputs().image_frames == ()


def test_dmap_plan_takes_keyframes_as_the_run_does(folder, pictures, tmp_path):  # noqa: F811
    import json

    args = ("plan", str(folder), "--height", SIZE, "--width", SIZE, "--frames", FRAMES, "-m", "cpu=8GB")
    code, out, err = run_dmap(*args, "--image", pictures[0], "--image", f"{pictures[1]}@7", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["inputs"]["image_frames"] == [None, 7] and plan["input_images"]["tokens"] == [0, 256], plan["inputs"]
    code, out, err = run_dmap(*args, "--image", f"{pictures[1]}@4")
    assert code == 2 and "at frame 4, which LTX-2 cannot condition" in err and "use @3 or @5" in err, err


# --- the tracer's view ----------------------------------------------------------------------------------------------


def test_each_keyframe_past_frame_0_appends_its_latent_frame_to_the_traced_sequence():
    from dm_cli.families import call_spec, family_for
    from dm_cli.model.sources import resolve_source

    transformer = resolve_source("ltx-2").component("transformer")
    frame_tokens = 16 * 24  # 512x768 / 32
    for frames, added, kind in (((None,), 0, "first frame"), ((0,), 0, "keyframe"), ((0, 113), 1, "keyframes"),
                                ((None, 9, 113), 2, "keyframes")):
        inputs = InputSpec(512, 768, num_frames=121, fps=24, image_sizes=((768, 512),) * len(frames),
                           image_frames=frames if any(f is not None for f in frames) else ())
        spec = call_spec(transformer, "LTX2Pipeline", inputs)
        total = 16 * frame_tokens + added * frame_tokens
        assert spec.kwargs["hidden_states"].shape == (2, total, 128), (frames, spec.kwargs["hidden_states"])
        assert spec.kwargs["timestep"].shape == (2, total) and spec.kwargs["audio_timestep"].shape == (2,)
        if frames == (None,):  # LTX2ImageToVideoPipeline, as before: the model builds its own positions
            assert "video_coords" not in spec.kwargs and "latent frame 0 the first frame" in spec.description
        else:
            assert spec.kwargs["video_coords"].shape == (2, 3, total, 2) and spec.kwargs["video_coords"].kind == "float32"
        assert (f"+ {added * frame_tokens} keyframe tokens" in spec.description) == bool(added), spec.description
        family = family_for("LTX2Pipeline")
        expected = tuple(frame_tokens if f else 0 for f in frames) if added else ()
        assert family.reference_tokens(inputs, None) == expected


def test_activation_estimates_match_the_cpu_profiler_for_0_1_and_2_extra_keyframes():
    """The transformer's LTX2ConditionPipeline call at 128x192, 25 frames (4 latent frames of 4x6 = 24 tokens each),
    with a keyframe at frame 0 and 0, 1 or 2 more (at 17, then 9 and 17): each estimate within 20% of the measured
    peak, and each extra keyframe raises both."""
    configs = _reduced_configs()
    measured, ratios = [], []
    for frames in ((0,), (0, 17), (0, 9, 17)):
        inputs = InputSpec(128, 192, num_frames=25, fps=24, max_sequence_length=64,
                           image_sizes=((192, 128),) * len(frames), image_frames=frames)
        got, estimated = _measured_and_estimated("transformer", "LTX2VideoTransformer3DModel", configs["transformer"],
                                                 inputs, configs)
        assert got > 100_000, got
        measured.append(got)
        ratios.append(round(estimated / got, 3))
    assert all(0.8 <= r <= 1.2 for r in ratios), ratios
    assert measured[0] < measured[1] < measured[2], measured


def test_a_plan_without_an_encode_image_stage_is_refused_for_keyframes(folder, pictures, tmp_path):  # noqa: F811
    with pytest.raises(UsageError, match="no encode_image stage.*plan again"):
        _run(folder, tmp_path / "old", images=[str(pictures[1]) + "@3"], simulate=True,
             device_map=hand_plan(folder, tmp_path))
    assert not (tmp_path / "old").exists()

"""Wan 2.2 image-to-video (WanImageToVideoPipeline: I2V-A14B, two experts, a first and optionally a last frame) and
TI2V-5B (WanPipeline with expand_timesteps: text-to-video, and image-to-video as WanImageToVideoPipeline): the VAE
encode of the conditioning video in its own stage, pixel-identical to diffusers' own call unsplit and with the
denoiser split over two simulated devices; --last-image through the CLI, the API and queue items; the rules; the
real presets' sizes; the encode's activation estimate against the CPU profiler."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_dmap

from dm_cli.errors import UsageError
from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT, SEED, FRAMES = "a red fox in the snow", 7, 5
STEPS = 2  # t = 999 (transformer) | 750 (transformer_2) with tiny-wan-i2v's boundary 0.875: the switch mid-run
I2V_SIZE, TI2V_SIZE = 32, 64  # multiples of 16 and of 32 (the Wan 2.2 VAE's 16x spatial x 2x2 patches)
SPLIT = {"max_memory": "0=400KB,1=400KB,cpu=1GB", "overhead": "0=0,1=0", "simulate": True}
# parameters per component (the reference sizes.json of the bundled configs)
SIZES = {
    "wan2.2-i2v": {"text_encoder": ("UMT5EncoderModel", 5_680_910_336), "transformer": ("WanTransformer3DModel", 14_288_901_184),
                   "transformer_2": ("WanTransformer3DModel", 14_288_901_184), "vae": ("AutoencoderKLWan", 126_892_531)},
    "wan2.2-ti2v": {"text_encoder": ("UMT5EncoderModel", 5_680_910_336), "transformer": ("WanTransformer3DModel", 4_999_787_712),
                    "vae": ("AutoencoderKLWan", 704_688_668)},
    "tiny-wan-i2v": {"text_encoder": ("T5EncoderModel", 68_000), "transformer": ("WanTransformer3DModel", 30_248),
                     "transformer_2": ("WanTransformer3DModel", 30_248), "vae": ("AutoencoderKLWan", 13_861)},
    "tiny-wan-ti2v": {"text_encoder": ("T5EncoderModel", 68_000), "transformer": ("WanTransformer3DModel", 34_600),
                      "vae": ("AutoencoderKLWan", 34_146)},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    root = tmp_path_factory.mktemp("wan-i2v")
    return {name: write_random_pipeline(PRESETS_DIR / name, root / name, seed=0) for name in ("tiny-wan-i2v", "tiny-wan-ti2v")}


@pytest.fixture(scope="module")
def frames_in(tmp_path_factory):
    """A first frame of another size than the video (the pipeline resizes it) and a last frame."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("frames")
    paths = {}
    for name, (height, width) in {"first": (40, 48), "last": (64, 64)}.items():
        ramp = np.linspace(0, 255, height * width * 3).reshape(height, width, 3)
        pixels = np.clip(ramp + rng.normal(0, 40, ramp.shape), 0, 255).astype(np.uint8)
        paths[name] = folder / f"{name}.png"
        Image.fromarray(pixels).save(paths[name])
    return paths


def oracle(folder, size, image=None, last=None, latents=False):
    """diffusers' own call: WanImageToVideoPipeline with a first frame (TI2V-5B's too, from its WanPipeline folder, as
    `WanImageToVideoPipeline.from_pretrained` loads it), WanPipeline from text alone."""
    from dm_cli.io.video import to_uint8

    cls = diffusers.WanImageToVideoPipeline if image is not None else diffusers.WanPipeline
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    frames = {"image": diffusers.utils.load_image(str(image))} if image is not None else {}
    if last is not None:
        frames["last_image"] = diffusers.utils.load_image(str(last))
    out = pipe(prompt=PROMPT, num_frames=FRAMES, height=size, width=size, num_inference_steps=STEPS,
               generator=torch.Generator().manual_seed(SEED), output_type="latent" if latents else "np", **frames).frames
    return out if latents else to_uint8(out[0])


def dmap_run(folder, out, size, **extra):
    """dmap run (the core of the CLI): the result and the expert named at each step."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    steps = []
    request = RunRequest.of(source=str(folder), prompt=PROMPT, steps=STEPS, height=size, width=size, seed=SEED,
                            num_frames=FRAMES, output=str(out), **extra)
    return run(request, on_step=lambda *args: steps.append(args[2])), steps


def written(folder: Path):
    from PIL import Image

    return np.stack([np.array(Image.open(p)) for p in sorted(folder.glob("frame-*.png"))])


def stages_of(result):
    return [(s.name, s.components) for s in result.plan.stages]


# --- I2V-A14B: a first frame, then first and last, experts switched mid-run -------------------------------------


@pytest.mark.slow
def test_i2v_first_frame_is_pixel_identical_unsplit_and_split(folders, frames_in, tmp_path):
    folder = folders["tiny-wan-i2v"]
    expected = oracle(folder, I2V_SIZE, frames_in["first"])
    result, experts = dmap_run(folder, tmp_path / "whole/", I2V_SIZE, images=[str(frames_in["first"])],
                               max_memory="cpu=8GB")
    assert stages_of(result) == [("encode", ["text_encoder"]), ("encode_image", ["vae"]),
                                 ("denoise", ["transformer", "transformer_2"]), ("decode", ["vae"])]
    assert experts == ["transformer", "transformer_2"]  # the switch at the boundary, mid-run
    assert np.array_equal(written(tmp_path / "whole"), expected)
    result, experts = dmap_run(folder, tmp_path / "split/", I2V_SIZE, images=[str(frames_in["first"])], **SPLIT)
    assert [c for name, c in stages_of(result) if name == "denoise"] == [["transformer"], ["transformer_2"]]
    assert result.plan.components["transformer"].is_split and result.plan.components["transformer_2"].is_split
    assert result.split_check and result.split_problems == []
    assert experts == ["transformer", "transformer_2"]
    assert np.array_equal(written(tmp_path / "split"), expected)


@pytest.mark.slow
def test_i2v_first_and_last_frame_through_cli_and_api_is_pixel_identical(folders, frames_in, tmp_path):
    """--last-image on the command line (unsplit) and `last_image=` of dm_cli.load (split on two simulated devices);
    the last frame changes the video, and its digest is in the metadata."""
    import dm_cli
    from dm_cli.io.outputs import read_metadata

    folder = folders["tiny-wan-i2v"]
    expected = oracle(folder, I2V_SIZE, frames_in["first"], frames_in["last"])
    assert not np.array_equal(expected, oracle(folder, I2V_SIZE, frames_in["first"]))
    code, _, err = run_dmap("run", folder, "--prompt", PROMPT, "--image", frames_in["first"], "--last-image",
                            frames_in["last"], "--frames", FRAMES, "--height", I2V_SIZE, "--width", I2V_SIZE, "--steps",
                            STEPS, "--seed", SEED, "--max-memory", "cpu=8GB", "--output", tmp_path / "cli/", "-q")
    assert code == 0, err
    assert np.array_equal(written(tmp_path / "cli"), expected)
    meta = read_metadata(str(tmp_path / "cli"))
    assert meta["last_image"].startswith("64x64:") and meta["input_images"].startswith("48x40:")
    with dm_cli.load(str(folder), height=I2V_SIZE, width=I2V_SIZE, num_frames=FRAMES, **SPLIT) as session:
        assert session.plan.components["transformer"].is_split
        (out,) = session.generate([PROMPT], seed=SEED, steps=STEPS, image=str(frames_in["first"]),
                                  last_image=str(frames_in["last"]))
    assert np.array_equal(np.asarray(out.image), expected)  # a video's frames, (F, H, W, 3) uint8
    assert out.metadata["last_image"] == meta["last_image"]


# --- TI2V-5B: text-to-video (WanPipeline, one timestep per token) and image-to-video -----------------------------


@pytest.mark.slow
def test_ti2v_text_to_video_is_pixel_identical_unsplit_and_split(folders, tmp_path):
    folder = folders["tiny-wan-ti2v"]
    expected = oracle(folder, TI2V_SIZE)
    for name, devices in (("whole/", {"max_memory": "cpu=8GB"}), ("split/", SPLIT)):
        result, experts = dmap_run(folder, tmp_path / name, TI2V_SIZE, **devices)
        assert ("encode_image", ["vae"]) in stages_of(result) and experts == [None] * STEPS
        assert np.array_equal(written(tmp_path / name), expected), name
    assert result.plan.components["transformer"].is_split and result.split_problems == []


@pytest.mark.slow
def test_ti2v_image_to_video_is_pixel_identical_unsplit_and_split(folders, frames_in, tmp_path):
    folder = folders["tiny-wan-ti2v"]
    expected = oracle(folder, TI2V_SIZE, frames_in["first"])
    assert not np.array_equal(expected, oracle(folder, TI2V_SIZE))
    for name, devices in (("whole/", {"max_memory": "cpu=8GB"}), ("split/", SPLIT)):
        result, _ = dmap_run(folder, tmp_path / name, TI2V_SIZE, images=[str(frames_in["first"])], **devices)
        assert result.plan.pipeline_class == "WanPipeline"
        assert np.array_equal(written(tmp_path / name), expected), name
    assert result.plan.components["transformer"].is_split and result.split_problems == []


def test_ti2v_trace_feeds_one_timestep_per_latent_token():
    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source

    source = resolve_source("wan2.2-ti2v")
    spec = call_spec(source.component("transformer"), "WanPipeline", InputSpec(704, 1280, num_frames=121))
    assert spec.kwargs["hidden_states"].shape == (1, 48, 31, 44, 80)
    assert spec.kwargs["timestep"].shape == (1, 31 * 22 * 40)
    a14b = call_spec(resolve_source("wan2.2-i2v").component("transformer"), "WanImageToVideoPipeline",
                     InputSpec(480, 832, num_frames=81))
    assert a14b.kwargs["hidden_states"].shape == (1, 36, 21, 60, 104) and a14b.kwargs["timestep"].shape == (1,)


# --- rules, one sentence each --------------------------------------------------------------------------------


@pytest.mark.parametrize("source,args,message", [
    ("tiny-wan-i2v", [], "Wan image-to-video needs an input image: add --image PATH."),
    ("tiny-wan-i2v", ["--last-image", "32x32"], "--last-image is the last frame of a video from a first frame"),
    ("tiny-wan-ti2v", ["--image-size", "64x64", "--last-image-size", "64x64"], "Wan pipelines take no last frame"),
    ("tiny-wan", ["--image-size", "64x64"], "Wan text-to-video pipelines take no input image"),
    ("tiny-flux", ["--last-image-size", "64x64"], "FLUX pipelines take no last frame"),
    ("tiny-wan-ti2v", ["--height", "48", "--width", "64"], "--height 48 is not a multiple of 32"),
])
def test_plan_refuses_what_the_pipeline_cannot_take(source, args, message):
    code, _, err = run_dmap("plan", source, "--max-memory", "cpu=8GB", "--frames", "5", *args)
    assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err, err


def test_plan_takes_the_first_and_last_frame_as_sizes():
    import dm_cli

    plan = dm_cli.plan("tiny-wan-i2v", max_memory="cpu=8GB", height=32, width=32, num_frames=5, image_size="48x40",
                       last_image="64x64", check=False, component="vae")
    assert plan.inputs.image_sizes == ((48, 40),) and plan.inputs.last_image_size == (64, 64)
    assert plan.to_json()["inputs"]["last_image_size"] == [64, 64]
    with pytest.raises(UsageError, match="not both"):
        dm_cli.plan("tiny-wan-i2v", max_memory="cpu=8GB", last_image="64x64", last_image_size="64x64")


def test_last_image_in_queue_items_metadata_and_the_resume_key(frames_in, tmp_path):
    from dataclasses import replace

    from dm_cli.families import Job
    from dm_cli.inputs import Generation
    from dm_cli.io.input_images import describe_image
    from dm_cli.run.sessions.outputs import job_metadata
    from dm_cli.run.sessions.queue import read_prompts, resume_keys

    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": PROMPT, "image": str(frames_in["first"]),
                                                  "last_image": str(frames_in["last"])}) + "\n")
    (item,) = read_prompts(tmp_path / "q.jsonl")
    assert item.last_image == describe_image(frames_in["last"]) and item.to_json()["last_image"]["width"] == 64
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": PROMPT, "last_image": [str(frames_in["last"])]}) + "\n")
    with pytest.raises(UsageError, match="'last_image' must be a path"):
        read_prompts(tmp_path / "bad.jsonl")
    job = Job.of(Generation(steps=STEPS, guidance_scale=5.0, height=32, width=32, num_images=1, images=item.images,
                            last_image=item.last_image), PROMPT, SEED)
    meta = job_metadata(job, "x", "WanImageToVideoPipeline", "d", False)
    assert meta["last_image"] == f"64x64:{item.last_image.digest}" and "last_image" in resume_keys()
    another = replace(job, generation=replace(job.generation, last_image=item.images[0]))
    other = job_metadata(another, "x", "WanImageToVideoPipeline", "d", False)
    assert other["last_image"] != meta["last_image"]  # another last frame is another job


def test_a_wan_2_1_image_encoder_is_refused(tmp_path):
    from dm_cli.families import family_for
    from dm_cli.inputs import Generation

    family = family_for("WanImageToVideoPipeline")
    refused = family.refusal(Generation(), ("text_encoder", "image_encoder", "transformer", "vae"))
    assert "CLIP image encoder (Wan 2.1 I2V)" in refused


# --- the real presets -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_inspect_counts_equal_the_reference_sizes(preset):
    code, out, err = run_dmap("inspect", preset, "--json")
    assert code == 0, err
    assert {c["name"]: (c["class"], c["params"]) for c in json.loads(out)["components"]} == SIZES[preset]


# --- the conditioning video's VAE encode: estimate against the CPU profiler -------------------------------------


@pytest.fixture(scope="module")
def measure_activations():
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    return measure_activations


@pytest.fixture(scope="module")
def full_wan_vae(measure_activations):
    """The full-width Wan VAE with random weights (seed 0), built once for both frame counts (its init is most of
    the profiled test's time; the encode does not change it)."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan.from_config(dict(measure_activations.WAN_VAE)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("frames", [9, 17])
def test_conditioning_encode_estimate_is_within_20_percent_of_the_profiler(frames, measure_activations, full_wan_vae):
    """The Wan VAE at full width (fp32, 32x32): the tracer's estimate of WanImageToVideoPipeline's encode of the
    conditioning video against torch.profiler's peak; and the traced decode of the same video needs more, which is
    why the VAE is traced for its decode and the encode_image stage planned with that peak."""

    from dm_cli.families.calls import CallSpec, TensorSpec
    from dm_cli.families.wan_i2v import conditioning_encode
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import ComponentSource
    from dm_cli.planning.trace import trace

    size = 32  # 64 and 128 measure the same ratio (1.000 at 9 and 17 frames) in two and eight times the time
    config = dict(measure_activations.WAN_VAE)
    comp = ComponentSource("vae", "diffusers", "AutoencoderKLWan", config, None, None)

    def traced(spec):
        model = trace._meta_model(comp, "float32")
        session = trace._Session(model, track_memory=True, replace_sdpa=True)
        trace._run(model, spec, "float32", session)
        return session.memory.peak[trace._META]

    encode = conditioning_encode(InputSpec(size, size, num_frames=frames), frames, ti2v=False)
    assert encode.kwargs["x"].shape == (1, 3, frames, size, size)
    estimate = traced(encode)
    decode = traced(CallSpec("decode", {"z": TensorSpec((1, 16, (frames - 1) // 4 + 1, size // 8, size // 8)),
                                        "return_dict": False}))
    measured = encode_profile_peak(full_wan_vae, frames, size, measure_activations.profile_peak)
    assert 0.8 <= estimate / measured <= 1.2, (estimate, measured)
    assert decode > estimate


def encode_profile_peak(vae, frames: int, size: int, profile_peak) -> int:
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)

        def call():
            video = torch.randn(1, 3, frames, size, size)
            out = vae.encode(video, return_dict=False)
            del out, video

        with torch.no_grad():
            call()  # warm-up outside the profiler
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                call()
        return profile_peak(prof)
    finally:
        torch.set_num_threads(threads)

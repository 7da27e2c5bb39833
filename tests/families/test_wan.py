"""Wan 2.2 (WanPipeline, two experts): sizes, frames, 5-D traces, expert-aware plans, video files."""

import json

import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError
from dm_cli.inputs import Generation, InputSpec, PlacementSpec
from dm_cli.model.sources import resolve_source
from dm_cli.planning.make import make_plan
from dm_cli.planning.plan_options import PlanOptions

pytest.importorskip("torch")

REAL = {"transformer": 14_288_491_584, "transformer_2": 14_288_491_584, "text_encoder": 5_680_910_336,
        "vae": 126_892_531}  # sizes.json, wan2.2-t2v-a14b


def test_inspect_lists_both_experts_with_exact_sizes():
    code, out, err = run_dmap("inspect", "wan2.2", "--json")
    assert code == 0, err
    data = json.loads(out)
    got = {c["name"]: c for c in data["components"]}
    assert data["pipeline_class"] == "WanPipeline"
    assert {n: c["params"] for n, c in got.items()} == REAL
    # bf16, except what diffusers keeps in fp32 (time_embedder, scale_shift_table, norms): ~59 MB more than 2 x params
    assert got["transformer"]["bytes"] == got["transformer_2"]["bytes"] == 28_636_399_744
    assert got["transformer"]["largest_block"]["class"] == "WanTransformerBlock"


@pytest.mark.parametrize("args,message", [
    (["--frames", "80"], "--frames 80 is not 4k+1"),
    (["--frames", "0"], "--frames must be a whole number >= 1"),
    (["--height", "72", "--width", "64"], "--height 72 is not a multiple of 16"),
    (["--fps", "0"], "--fps must be a whole number >= 1"),
])
def test_bad_video_inputs_are_one_sentence_and_exit_2(args, message):
    code, out, err = run_dmap("plan", "tiny-wan", "--max-memory", "0=1GB", *args)
    assert code == 2 and message in err and "Traceback" not in err, err
    if "80" in args:
        assert "use 77 or 81" in err


def test_frames_on_an_image_pipeline_is_refused():
    with pytest.raises(UsageError, match="make images, not videos"):
        make_plan("tiny-sd15", PlanOptions(PlacementSpec("0=1GB"), generation=Generation(height=64, width=64, num_frames=9)))


def test_trace_feeds_5d_latents_and_activations_follow_frames():
    from dm_cli.planning.trace.trace import trace_component

    source = resolve_source("tiny-wan")
    comps = {c.name: c for c in source.components}
    peaks = {}
    for frames in (5, 17):
        inputs = InputSpec(64, 96, num_frames=frames)
        transformer = trace_component(comps["transformer"], "WanPipeline", inputs, "fp32", use_cache=False)
        vae = trace_component(comps["vae"], "WanPipeline", inputs, "fp32", use_cache=False)
        assert transformer.fallback_warning is None and vae.fallback_warning is None
        latent_frames = (frames - 1) // 4 + 1
        assert transformer.inputs["kwargs"]["hidden_states"]["shape"] == [1, 16, latent_frames, 8, 12]
        assert vae.inputs["method"] == "decode" and vae.inputs["kwargs"]["z"]["shape"] == [1, 16, latent_frames, 8, 12]
        peaks[frames] = (transformer.activation_peak, vae.activation_peak)
    # the tiny transformer's peak is mostly the 512 text tokens; the decode grows by at least the 12 more
    # output frames (3 x 64 x 96 fp32 each)
    assert peaks[17][0] > peaks[5][0] and peaks[17][1] - peaks[5][1] >= 12 * 3 * 64 * 96 * 4


def test_a_split_separating_scale_shift_table_from_proj_out_passes_the_check():
    """diffusers PR #10997: scale_shift_table on GPU 0, proj_out on GPU 1. The model moves shift/scale
    explicitly, so the check passes; a split inside a block (which really fails) is still reported."""
    from dm_cli.planning.trace.trace import check_device_map

    comp = resolve_source("tiny-wan").component("transformer")
    inputs = InputSpec(32, 32, num_frames=5)
    first = {"scale_shift_table": 0, "rope": 0, "patch_embedding": 0, "condition_embedder": 0, "blocks.0": 0}
    good = first | {"blocks.1": 1, "norm_out": 1, "proj_out": 1}
    assert check_device_map(comp, "WanPipeline", inputs, "fp32", good) == []
    bad = first | {"blocks.1.norm1": 1, "blocks.1.attn1": 1, "blocks.1.attn2": 0, "blocks.1.norm2": 0,
                   "blocks.1.ffn": 1, "blocks.1.norm3": 1, "blocks.1.scale_shift_table": 0, "norm_out": 1, "proj_out": 1}
    assert check_device_map(comp, "WanPipeline", inputs, "fp32", bad)


@pytest.fixture(scope="module")
def wan_plans():
    """dmap plan wan2.2 at its defaults (480x832, 81 frames) on the three device sets of the issue."""
    specs = {"2x24": "0=24GB,1=24GB,cpu=128GB", "1x80": "0=80GB", "4x16": "0=16GB,1=16GB,2=16GB,3=16GB"}
    return {name: make_plan("wan2.2", PlanOptions(PlacementSpec(spec, dtype="bf16"), generation=Generation()))
            for name, spec in specs.items()}


@pytest.mark.parametrize("name", ["2x24", "1x80", "4x16"])
def test_wan22_plans_fit_and_check_at_81_frames(wan_plans, name):
    plan = wan_plans[name]
    assert (plan.inputs.height, plan.inputs.width, plan.inputs.num_frames) == (480, 832, 81)
    assert not [w for w in plan.warnings if "registration order" in w or "failed" in w], plan.warnings
    assert plan.check["ran"] and plan.check["problems"] == []
    assert all(plan.activation_peaks[c] > 0 for c in REAL)
    capacity = {d.name: d.capacity for d in plan.devices}
    for stage in plan.stages:
        assert all(peak <= capacity[key] for key, peak in stage.peak_bytes.items())
    assert plan.offloaded_bytes == 0
    covered = {c for s in plan.stages for c in s.components}
    assert covered == set(REAL)


def test_wan22_on_two_24gb_gpus_loads_one_expert_at_a_time(wan_plans):
    plan = wan_plans["2x24"]
    denoise = [s for s in plan.stages if s.name == "denoise"]
    assert [s.components for s in denoise] == [["transformer"], ["transformer_2"]]
    assert "transformer_2" in denoise[0].note and "freed" in denoise[1].note
    expert = 28_636_399_744  # bf16 with the fp32 modules
    for stage in denoise:  # one expert's weights, not two
        assert sum(u.weights for u in stage.use.values()) == expert
    assert plan.components["transformer"].is_split and set(plan.check["components"]) >= {"transformer", "transformer_2"}
    # the placement of diffusers PR #10997 (scale_shift_table on the first GPU, proj_out on the last) is checked
    device_map = plan.components["transformer"].device_map
    assert device_map["scale_shift_table"] != device_map["proj_out"]
    data = plan.to_json()
    assert [s["note"] for s in data["stages"] if s["name"] == "denoise"] == [s.note for s in denoise]


def test_wan22_on_one_80gb_gpu_keeps_both_experts(wan_plans):
    plan = wan_plans["1x80"]
    denoise = [s for s in plan.stages if s.name == "denoise"]
    assert len(denoise) == 1 and denoise[0].components == ["transformer", "transformer_2"]


def test_video_outputs_round_trip_with_metadata(tmp_path):
    import numpy as np
    from PIL import Image

    from dm_cli.io.outputs import read_metadata, save_video
    from dm_cli.io.video import to_uint8

    frames = to_uint8(np.random.default_rng(0).random((5, 16, 32, 3)))
    meta = {"prompt": "a fox; x=1", "seed": "7"}
    for name in ("v.webp", "v.gif", "frames/"):
        written = save_video(frames, str(tmp_path / name), 8, meta)
        assert json.loads((tmp_path / written[1].split(str(tmp_path) + "/")[1]).read_text()) == meta
        assert read_metadata(str(tmp_path / name.rstrip("/"))) == meta
    with Image.open(tmp_path / "v.webp") as image:  # lossless: the generated pixels
        got = []
        for index in range(image.n_frames):
            image.seek(index)
            got.append(np.array(image.convert("RGB")))
    assert np.array_equal(np.stack(got), frames)
    pngs = sorted((tmp_path / "frames").glob("frame-*.png"))
    assert len(pngs) == 5 and np.array_equal(np.array(Image.open(pngs[2])), frames[2])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    with pytest.raises(UsageError, match="not an empty folder: give a new folder or add --overwrite"):
        save_video(frames, str(tmp_path / "frames"), 8, meta)
    save_video(frames[:2], str(tmp_path / "frames"), 8, meta, overwrite=True)  # swapped in whole
    assert len(list((tmp_path / "frames").glob("frame-*.png"))) == 2
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose: written without --overwrite
    save_video(frames, str(tmp_path / "empty"), 8, meta)
    assert len(list((tmp_path / "empty").glob("frame-*.png"))) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(UsageError, match="out.mp4, out.webp"):
        save_video(frames, str(tmp_path / "v.avi"), 8, meta)


def test_mp4_through_export_to_video_with_metadata(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    import imageio.v3 as iio
    import numpy as np

    from dm_cli.io.outputs import read_metadata, save_video
    from dm_cli.io.video import to_uint8

    frames = to_uint8(np.random.default_rng(1).random((9, 32, 48, 3)))
    save_video(frames, str(tmp_path / "v.mp4"), 16, {"prompt": "a fox", "steps": "2"})
    assert iio.imread(tmp_path / "v.mp4").shape == (9, 32, 48, 3)
    assert read_metadata(str(tmp_path / "v.mp4")) == {"prompt": "a fox", "steps": "2"}


# --- dmap run tiny-wan: pixel-identical to WanPipeline, experts switched mid-run --------------------

PROMPT, SIZE, FRAMES, STEPS, SEED = "a red fox in the snow", 32, 9, 4, 7  # 4 steps: t = 999, 900 | 750, 500


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    """tiny-wan with random weights (fixed seed), offline T5 tokenizer; boundary_ratio 0.875 from the preset."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    return write_random_pipeline(PRESETS_DIR / "tiny-wan", tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0)


@pytest.fixture(scope="module")
def oracle_frames(tiny_wan):
    torch = pytest.importorskip("torch")
    import diffusers

    from dm_cli.io.video import to_uint8

    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                  generator=torch.Generator().manual_seed(SEED), output_type="np").frames
    return to_uint8(frames[0])


def _run(folder, tmp_path, name, steps=STEPS, **extra):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    calls = []
    request = RunRequest.of(source=str(folder), prompt=PROMPT, steps=steps, height=SIZE, width=SIZE, seed=SEED,
                         num_frames=FRAMES, output=str(tmp_path / name), **extra)
    return run(request, on_step=lambda *args: calls.append(args)), calls


def _frames(folder):
    import numpy as np
    from PIL import Image

    return np.stack([np.array(Image.open(p)) for p in sorted(folder.glob("frame-*.png"))])


def test_run_unsplit_is_pixel_identical_and_switches_experts_mid_run(tiny_wan, oracle_frames, tmp_path):
    import numpy as np

    from dm_cli.io.outputs import read_metadata

    result, calls = _run(tiny_wan, tmp_path, "frames/", max_memory="cpu=8GB")
    assert result.plan.mode == "resident" and not result.simulate
    assert np.array_equal(_frames(tmp_path / "frames"), oracle_frames)
    # the progress callback names the expert of every step: the switch happens mid-run
    assert [c[2] for c in calls] == ["transformer", "transformer", "transformer_2", "transformer_2"]
    meta = read_metadata(str(tmp_path / "frames"))
    assert meta["num_frames"] == str(FRAMES) and meta["fps"] == "16" and meta["plan_digest"] == result.plan_digest
    assert json.loads((tmp_path / "frames" / "metadata.json").read_text()) == meta


def test_run_staged_experts_split_on_two_simulated_gpus_never_holds_both(tiny_wan, oracle_frames, tmp_path,
                                                                       monkeypatch):
    import numpy as np

    from dm_cli.run.loops.stages import StageLoop

    held = []
    load_stage = StageLoop.load_stage

    def recording(self, names, stage=None):
        load_stage(self, names, stage)
        held.append(set(self.loaded))

    monkeypatch.setattr(StageLoop, "load_stage", recording)
    result, calls = _run(tiny_wan, tmp_path, "v.webp", max_memory="0=400KB,1=400KB,cpu=1GB", overhead="0=0,1=0",
                         simulate=True)
    denoise = [s for s in result.plan.stages if s.name == "denoise"]
    assert [s.components for s in denoise] == [["transformer"], ["transformer_2"]]
    assert result.plan.components["transformer"].is_split and result.plan.components["transformer_2"].is_split
    assert result.split_check and result.split_problems == []
    assert not any({"transformer", "transformer_2"} <= names for names in held)
    stages = [s for s in result.stages if s.name == "denoise"]
    assert [s.components for s in stages] == [["transformer"], ["transformer_2"]]
    # nothing of the high-noise expert is alive when the low-noise expert loads, on any device
    assert sum(stages[0].resident_after_load.values()) > 0 and all(v == 0 for v in stages[1].resident_before.values())
    assert [c[2] for c in calls] == ["transformer", "transformer", "transformer_2", "transformer_2"]
    from PIL import Image

    with Image.open(tmp_path / "v.webp") as image:  # lossless WebP: the generated pixels
        got = []
        for index in range(image.n_frames):
            image.seek(index)
            got.append(np.array(image.convert("RGB")))
    assert np.array_equal(np.stack(got), oracle_frames)


def test_an_expert_that_runs_no_step_is_never_loaded(tiny_wan, tmp_path, monkeypatch):
    """Two steps (t = 999, 750 with boundary 875): one each; one step: only the high-noise expert loads."""
    from dm_cli.run.loops.stages import StageLoop

    loaded = []
    load_stage = StageLoop.load_stage
    monkeypatch.setattr(StageLoop, "load_stage", lambda self, names, stage=None: (loaded.extend(names),
                                                                                  load_stage(self, names, stage)))
    result, calls = _run(tiny_wan, tmp_path, "one.gif", steps=1, max_memory="0=400KB,1=400KB,cpu=1GB",
                         overhead="0=0,1=0", simulate=True)
    assert [c[2] for c in calls] == ["transformer"] and "transformer_2" not in loaded
    assert (tmp_path / "one.gif").is_file() and (tmp_path / "one.gif.json").is_file()


def test_run_refuses_bad_frames_and_image_outputs_before_any_work(tiny_wan, tmp_path):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    with pytest.raises(UsageError, match="--frames 8 is not 4k\\+1"):
        run(RunRequest.of(source=str(tiny_wan), prompt=PROMPT, num_frames=8, output=str(tmp_path / "a.mp4")))
    with pytest.raises(UsageError, match="out.mp4, out.webp"):
        run(RunRequest.of(source=str(tiny_wan), prompt=PROMPT, num_frames=9, output=str(tmp_path / "a.png")))
    assert not list(tmp_path.iterdir())


def test_cli_run_writes_an_mp4_with_its_sidecar_and_refuses_to_overwrite(tiny_wan, tmp_path):
    pytest.importorskip("imageio_ffmpeg")

    from dm_cli.io.outputs import read_metadata

    out = tmp_path / "fox.mp4"
    args = ["run", tiny_wan, "--prompt", PROMPT, "--frames", FRAMES, "--height", SIZE, "--width", SIZE, "--steps", 2,
            "--fps", 8, "--max-memory", "cpu=8GB", "--output", out, "--json"]
    code, stdout, stderr = run_dmap(*args)
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["images"] == [str(out), str(out) + ".json"] and summary["num_frames"] == FRAMES
    meta = read_metadata(str(out))
    assert meta["fps"] == "8" and meta["num_frames"] == str(FRAMES) and meta["prompt"] == PROMPT
    assert json.loads((tmp_path / "fox.mp4.json").read_text()) == meta
    code, _, stderr = run_dmap(*args)
    assert code == 2 and "--overwrite" in stderr


def test_guidance_scale_2_guides_the_low_noise_expert_as_the_pipeline_does(tiny_wan, tmp_path):
    """Random tiny weights barely tell cond from uncond (1e-4 in the latents, nothing in uint8): compare latents."""
    torch = pytest.importorskip("torch")
    import diffusers

    from dm_cli.io.outputs import read_metadata

    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan)
    pipe.set_progress_bar_config(disable=True)

    def latents(**extra):
        return pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent",
                    generator=torch.Generator().manual_seed(SEED), **extra).frames

    expected, plain = latents(guidance_scale_2=50.0), latents()
    assert not torch.equal(expected, plain)
    result, _ = _run(tiny_wan, tmp_path, "g2/", max_memory="cpu=8GB", settings={"guidance_scale_2": 50.0})
    assert torch.equal(result.latents, expected)
    assert read_metadata(str(tmp_path / "g2"))["guidance_scale_2"] == "50.0" and result.settings["guidance_scale_2"] == 50.0
    # the same setting through dm_cli.load(...).generate() and in a JSONL queue item
    import dm_cli
    from dm_cli.run.sessions.queue import read_prompts

    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": PROMPT, "seed": SEED, "steps": STEPS,
                                                        "guidance_scale_2": 50.0}) + "\n")
    (item,) = read_prompts(tmp_path / "q.jsonl")
    with dm_cli.load(str(tiny_wan), max_memory="cpu=8GB", height=SIZE, width=SIZE, num_frames=FRAMES) as session:
        (api,) = session.generate([PROMPT], seed=SEED, steps=STEPS, guidance_scale_2=50.0)
        (queued,) = session.generate([item])  # a QueueItem carries its own steps and seed
    assert torch.equal(api.latents, expected) and api.metadata["guidance_scale_2"] == "50.0"
    assert torch.equal(queued.latents, expected) and queued.metadata["guidance_scale_2"] == "50.0"


def test_guidance_scale_2_is_refused_where_there_is_no_second_expert():
    from dm_cli.families import family_for
    from dm_cli.inputs import Generation

    asked = Generation().with_settings({"guidance_scale_2": 2.0})
    assert "two experts" in family_for("FluxPipeline").refusal(asked)
    assert family_for("WanPipeline").refusal(asked) is None
    code, _, err = run_dmap("run", "--prompts", "q.txt", "--guidance-scale-2", "2")
    assert code == 2 and "--guidance-scale-2" in err and "not --prompts" in err


def test_api_generate_runs_a_staged_plans_experts_one_at_a_time(tiny_wan, tmp_path):
    """dm_cli.load(...).generate on a plan with the experts in sub-stages: the same latents as dmap run."""
    torch = pytest.importorskip("torch")
    import dm_cli
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    devices = {"max_memory": "0=400KB,1=400KB,cpu=1GB", "overhead": "0=0,1=0", "simulate": True}
    with dm_cli.load(str(tiny_wan), None, height=SIZE, width=SIZE, num_frames=FRAMES, **devices) as pipe:
        assert [s.components for s in pipe.plan.stages if s.name == "denoise"] == [["transformer"], ["transformer_2"]]
        (out,) = pipe.generate([PROMPT], seed=SEED, steps=STEPS)
        assert pipe.stage_totals["denoise"]["loads"] == 2
    single = run(RunRequest.of(source=str(tiny_wan), prompt=PROMPT, steps=STEPS, height=SIZE, width=SIZE, seed=SEED,
                            num_frames=FRAMES, output=str(tmp_path / "v/"), **devices))
    assert torch.equal(out.latents, single.latents)


@pytest.fixture(scope="module")
def tiny_wan21(tiny_wan, tmp_path_factory):
    """Wan 2.1's layout: one transformer (model_index names transformer_2 as null, no boundary_ratio)."""
    import shutil

    folder = tmp_path_factory.mktemp("wan21") / "tiny-wan21"
    shutil.copytree(tiny_wan, folder, ignore=shutil.ignore_patterns("transformer_2"))
    index = json.loads((folder / "model_index.json").read_text())
    index.update(transformer_2=[None, None], boundary_ratio=None)
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_wan_2_1_one_transformer_is_pixel_identical_unsplit_and_split(tiny_wan21, tmp_path):
    """Wan 2.1 (one transformer for every step): dmap run equals WanPipeline, unsplit and on 2 simulated GPUs."""
    torch = pytest.importorskip("torch")
    import diffusers
    import numpy as np

    from dm_cli.io.video import to_uint8

    pipe = diffusers.WanPipeline.from_pretrained(tiny_wan21)
    assert pipe.transformer_2 is None
    pipe.set_progress_bar_config(disable=True)
    oracle = to_uint8(pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                           generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0])
    result, calls = _run(tiny_wan21, tmp_path, "whole/", max_memory="cpu=8GB")
    assert set(result.plan.components) == {"text_encoder", "transformer", "vae"}
    assert [c[2] for c in calls] == [None] * STEPS  # one denoiser: the progress names no expert
    assert np.array_equal(_frames(tmp_path / "whole"), oracle)
    result, _ = _run(tiny_wan21, tmp_path, "split/", max_memory="0=400KB,1=400KB,cpu=1GB", overhead="0=0,1=0",
                     simulate=True)
    assert result.plan.components["transformer"].is_split
    assert np.array_equal(_frames(tmp_path / "split"), oracle)
    code, _, err = run_dmap("run", tiny_wan21, "--prompt", PROMPT, "--frames", FRAMES, "--guidance-scale-2", "2",
                            "--output", tmp_path / "g2/")
    assert code == 2 and "--guidance-scale-2" in err, err

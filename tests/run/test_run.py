"""`dmap run`: pixel-identical to diffusers' own pipelines, split or not, and staged memory really freed."""

import json

import numpy as np
import pytest

from dm_cli.errors import CheckpointError, SourceError, UsageError
from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a red fox in the snow"
SIZE, STEPS, SEED = 32, 2, 7
DENOISER = {"FluxPipeline": "transformer", "StableDiffusion3Pipeline": "transformer"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny pipelines with random weights (fixed seed), offline tokenizers and scheduler configs."""
    from dm_cli.model.demo import write_random_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    cache = {}

    def get(preset):
        if preset not in cache:
            cache[preset] = write_random_pipeline(PRESETS_DIR / preset, root / preset, seed=0)
        return cache[preset]

    return get


def _components(folder):
    index = json.loads((folder / "model_index.json").read_text())
    return [n for n, v in index.items() if isinstance(v, list) and v[0] and "Tokenizer" not in v[1] and "Scheduler" not in v[1]]


def _units(model):
    """Top-level children in registration order, ModuleLists expanded: the blocks a split plan cuts between."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            units += [f"{name}.{i}" for i in range(len(child))]
        else:
            units.append(name)
    return units


def _split(units, devices):
    per = -(-len(units) // len(devices))
    return {u: devices[i // per] for i, u in enumerate(units)}


def hand_plan(folder, n_devices=0, mode="staged"):
    """A dmap-plan document written by hand: everything on cpu, or the denoiser (and text encoder) split."""
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    comps = {c.name: c for c in source.components}
    names = _components(folder)
    denoiser = "unet" if "unet" in names else "transformer"
    maps = {n: {"": "cpu"} for n in names}
    if n_devices:
        devices = list(range(n_devices))
        den = comps[denoiser]
        maps[denoiser] = _split(_units(build_on_meta(den.library, den.cls, den.config)), devices)
        maps["vae"] = {"": devices[-1]}
        te = comps["text_encoder"]
        encoder = build_on_meta(te.library, te.cls, te.config)
        inner, pre = (encoder.text_model, "text_model.") if hasattr(encoder, "text_model") else (encoder, "")
        layers = [f"encoder.layers.{i}" for i in range(len(inner.encoder.layers))]
        units = [pre + u for u in ("embeddings", *layers, "final_layer_norm")]
        if pre:
            units.append("text_projection")
        maps["text_encoder"] = _split(units, devices[::-1])
    encoders = [n for n in names if n.startswith("text_encoder")]
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32", "strategy": "auto", "mode": mode,
        "devices": {str(d): {"capacity_bytes": 10**9} for d in range(n_devices)} | {"cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1},
        "components": {n: {"class": comps[n].cls, "weights_bytes": 0, "device_map": maps[n]} for n in names},
        "stages": [{"name": "encode", "components": encoders, "peak_bytes": {}},
                   {"name": "denoise", "components": [denoiser], "peak_bytes": {}},
                   {"name": "decode", "components": ["vae"], "peak_bytes": {}}],
    }


def oracle(folder):
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


def dmap_run(folder, plan, tmp_path, simulate=False, name="out.png", **extra):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    plan_path = tmp_path / f"plan-{name}.json"
    plan_path.write_text(json.dumps(plan))
    request = RunRequest.of(source=str(folder), prompt=PROMPT, device_map=str(plan_path), steps=STEPS, height=SIZE,
                         width=SIZE, seed=SEED, output=str(tmp_path / name), simulate=simulate, **extra)
    return run(request)


def _png(path):
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image), dict(image.text)


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sdxl", "tiny-sd15", "tiny-sd3"])
def test_pixel_identical_to_diffusers_unsplit_and_simulated_splits(preset, folders, tmp_path):
    folder = folders(preset)
    expected = oracle(folder)
    for n_devices, simulate in ((0, False), (2, True), (3, True)):
        name = f"{n_devices}.png"
        result = dmap_run(folder, hand_plan(folder, n_devices), tmp_path, simulate=simulate, name=name)
        pixels, text = _png(tmp_path / name)
        assert pixels.shape == expected.shape
        assert np.array_equal(pixels, expected), f"{preset} with {n_devices} devices differs from diffusers"
        assert text["seed"] == str(SEED) and text["prompt"] == PROMPT and text["plan_digest"] == result.plan_digest
        assert text["steps"] == str(STEPS) and "dmap_version" in text and text["source"] == str(folder)
        if simulate:
            assert result.split_check and result.split_problems == [], result.split_problems
            # every virtual device measured something: weights and activations land where the plan puts them
            assert set(map(str, range(n_devices))) <= set(result.device_peaks())


def test_staged_frees_encoders_before_denoiser_and_load_ram_stays_near_shard(folders, tmp_path):
    from dm_cli.run.request import LOAD_RSS_MARGIN_BYTES

    folder = folders("tiny-flux")
    result = dmap_run(folder, hand_plan(folder, 2), tmp_path, simulate=True)
    stages = {s.name: s for s in result.stages}
    assert sum(stages["encode"].resident_after_load.values()) > 0
    # nothing of the encoders is alive when the denoiser starts loading, on any device
    assert all(v == 0 for v in stages["denoise"].resident_before.values())
    assert all(v == 0 for v in stages["decode"].resident_before.values())
    assert sum(stages["denoise"].resident_after_load.values()) > 0
    for stage in result.stages:
        # host RAM during a load: the weights that stay (on the CPU here) + at most one shard + margin
        kept = sum(stage.resident_after_load.values())
        assert stage.load_rss_delta - kept <= stage.largest_shard + LOAD_RSS_MARGIN_BYTES


def test_streamed_disk_offload_on_cpu_is_identical(folders, tmp_path):
    """cpu/disk blocks read from the original safetensors through accelerate hooks: same pixels."""
    folder = folders("tiny-sd15")
    plan = hand_plan(folder)
    unet_units = _units(diffusers.UNet2DConditionModel.from_config(
        diffusers.UNet2DConditionModel.load_config(folder / "unet")))
    plan["components"]["unet"]["device_map"] = {u: ("disk" if i % 2 else "cpu") for i, u in enumerate(unet_units)}
    result = dmap_run(folder, plan, tmp_path)
    assert np.array_equal(_png(tmp_path / "out.png")[0], oracle(folder))
    assert not list(folder.rglob("*.dat"))  # nothing re-saved
    assert "disk" not in result.device_peaks()  # disk holds weights: it has no memory peak


def test_refusals(folders, tmp_path):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    flux, sd15 = folders("tiny-flux"), folders("tiny-sd15")
    with pytest.raises(UsageError, match="another model"):
        dmap_run(flux, hand_plan(sd15), tmp_path)
    with pytest.raises(UsageError, match="--simulate"):
        dmap_run(flux, hand_plan(flux, 2), tmp_path)  # GPUs this machine lacks
    with pytest.raises(UsageError, match="height=32"):
        plan_path = tmp_path / "p.json"
        plan_path.write_text(json.dumps(hand_plan(flux)))
        run(RunRequest.of(source=str(flux), prompt=PROMPT, device_map=str(plan_path), height=64, width=64, output=None))
    assert not (tmp_path / "out.png").exists()


def test_missing_tokenizer_corrupt_weights_unsupported_pipeline(folders, tmp_path):
    import shutil

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    broken = tmp_path / "broken"
    shutil.copytree(folders("tiny-sd15"), broken)
    plan = hand_plan(broken)
    shutil.rmtree(broken / "tokenizer")
    with pytest.raises(SourceError, match="Tokenizer"):
        dmap_run(broken, plan, tmp_path)
    shutil.copytree(folders("tiny-sd15") / "tokenizer", broken / "tokenizer")
    weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError):
        dmap_run(broken, plan, tmp_path)
    index = json.loads((broken / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionUpscalePipeline"
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UsageError, match="StableDiffusionUpscalePipeline"):
        run(RunRequest.of(source=str(broken), prompt=PROMPT, device_map=str(tmp_path / "x.json")))


def test_cli_plans_then_runs_split_under_simulate(folders, tmp_path):
    from conftest import run_dmap

    folder = folders("tiny-flux")
    out = tmp_path / "cli.png"
    code, stdout, stderr = run_dmap(
        "run", folder, "--prompt", PROMPT, "--max-memory", "0=250KB,1=250KB,2=250KB,cpu=1GB", "--overhead", "0=0,1=0,2=0",
        "--steps", STEPS, "--height", SIZE, "--width", SIZE, "--seed", SEED, "--simulate", "--json", "--output", out,
        "--save-latents", tmp_path / "lat.safetensors",
    )
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["images"] == [str(out)] and summary["planned_here"] and summary["split_check"]
    assert np.array_equal(_png(out)[0], oracle(folder))
    assert (tmp_path / "lat.safetensors").is_file()
    code, _, stderr = run_dmap("run", folder, "--prompt", PROMPT, "--max-memory", "0=1GB,1=1GB", "--height", SIZE,
                               "--width", SIZE, "--steps", 1, "--output", tmp_path / "no.png")
    assert code == 2 and "--simulate" in stderr and not (tmp_path / "no.png").exists()


@pytest.mark.parametrize("preset,n_devices", [("tiny-flux", 0), ("tiny-sdxl", 2)])
def test_tracking_two_denoise_steps_measures_the_same_peak_as_every_step(preset, n_devices, folders, tmp_path, monkeypatch):
    """The activation tracker stops after step 2 of 4 (speed): the peaks must equal tracking every step."""
    import dm_cli.run.request as runner

    folder = folders(preset)
    plan = hand_plan(folder, n_devices)
    peaks = {}
    for tracked in (None, runner.TRACKED_STEPS):
        monkeypatch.setattr(runner, "TRACKED_STEPS", tracked)
        result = _run_steps(folder, plan, tmp_path, 4, bool(n_devices), f"{tracked}.png")
        stage = next(s for s in result.stages if s.name == "denoise")
        peaks[tracked] = stage.measured_peak
        assert stage.tracked == ("all" if tracked is None else f"first {tracked} of 4 steps")
    assert peaks[None] == peaks[runner.TRACKED_STEPS] and sum(peaks[None].values()) > 0


def _run_steps(folder, plan, tmp_path, steps, simulate, name):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    plan_path = tmp_path / f"plan-{name}.json"
    plan_path.write_text(json.dumps(plan))
    return run(RunRequest.of(source=str(folder), prompt=PROMPT, device_map=str(plan_path), steps=steps, height=SIZE,
                          width=SIZE, seed=SEED, output=str(tmp_path / name), simulate=simulate, track_activations=True))


def test_height_and_width_must_be_multiples_the_pipeline_accepts(folders, tmp_path):
    from conftest import run_dmap

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    with pytest.raises(UsageError, match=r"--height 36 is not a multiple of 8.*use 32 or 40"):
        run(RunRequest.of(source=str(folders("tiny-sd15")), prompt=PROMPT, height=36, width=32, output=None))
    code, _, stderr = run_dmap("run", folders("tiny-flux"), "--prompt", PROMPT, "--height", 32, "--width", 33,
                               "--output", tmp_path / "no.png")
    assert code == 2 and "--width 33 is not a multiple of 2" in stderr and not (tmp_path / "no.png").exists()


def test_plan_then_run_takes_the_plans_inputs_and_lists_every_mismatch(folders, tmp_path):
    from conftest import run_dmap

    folder = folders("tiny-sd15")
    plan = tmp_path / "p.json"
    # no sizes anywhere: plan and run share one default (the pipeline's)
    assert run_dmap("plan", folder, "-m", "cpu=2GB", "-o", plan, "-q")[0] == 0
    code, out, err = run_dmap("run", folder, "-p", PROMPT, "-d", plan, "--steps", 1, "-o", tmp_path / "a.png", "-q")
    assert code == 0, err
    # a plan for other inputs: the run takes them from it
    assert run_dmap("plan", folder, "-m", "cpu=2GB", "--height", 48, "--width", 32, "--num-images", 2,
                    "--dtype", "fp32", "-o", plan, "-q", "--overwrite")[0] == 0
    code, out, err = run_dmap("run", folder, "-p", PROMPT, "-d", plan, "--steps", 1, "-o", tmp_path / "b.png", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["height"], result["width"], result["num_images"]) == (48, 32, 2)
    assert _png(tmp_path / "b-1.png")[0].shape[:2] == (48, 32)
    # told otherwise: every mismatch in one message
    code, out, err = run_dmap("run", folder, "-p", PROMPT, "-d", plan, "--height", 64, "--width", 64,
                              "--num-images", 1, "--dtype", "fp16", "-o", tmp_path / "c.png")
    assert code == 2 and len(err.strip().splitlines()) == 1
    for mismatch in ("height=48", "width=32", "num_images=2", "float32"):
        assert mismatch in err, err
    assert not (tmp_path / "c.png").exists()


def test_run_refuses_an_existing_output_unless_overwrite(folders, tmp_path):
    from conftest import run_dmap

    folder = folders("tiny-sd15")
    out = tmp_path / "o.png"
    out.write_bytes(b"mine")
    args = ("run", folder, "-p", PROMPT, "--steps", 1, "--height", SIZE, "--width", SIZE, "-o", out, "-q")
    code, _, err = run_dmap(*args)
    assert code == 2 and "already exists" in err and "--overwrite" in err and out.read_bytes() == b"mine"
    code, stdout, err = run_dmap(*args, "--overwrite")
    assert code == 0 and out.read_bytes() != b"mine"
    assert stdout.strip() == f"Wrote {out}" and err == ""  # --quiet: only the written path


def test_a_preset_has_no_weights_and_run_says_so_before_importing_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom dm_cli.cli import main\ntry:\n    main(['run', 'flux', '-p', 'a fox'])\n"
            "except SystemExit as done:\n    print(done.code, 'torch' in sys.modules, 'diffusers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr
    assert "preset" in proc.stderr and "never weights" in proc.stderr


def test_plan_digest_depends_only_on_the_placement(monkeypatch):
    import dm_cli.planning.placement.budgets as budgets
    from dm_cli.inputs import Generation
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions
    from dm_cli.run.request import plan_digest

    plans = []
    for ram in (30 * 10**9, 31 * 10**9):
        monkeypatch.setattr(budgets, "available_ram", lambda ram=ram: ram)
        plans.append(make_plan("tiny-sd15", PlanOptions(generation=Generation(height=32, width=32))))
    assert plans[0].to_json()["devices"] != plans[1].to_json()["devices"]
    assert plan_digest(plans[0]) == plan_digest(plans[1])


def test_no_steps_offset_warning_from_a_bundled_tiny_pipeline(folders, tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmap_run(folders("tiny-sd15"), hand_plan(folders("tiny-sd15")), tmp_path)
    assert not [w for w in caught if "steps_offset" in str(w.message)]


def test_outputs_are_refused_as_settled_from_the_plan(tmp_path):
    """A plan made for 2 images writes out-0.png and out-1.png: those are what must not be replaced silently."""
    from conftest import run_dmap

    import dm_cli
    from dm_cli.planning.plan_file import write_plan

    plan = tmp_path / "p.json"
    write_plan(dm_cli.plan(None, height=64, width=64, num_images=2), plan)
    taken = tmp_path / "out-1.png"
    taken.write_bytes(b"mine")
    code, _, err = run_dmap("run", "-p", PROMPT, "-d", plan, "--steps", 1, "-o", tmp_path / "out.png")
    assert code == 2 and "out-1.png already exists" in err and taken.read_bytes() == b"mine"
    assert not (tmp_path / "out-0.png").exists()

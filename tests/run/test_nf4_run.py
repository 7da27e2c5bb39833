"""dmap run with --weights nf4 on this CPU: the layers bitsandbytes' 4-bit loading converts, quantized by
bitsandbytes' own Params4bit as diffusers' `create_quantized_param` does, give the pixels of the pipeline whose
components the libraries' own 4-bit loaders quantized (test_nf4.quantized_by_the_library), unsplit and split."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
bnb = pytest.importorskip("bitsandbytes")

from test_nf4 import quantized_by_the_library  # noqa: E402
from test_run import PROMPT, SEED, SIZE, STEPS, _png, dmap_run, folders, hand_plan  # noqa: E402,F401

NF4 = ("transformer", "text_encoder_2")


def oracle(folder, names=NF4, dtype="bfloat16"):
    """diffusers' pipeline with `names` swapped for their library-quantized twins."""
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    compute = getattr(torch, dtype)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=compute)
    pipe.set_progress_bar_config(disable=True)
    for name in names:
        setattr(pipe, name, quantized_by_the_library(source.component(name), folder, compute))
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


def nf4_plan(folder, n_devices=0, names=NF4, mode="staged"):
    plan = {**hand_plan(folder, n_devices, mode), "dtype": "bfloat16"}
    for name, comp in plan["components"].items():
        comp["storage_dtype"] = "uint8" if name in names else "bfloat16"
    return plan


@pytest.fixture(scope="module")
def expected(folders):
    return oracle(folders("tiny-flux"))


def test_nf4_run_is_pixel_identical_unsplit_and_split(expected, folders, tmp_path):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    folder = folders("tiny-flux")
    unsplit = run(RunRequest.of(source=str(folder), prompt=PROMPT, max_memory="cpu=4GB", steps=STEPS, height=SIZE,
                                width=SIZE, seed=SEED, output=str(tmp_path / "a.png"), dtype="bfloat16",
                                weights="transformer=nf4,text_encoder_2=nf4"))
    stored = {n: c["storage_dtype"] for n, c in unsplit.plan.to_json()["components"].items()}
    assert stored == {"text_encoder": "bfloat16", "text_encoder_2": "uint8", "transformer": "uint8", "vae": "bfloat16"}
    split = dmap_run(folder, nf4_plan(folder, 2), tmp_path, simulate=True, name="b.png")
    assert split.split_check and split.split_problems == []
    for name in ("a.png", "b.png"):
        assert np.array_equal(_png(tmp_path / name)[0], expected), name


def test_nf4_differs_from_bf16_and_resident_split_is_identical(expected, folders, tmp_path):
    folder = folders("tiny-flux")
    assert not np.array_equal(oracle(folder, names=()), expected)  # the 4-bit layers really change the pixels
    result = dmap_run(folder, nf4_plan(folder, 2, mode="resident"), tmp_path, simulate=True, name="r.png")
    assert result.plan.mode == "resident" and result.split_problems == []
    assert np.array_equal(_png(tmp_path / "r.png")[0], expected)


def test_nf4_offloaded_to_cpu_or_disk_is_refused_before_loading(folders, tmp_path, monkeypatch):
    import dm_cli.run.loops.stages
    from dm_cli.errors import UsageError

    folder = folders("tiny-flux")
    plan = nf4_plan(folder)
    plan["components"]["transformer"]["device_map"] = {"": "disk"}
    loaded = []
    monkeypatch.setattr(dm_cli.run.loops.stages, "load_component", lambda comp, *a, **k: loaded.append(comp.name) or 1 / 0)
    with pytest.raises(UsageError, match="nf4 weights cannot be streamed"):
        dmap_run(folder, plan, tmp_path)
    assert not loaded


def test_nf4_without_bitsandbytes_plans_and_refuses_to_run(folders, tmp_path, monkeypatch):
    import sys

    from dm_cli.errors import UsageError
    from dm_cli.inputs import Generation, PlacementSpec
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    plan = make_plan("tiny-flux", PlanOptions(PlacementSpec("cpu=1GB", weights="nf4"), generation=Generation(height=0, width=0), check=False))
    assert plan.to_json()["components"]["transformer"]["storage_dtype"] == "uint8"
    folder = folders("tiny-flux")
    with pytest.raises(UsageError, match="--weights nf4 needs bitsandbytes"):
        dmap_run(folder, nf4_plan(folder), tmp_path)


def test_a_lora_on_nf4_stays_unfused_in_peft_4bit_layers_identical_to_diffusers(tmp_path):
    pytest.importorskip("peft")
    from test_lora import PROMPT as LPROMPT
    from test_lora import SEED as LSEED
    from test_lora import SIZE as LSIZE
    from test_lora import STEPS as LSTEPS
    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR, resolve_source
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path / "tiny-flux", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", tmp_path / "fox-lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer = quantized_by_the_library(resolve_source(str(folder)).component("transformer"), folder)
    pipe.load_lora_weights(str(lora), adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    import peft.tuners.lora.bnb

    assert any(isinstance(m, peft.tuners.lora.bnb.Linear4bit) for m in pipe.transformer.modules())
    expected = np.array(pipe(LPROMPT, generator=torch.Generator().manual_seed(LSEED), num_inference_steps=LSTEPS,
                             height=LSIZE, width=LSIZE).images[0])
    result = run(RunRequest.of(source=str(folder), prompt=LPROMPT, seed=LSEED, steps=LSTEPS, height=LSIZE, width=LSIZE,
                               output=str(tmp_path / "lora.png"), max_memory="cpu=8GB", dtype="bfloat16",
                               weights="transformer=nf4", loras=[f"{lora}:0.7"]))
    assert result.plan.loras[0]["fused"] is False
    assert any("stored as nf4, which peft cannot merge into" in w for w in result.plan.warnings)
    assert np.array_equal(_png(tmp_path / "lora.png")[0], expected)


@pytest.mark.heavy
def test_nf4_slices_and_an_unfused_lora_on_two_pipeline_ranks_are_one_process_bytes(tmp_path):
    """--parallel pipeline: each torchrun rank loads and quantizes only its slice's NF4 layers (a queue of two, a LoRA
    in peft's 4-bit layers); the images are the bytes of one process running the same plan."""
    pytest.importorskip("peft")
    from pipeline_launch import pipeline_plan
    from test_pipeline_weights import _fused, _piped_and_single
    from test_pipeline_weights import flux as make_folder

    model, lora, queue = make_folder.__wrapped__(_Factory(tmp_path))
    features = ("--lora", f"{lora}:0.7")
    plan = pipeline_plan(tmp_path, model, 2, "nf4.json", "--weights", "transformer=nf4", "--dtype", "bfloat16", *features)
    assert _fused(plan) == [False]
    assert json.loads(plan.read_text())["components"]["transformer"]["storage_dtype"] == "uint8"
    _piped_and_single(tmp_path, model, plan, "--prompts", queue, *features)


class _Factory:
    """tmp_path_factory's one method, for calling a module fixture's body directly."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        path = self.root / name
        path.mkdir()
        return path


def test_nf4_with_a_step_cache_split_whole_and_api_are_the_same_pixels(folders, tmp_path):
    """--cache taylorseer on an NF4 transformer cut over two simulated GPUs: the split check with the hooks on finds
    nothing, and the image and skipped calls are the whole model's, which the Python API gives too."""
    from conftest import run_dmap
    from PIL import Image

    from dm_cli import load

    folder = folders("tiny-flux")
    common = ["--height", "32", "--width", "32", "--max-sequence-length", "8", "--weights", "transformer=nf4",
              "--dtype", "bfloat16"]
    cache = ["--cache", "taylorseer"]
    code, _, err = run_dmap("plan", folder, *common, *cache, "--max-memory", "0=380KB,1=380KB", "--overhead", "0=0,1=0",
                            "--mode", "staged",
                            "--output", tmp_path / "split.json", "--quiet")
    assert code == 0, err
    plan = json.loads((tmp_path / "split.json").read_text())
    assert set(plan["components"]["transformer"]["device_map"].values()) == {0, 1}
    assert plan["check"]["ran"] and not plan["check"]["problems"], plan["check"]
    run = ["run", folder, "--prompt", "a fox", "--steps", "8", "--seed", "3", "--quiet", "--json"]
    code, out, err = run_dmap(*run, "-d", tmp_path / "split.json", "--simulate", "-o", tmp_path / "split.png")
    assert code == 0, err
    split_counts = json.loads(out)["step_cache"]["counts"]["transformer"]
    code, out, err = run_dmap(*run, *common, *cache, "--max-memory", "cpu=10GB", "-o", tmp_path / "whole.png")
    assert code == 0, err
    assert json.loads(out)["step_cache"]["counts"]["transformer"] == split_counts and split_counts["skipped"] > 0
    pixels = [np.asarray(Image.open(tmp_path / f).convert("RGB")) for f in ("split.png", "whole.png")]
    assert (pixels[0] == pixels[1]).all()
    with load(str(folder), max_memory="cpu=10GB", height=32, width=32, max_sequence_length=8, dtype="bfloat16",
              weights="transformer=nf4", cache="taylorseer") as session:
        image = next(iter(session.generate(["a fox"], seed=3, steps=8))).images[0]
    assert (np.asarray(image.convert("RGB")) == pixels[1]).all()


def test_a_served_nf4_image_is_dmap_runs_file_byte_for_byte(tmp_path_factory, tmp_path):
    pytest.importorskip("starlette")
    import base64

    from conftest import run_dmap
    from test_serve import SEED as SERVE_SEED
    from test_serve import SIZE as SERVE_SIZE
    from test_serve import STEPS as SERVE_STEPS
    from test_serve import Server

    server = Server(tmp_path_factory, "--weights", "transformer=nf4,text_encoder_2=nf4")
    try:
        status, data = server.post({"prompt": "a red fox", "seed": SERVE_SEED, "model": "demo", "size": "64x64",
                                    "response_format": "b64_json"})
    finally:
        server.stop()
    assert status == 200, data
    code, _, err = run_dmap("run", "-p", "a red fox", "--height", SERVE_SIZE, "--width", SERVE_SIZE, "--steps",
                            SERVE_STEPS, "--seed", SERVE_SEED, "--mode", "staged", "--weights",
                            "transformer=nf4,text_encoder_2=nf4", "-o", tmp_path / "fox.png", "--quiet")
    assert code == 0, err
    assert base64.b64decode(data["data"][0]["b64_json"]) == (tmp_path / "fox.png").read_bytes()


@pytest.mark.heavy
@pytest.mark.slow
def test_gpu_check_nf4_section_cpu_form_matches_diffusers_pixels(tmp_path):
    """scripts/gpu_check.py --sections nf4 on this CPU (diffusers' GPU check bypassed there): what a lent GPU runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DMAP_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(repo / "scripts" / "gpu_check.py"), "--device", "cpu", "--small",
                           "--sections", "nf4"], capture_output=True, text=True, env=env, cwd=repo, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| transformer=nf4 | denoise | cpu |" in done.stdout
    assert "largest pixel difference against diffusers 0" in done.stdout


def test_nf4_on_two_cfg_ranks_is_one_process_pixels(folders, tmp_path):
    """--parallel cfg: each torchrun rank loads the NF4 transformer (quantized the same way) and runs one guidance
    branch; Qwen-Image's true CFG calls the denoiser twice a step, so the images are one process's exactly."""
    from PIL import Image
    from pipeline_launch import dmap_inline, torchrun

    folder = folders("tiny-qwenimage")
    common = ["-p", PROMPT, "--negative-prompt", "blurry", "--true-cfg-scale", "4", "--height", 32, "--width", 32,
              "--steps", 2, "--seed", SEED, "--weights", "transformer=nf4,text_encoder=nf4", "--dtype", "bfloat16",
              "--mode", "staged"]
    torchrun(2, "run", folder, *common, "--parallel", "cfg", "-o", tmp_path / "ranks.png", cwd=tmp_path)
    dmap_inline("run", folder, *common, "--max-memory", "cpu=8GB", "-o", tmp_path / "alone.png", cwd=tmp_path)
    pixels = [np.asarray(Image.open(tmp_path / f).convert("RGB")) for f in ("ranks.png", "alone.png")]
    assert np.array_equal(*pixels)

"""`--parallel pipeline` with the denoiser's weights as the plan stores them: a LoRA (fused and unfused), fp8 and
int8 weights and a GGUF file. Each rank loads its slice that way (the LoRA's adapters of its own blocks only) and the
images of 2 torchrun ranks on CPU are the bytes of one process running the same features on the same plan; the plan
counts each slice's adapters on its rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_dmap
from pipeline_launch import PROMPTS, dmap_inline, pipeline_plan, same_files, torchrun

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """(folder, LoRA file, queue file): tiny-flux with 2 + 2 blocks (tests/run/test_pipeline_run.py's), random weights,
    and a LoRA of its attention layers (tests/run/test_lora.py's)."""
    import shutil

    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("pipeline-weights")
    configs = shutil.copytree(PRESETS_DIR / "tiny-flux", root / "configs")
    config = json.loads((configs / "transformer" / "config.json").read_text())
    (configs / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 2, "num_single_layers": 2}))
    folder = write_random_pipeline(configs, root / "tiny-flux-4", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "fox-lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    (root / "queue.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    return folder, lora, root / "queue.txt"


def _piped_and_single(tmp_path: Path, model: Path, plan: Path, *args) -> None:
    """A queue on 2 pipeline ranks and one process (its GPUs simulated; this one) running `plan`: the same image bytes."""
    torchrun(2, "run", model, "-d", plan, *args, "--output", tmp_path / "piped", "--steps", 3, cwd=tmp_path)
    dmap_inline("run", model, "-d", plan, "--simulate", *args, "--output", tmp_path / "single", "--steps", 3,
                cwd=tmp_path)
    same_files(tmp_path / "piped", tmp_path / "single", ["00000.png", "00001.png"])


def _fused(plan: Path) -> list[bool]:
    return [entry["fused"] for entry in json.loads(plan.read_text())["loras"]]


@pytest.mark.heavy
def test_fp8_weights_and_an_unfused_lora_on_two_ranks_are_one_process_bytes(flux, tmp_path):
    model, lora, queue = flux
    features = ("--lora", f"{lora}:0.7")
    plan = pipeline_plan(tmp_path, model, 2, "fp8.json", "--weights", "fp8", "--dtype", "float32", *features)
    assert _fused(plan) == [False]  # peft cannot merge into fp8 layers: each rank keeps its slice's adapters
    _piped_and_single(tmp_path, model, plan, "--prompts", queue, *features)


def test_int8_weights_and_an_unfused_lora_on_two_ranks_are_one_process_bytes(flux, tmp_path):
    model, lora, queue = flux
    features = ("--lora", f"{lora}:0.7")
    plan = pipeline_plan(tmp_path, model, 2, "int8.json", "--weights", "int8", "--dtype", "bfloat16", *features)
    assert _fused(plan) == [False]
    _piped_and_single(tmp_path, model, plan, "--prompts", queue, *features)


def _slice_lora_bytes(lora: Path, slices: dict) -> dict[str, int]:
    """Rank -> bytes of the LoRA's tensors that patch the blocks of its slice (float32 here: the run dtype)."""
    from safetensors import safe_open

    out = dict.fromkeys(slices, 0)
    with safe_open(str(lora), framework="pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            block = ".".join(key.removeprefix("transformer.").split(".")[:2])
            rank = next(r for r, keys in slices.items() if block in keys)
            out[rank] += tensor.numel() * tensor.element_size()
    return out


def _plan_json(*args) -> dict:
    code, out, err = run_dmap("plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.heavy
def test_a_fused_lora_on_two_ranks_is_one_process_bytes_and_each_rank_plans_its_slices_adapters(flux, tmp_path):
    model, lora, queue = flux
    features = ("--lora", f"{lora}:0.7")
    # at 256x256 the denoise stage is every rank's peak (at 64x64 the encoders' stage is rank 0's)
    common = (model, "--max-memory", "0=1GB,1=1GB", "--world-size", 2, "--parallel", "pipeline", "--height", 256,
              "--width", 256)
    plain, patched = _plan_json(*common)["parallel"], _plan_json(*common, *features)["parallel"]
    assert plain["slices"] == patched["slices"]
    added = _slice_lora_bytes(lora, patched["slices"])
    assert all(added.values())  # both slices have patched layers
    assert {rank: patched["per_rank_peak_bytes"][rank] - plain["per_rank_peak_bytes"][rank] for rank in added} == added

    plan = pipeline_plan(tmp_path, model, 2, "fused.json", *features)
    assert _fused(plan) == [True]  # each rank merges its slice's adapters into its weights
    _piped_and_single(tmp_path, model, plan, "--prompts", queue, *features)


@pytest.mark.heavy
def test_a_gguf_denoiser_on_two_ranks_is_one_process_bytes(tmp_path):
    """Wan 2.2 TI2V's transformer from a GGUF file (Q8_0 and F32 tensors, tests/model/test_single_file_run.py's writer):
    each rank keeps its slice of what diffusers' from_single_file reads, quantized as stored."""
    from original_layouts import q8_0_rows, wan_name, write_gguf
    from safetensors.torch import load_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan-ti2v", tmp_path / "tiny-wan-ti2v", seed=0)
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    gguf = write_gguf(tmp_path / "ti2v-Q8_0.gguf", {wan_name(k): v for k, v in state.items()}, "wan", q8_0_rows)
    plan = tmp_path / "gguf.json"
    dmap_inline("plan", gguf, "--pipeline", folder, "--max-memory", "0=1GB,1=1GB", "--world-size", 2, "--parallel",
                "pipeline", "--height", 32, "--width", 32, "--frames", 9, "-o", plan, cwd=tmp_path)
    assert "Q8_0" in " ".join(json.loads(plan.read_text())["warnings"])
    args = ("run", gguf, "--pipeline", folder, "-d", plan, "--prompt", PROMPTS[0], "--steps", 3)
    torchrun(2, *args, "--output", tmp_path / "piped.webp", cwd=tmp_path)
    dmap_inline(*args, "--simulate", "--output", tmp_path / "single.webp", cwd=tmp_path)
    assert (tmp_path / "piped.webp").read_bytes() == (tmp_path / "single.webp").read_bytes()


@pytest.mark.heavy
def test_wan22_experts_each_cut_into_slices_on_two_ranks_are_one_process_bytes(tmp_path):
    """Wan 2.2 A14B's two experts (tiny-wan, tests/families/test_wan.py's twin): the plan cuts both at the same blocks and
    counts both slices on each rank; every rank holds its slice of each and switches at the boundary step with the
    others (the same diffusers loop). The video is one process's bytes, whose experts switch as planned."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan", tmp_path / "tiny-wan", seed=0)
    plan = tmp_path / "wan.json"
    dmap_inline("plan", folder, "--max-memory", "0=1GB,1=1GB", "--world-size", 2, "--parallel", "pipeline", "--height",
                32, "--width", 32, "--frames", 9, "-o", plan, cwd=tmp_path)
    recorded = json.loads(plan.read_text())
    maps = {name: recorded["components"][name]["device_map"] for name in ("transformer", "transformer_2")}
    assert maps["transformer"] == maps["transformer_2"] and set(maps["transformer"].values()) == {0, 1}
    assert recorded["parallel"]["layout"] == "pipeline"
    # the experts as sub-stages, loaded one at a time by one process (as planned where both do not fit a GPU): the
    # ranks still hold both slices, and one process switches at the boundary step by freeing one, loading the other
    denoise = next(stage for stage in recorded["stages"] if stage["name"] == "denoise")
    assert denoise["components"] == ["transformer", "transformer_2"]
    position = recorded["stages"].index(denoise)
    recorded["stages"][position:position + 1] = [{**denoise, "components": [name], "note": ""}
                                                 for name in denoise["components"]]
    plan.write_text(json.dumps(recorded))
    args = ("run", folder, "-d", plan, "--prompt", PROMPTS[0], "--steps", 4)  # 2 steps per expert
    torchrun(2, *args, "--output", tmp_path / "piped.webp", cwd=tmp_path)
    single = json.loads(dmap_inline(*args, "--simulate", "--output", tmp_path / "single.webp", "--json", cwd=tmp_path))
    assert [(s["components"], s["tracked"].split(", ")[-1]) for s in single["stages"] if s["name"] == "denoise"] == [
        (["transformer"], "2 of 4 steps"), (["transformer_2"], "2 of 4 steps")]  # the switch at the boundary step
    assert (tmp_path / "piped.webp").read_bytes() == (tmp_path / "single.webp").read_bytes()

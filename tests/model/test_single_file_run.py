"""`dmap plan FILE --pipeline P` and `dmap run FILE --pipeline FOLDER`: one component from a community single file
(Wan's original-layout safetensors, a GGUF with Q8_0 and Q4_K tensors), the rest of the pipeline from a folder,
loaded the way diffusers' `from_single_file` loads it; pixel-identical to diffusers doing that itself.

The files are written here from a tiny random Wan 2.2 pipeline (its FFN widened to 256 so that one weight has rows
a K-quant can hold) through the inverse of diffusers' `convert_wan_transformer_to_diffusers`, checked by running
diffusers' own conversion back. gguf's writer quantizes Q8_0; it cannot quantize K-quants, so the Q4_K blocks are
random codes under small scales, which any reader dequantizes alike.
"""

import json
import shutil

import pytest
from conftest import run_dmap, wan_transformer_inputs
from original_layouts import q8_0_rows, wan_name, write_gguf

PROMPT, SIZE, FRAMES, STEPS, SEED = "a red fox in the snow", 32, 9, 4, 7


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """(pipeline folder, original-layout .safetensors, .gguf) of one tiny random Wan 2.2."""
    torch = pytest.importorskip("torch")
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file, save_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("single-file-run")
    configs = shutil.copytree(PRESETS_DIR / "tiny-wan", root / "configs")
    for name in ("transformer", "transformer_2"):
        config = json.loads((configs / name / "config.json").read_text())
        (configs / name / "config.json").write_text(json.dumps({**config, "ffn_dim": 256}))
    folder = write_random_pipeline(configs, root / "tiny-wan", seed=0)
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    original = {wan_name(k): v for k, v in state.items()}
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    save_file(original, root / "wan-high-noise.safetensors")
    def quant_of(array):
        if array.ndim == 2 and array.shape[1] % 256 == 0:
            return "Q4_K"
        return q8_0_rows(array)

    write_gguf(root / "wan-high-noise-Q8_0.gguf", original, "wan", quant_of)
    return folder, root / "wan-high-noise.safetensors", root / "wan-high-noise-Q8_0.gguf"


def _diffusers_latents(folder, file, lora=None):
    """What diffusers gives loading the same file its own way (and `lora`, (path, scale), by load_lora_weights)."""
    import diffusers
    import torch

    kwargs = {}
    if file.suffix == ".gguf":
        kwargs["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
    transformer = diffusers.WanTransformer3DModel.from_single_file(
        str(file), config=str(folder), subfolder="transformer", torch_dtype=torch.float32, local_files_only=True,
        **kwargs)
    pipe = diffusers.WanPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora[0]), adapter_name="a")
        pipe.set_adapters(["a"], [lora[1]])
    return pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                generator=torch.Generator().manual_seed(SEED), output_type="latent").frames


def _dmap_latents(folder, file, tmp_path, **extra):
    from safetensors.torch import load_file

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    tmp_path.mkdir()
    request = RunRequest.of(source=str(file), pipeline=str(folder), prompt=PROMPT, steps=STEPS, height=SIZE,
                            width=SIZE, seed=SEED, num_frames=FRAMES, output=str(tmp_path / "v.webp"),
                            save_latents=str(tmp_path / "latents.safetensors"), **extra)
    result = run(request)
    return result, load_file(tmp_path / "latents.safetensors")["latents"]


@pytest.mark.parametrize("which", ["safetensors", "gguf"])
def test_run_is_identical_to_diffusers_from_single_file_unsplit_and_split(wan_files, which, tmp_path):
    import torch

    folder, safetensors_file, gguf_file = wan_files
    file = safetensors_file if which == "safetensors" else gguf_file
    expected = _diffusers_latents(folder, file)
    result, latents = _dmap_latents(folder, file, tmp_path / "whole", max_memory="cpu=8GB")
    assert torch.equal(latents, expected)
    result, latents = _dmap_latents(folder, file, tmp_path / "split", max_memory="0=400KB,1=400KB,cpu=1GB",
                                    overhead="0=0,1=0", simulate=True)
    assert result.plan.components["transformer"].is_split, result.plan.components["transformer"]
    assert result.split_check and result.split_problems == []
    assert torch.equal(latents, expected)


def test_a_gguf_base_takes_a_lora_identical_to_diffusers_unsplit_and_split(wan_files, tmp_path):
    """diffusers patches GGUFLinear layers with peft (the adapter in float32 beside the quantized weight)."""
    import diffusers
    import torch
    from test_lora import make_lora

    folder, _, gguf_file = wan_files
    lora = make_lora(diffusers.WanTransformer3DModel, folder / "transformer", tmp_path / "high.safetensors",
                     diffusers.WanPipeline, seed=2, targets=("to_q", "to_k", "to_v", "ffn.net.2"))  # net.2: Q4_K
    expected = _diffusers_latents(folder, gguf_file, (lora, 0.8))
    assert not torch.equal(expected, _diffusers_latents(folder, gguf_file)), "the LoRA must change the video"
    result, latents = _dmap_latents(folder, gguf_file, tmp_path / "whole", max_memory="cpu=8GB", dtype="float32",
                                    loras=[f"{lora}:0.8"])
    assert torch.equal(latents, expected)
    from safetensors.torch import load_file

    # peft keeps an adapter in float32 beside a quantized weight (it casts only to a floating layer's dtype)
    itemsize = torch.empty(0, dtype=getattr(torch, result.plan.dtype)).element_size()
    expected_bytes = sum(t.numel() * (4 if "net.2" in name else itemsize) for name, t in load_file(lora).items())
    assert result.plan.loras[0]["bytes"] == expected_bytes, (result.plan.dtype, result.plan.loras[0])
    result, latents = _dmap_latents(folder, gguf_file, tmp_path / "split", max_memory="0=500KB,1=500KB,cpu=1GB",
                                    overhead="0=0,1=0", simulate=True, dtype="float32", loras=[f"{lora}:0.8"])
    assert result.plan.components["transformer"].is_split
    assert result.split_check and result.split_problems == []
    assert torch.equal(latents, expected)


def _loaded_bytes(folder, file, dtype):
    """Bytes of the transformer as diffusers' from_single_file holds it (GGUF: quantized data as stored)."""
    import diffusers

    kwargs = {"quantization_config": diffusers.GGUFQuantizationConfig(compute_dtype=dtype)} if file.suffix == ".gguf" else {}
    model = diffusers.WanTransformer3DModel.from_single_file(str(file), config=str(folder), subfolder="transformer",
                                                             torch_dtype=dtype, local_files_only=True, **kwargs)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors), {getattr(t, "quant_type", None) for t in tensors}


@pytest.mark.parametrize("which,dtype", [("safetensors", "float32"), ("gguf", "bfloat16")])
def test_plan_counts_what_from_single_file_holds(wan_files, which, dtype):
    import gguf
    import torch

    folder, safetensors_file, gguf_file = wan_files
    file = safetensors_file if which == "safetensors" else gguf_file
    code, out, err = run_dmap("plan", file, "--pipeline", folder, "-m", "cpu=8GB", "--frames", FRAMES,
                              "--height", SIZE, "--width", SIZE, "--dtype", dtype, "--json")
    assert code == 0, err
    plan = json.loads(out)
    expected, quant_types = _loaded_bytes(folder, file, getattr(torch, dtype))
    assert plan["components"]["transformer"]["weights_bytes"] == expected
    if which == "gguf":  # both types really are kept quantized, and the plan says what it counted for them
        assert {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K} <= quant_types
        assert any("Q4_K" in w and "dequantizes" in w for w in plan["warnings"]), plan["warnings"]


def test_refusals_are_one_sentence(wan_files, tmp_path):
    folder, safetensors_file, gguf_file = wan_files
    code, _, err = run_dmap("run", gguf_file, "--pipeline", "tiny-wan", "-p", "x", "-o", tmp_path / "a.png")
    assert code == 2 and "does not match the pipeline's transformer" in err and "ffn" in err  # the preset's FFN is 32
    configs_only = folder.parent / "configs"  # the preset's configs with this file's FFN: no weights
    code, _, err = run_dmap("run", gguf_file, "--pipeline", configs_only, "-p", "x", "-o", tmp_path / "a.png")
    assert code == 2 and "no weights for text_encoder, transformer_2, vae" in err and "Traceback" not in err
    code, _, err = run_dmap("plan", folder, "--pipeline", "tiny-wan")
    assert code == 2 and "single-file SOURCE" in err
    code, _, err = run_dmap("plan", gguf_file, "--pipeline", folder, "--weights", "transformer=fp8")
    assert code == 2 and "GGUF" in err
    import torch
    from safetensors.torch import save_file

    wrong = tmp_path / "sd.safetensors"
    save_file({"model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(3, 3)}, wrong)
    code, _, err = run_dmap("plan", wrong, "--pipeline", folder)
    assert code == 2 and "does not" in err and "Traceback" not in err, err
    code, _, err = run_dmap("plan", gguf_file)
    assert code == 2 and "--pipeline" in err


# --- both experts from files: --component-file transformer_2=FILE ----------------------------------------------


@pytest.fixture(scope="module")
def expert_files(wan_files):
    """(high-noise expert as ComfyUI safetensors, low-noise expert as a Q8_0 GGUF), both unlike the folder's own
    experts (the high one perturbed, the low one quantized): a run that took either from the folder would differ."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = wan_files[0]
    root = folder.parent
    high = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    generator = torch.Generator().manual_seed(3)
    high = {wan_name(k): v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in high.items()}
    save_file(high, root / "wan-high-perturbed.safetensors")
    low = load_file(folder / "transformer_2" / "diffusion_pytorch_model.safetensors")
    write_gguf(root / "wan-low-Q8_0.gguf", {wan_name(k): v for k, v in low.items()}, "wan", q8_0_rows)
    return root / "wan-high-perturbed.safetensors", root / "wan-low-Q8_0.gguf"


def _single_file_model(folder, file, subfolder, dtype=None):
    import diffusers
    import torch

    dtype = dtype or torch.float32
    kwargs = {"quantization_config": diffusers.GGUFQuantizationConfig(compute_dtype=dtype)} if file.suffix == ".gguf" else {}
    return diffusers.WanTransformer3DModel.from_single_file(str(file), config=str(folder), subfolder=subfolder,
                                                            torch_dtype=dtype, local_files_only=True, **kwargs)


def _diffusers_two_experts(folder, high, low):
    import diffusers
    import torch

    pipe = diffusers.WanPipeline.from_pretrained(folder, transformer=_single_file_model(folder, high, "transformer"),
                                                 transformer_2=_single_file_model(folder, low, "transformer_2"),
                                                 torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                generator=torch.Generator().manual_seed(SEED), output_type="latent").frames


def test_both_experts_from_files_are_identical_to_diffusers_unsplit_and_split(wan_files, expert_files, tmp_path):
    import torch

    folder = wan_files[0]
    high, low = expert_files
    expected = _diffusers_two_experts(folder, high, low)
    files = {"transformer_2": str(low)}
    result, latents = _dmap_latents(folder, high, tmp_path / "whole", max_memory="cpu=8GB", component_files=files)
    assert torch.equal(latents, expected)
    _, folder_only = _dmap_latents(folder, wan_files[1], tmp_path / "folder-low", max_memory="cpu=8GB")
    assert not torch.equal(folder_only, expected)  # the second file really is what the run used
    result, latents = _dmap_latents(folder, high, tmp_path / "split", max_memory="0=400KB,1=400KB,cpu=1GB",
                                    overhead="0=0,1=0", simulate=True, component_files=files)
    for name in ("transformer", "transformer_2"):
        assert result.plan.components[name].is_split, result.plan.components[name]
    assert result.split_check and result.split_problems == []
    assert torch.equal(latents, expected)


def test_source_file_goes_to_the_first_component_the_files_leave(wan_files, expert_files, tmp_path):
    """`dmap run LOW --pipeline P --component-file transformer=HIGH`: SOURCE's file fills transformer_2."""
    import torch

    folder = wan_files[0]
    high, low = expert_files
    _, latents = _dmap_latents(folder, low, tmp_path / "swapped", max_memory="cpu=8GB",
                               component_files={"transformer": str(high)})
    assert torch.equal(latents, _diffusers_two_experts(folder, high, low))


def test_plan_sizes_both_files_as_stored_and_names_them(wan_files, expert_files, tmp_path):
    import torch

    folder = wan_files[0]
    high, low = expert_files
    code, out, err = run_dmap("plan", high, "--pipeline", folder, "--component-file", f"transformer_2={low}",
                              "-m", "cpu=8GB", "--frames", FRAMES, "--height", SIZE, "--width", SIZE,
                              "--dtype", "float32", "--json", "-o", tmp_path / "plan.json")
    assert code == 0, err
    plan = json.loads(out)
    for name, file in (("transformer", high), ("transformer_2", low)):  # (bf16: see test_plan_counts_what_...)
        model = _single_file_model(folder, file, name, torch.float32)
        built = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert plan["components"][name]["weights_bytes"] == built, name
    assert any(w.startswith("transformer_2: GGUF tensors") for w in plan["warnings"]), plan["warnings"]
    # the plan is tied to both files: without the second one it is a plan for another model
    code, _, err = run_dmap("plan", high, "--pipeline", folder, "-m", "cpu=8GB", "--frames", FRAMES, "--height", SIZE,
                            "--width", SIZE, "--dtype", "float32", "--json")
    assert code == 0 and json.loads(_)["config_digest"] != plan["config_digest"]
    code, _, err = run_dmap("run", high, "--pipeline", folder, "-d", tmp_path / "plan.json", "-p", PROMPT,
                            "--steps", 1, "-o", tmp_path / "v.webp")
    assert code == 2 and "another model" in err, err


def test_metadata_and_resume_key_carry_each_file_digest(wan_files, expert_files, tmp_path):
    import hashlib

    from dm_cli.io.outputs import MATCHED_METADATA

    folder = wan_files[0]
    high, low = expert_files
    from dm_cli.api import load

    with load(str(high), pipeline=str(folder), component_files={"transformer_2": str(low)}, max_memory="cpu=8GB",
              num_frames=FRAMES, height=SIZE, width=SIZE) as session:
        meta = session.metadata(session.defaults)
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (high, low)}
    assert meta["component_files"] == (f"transformer={high.name}:{digests[high]},"
                                       f"transformer_2={low.name}:{digests[low]}")
    assert "component_files" in MATCHED_METADATA
    # the command line writes it into the video's sidecar; an output made with another second file is not complete
    from dm_cli.io.outputs import is_complete

    out = tmp_path / "fox.webp"
    code, _, err = run_dmap("run", high, "--pipeline", folder, "--component-file", f"transformer_2={low}", "-p", PROMPT,
                            "--frames", FRAMES, "--height", SIZE, "--width", SIZE, "--steps", 1, "-m", "cpu=8GB",
                            "-o", out, "-q")
    assert code == 0, err
    written = json.loads((tmp_path / "fox.webp.json").read_text())
    assert written["component_files"] == meta["component_files"]
    other = {**written, "component_files": f"transformer={high.name}:{digests[high]},transformer_2=x.gguf:0"}
    assert is_complete(out, written) == (True, "complete")
    assert is_complete(out, other) == (False, "made for another component files")


def test_component_file_refusals_are_one_sentence(wan_files, expert_files, tmp_path):
    folder, safetensors_file, _ = wan_files
    high, low = expert_files
    common = ("--pipeline", folder, "-m", "cpu=8GB", "--frames", FRAMES, "--height", SIZE, "--width", SIZE)
    cases = [
        (["--component-file", f"transformer_3={low}"], "no weighted component of: its components are"),
        (["--component-file", f"vae={low}"], "does not match the pipeline's vae"),
        (["--component-file", str(low)], "give COMPONENT=FILE"),
        (["--component-file", f"transformer_2={low}", "--component-file", f"transformer_2={high}"], "twice"),
        (["--component-file", f"transformer_2={folder / 'model_index.json'}"], "not a .safetensors or .gguf"),
    ]
    for extra, message in cases:
        code, _, err = run_dmap("plan", high, *common, *extra)
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err
    # a file that is not that component's model (the preset's FFN is 32, the file's 256)
    code, _, err = run_dmap("plan", high, "--pipeline", "tiny-wan", "--component-file", f"transformer_2={low}")
    assert code == 2 and "does not match the pipeline's" in err, err
    # SOURCE itself must then be a pipeline (or a single file with --pipeline)
    code, _, err = run_dmap("plan", high, "--component-file", f"transformer_2={low}")
    assert code == 2 and "replaces components of a pipeline" in err, err
    # SOURCE a pipeline folder: the named component alone comes from its file
    code, out, err = run_dmap("plan", folder, "--component-file", f"transformer_2={low}", "-m", "cpu=8GB",
                              "--frames", FRAMES, "--height", SIZE, "--width", SIZE, "--json")
    assert code == 0, err
    assert any(w.startswith("transformer_2: GGUF") for w in json.loads(out)["warnings"])
    # both experts given as files with SOURCE's own: nothing is left for SOURCE's file
    code, _, err = run_dmap("plan", safetensors_file, "--pipeline", folder, "--component-file", f"transformer={high}",
                            "--component-file", f"transformer_2={low}")
    assert code == 2 and "holds the pipeline's transformer, which --component-file gives" in err, err


def test_gguf_blocks_streamed_from_the_cpu_keep_their_types_and_adapters(wan_files, tmp_path):
    """diffusers' from_single_file loads a file whole on one device whatever its device_map: dmap dispatches it
    itself (`dispatch_loaded`), blocks the plan puts on the cpu streamed by accelerate's offload hooks, which
    must keep each GGUF tensor's quant type. On a CPU-only machine the execution device is the cpu, through the
    same hooks."""
    from dataclasses import replace

    import diffusers
    import torch
    from test_lora import make_lora

    from dm_cli.model.lora import read_lora
    from dm_cli.run.hooks.adapters import load_loras
    from dm_cli.run.load.loading import dispatch_loaded

    folder, _, gguf_file = wan_files
    lora = make_lora(diffusers.WanTransformer3DModel, folder / "transformer", tmp_path / "high.safetensors",
                     diffusers.WanPipeline, seed=2, targets=("to_q", "ffn.net.2"))
    adapter = replace(read_lora(f"{lora}:0.8"), component="transformer")

    def loaded(device_map=None):
        model = diffusers.WanTransformer3DModel.from_single_file(
            str(gguf_file), config=str(folder), subfolder="transformer", torch_dtype=torch.float32,
            local_files_only=True, quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32))
        if device_map is not None:
            model = dispatch_loaded(model, device_map)
        load_loras(diffusers.WanPipeline.from_pretrained(folder, transformer=None), "transformer", model, (adapter,))
        return model

    resident = loaded()
    streamed = loaded({"": "cpu", "blocks.0": "cpu", "blocks.1": "cpu"})
    ffn = streamed.blocks[0].ffn.net[2]
    assert ffn.base_layer.weight.device.type == "meta" and ffn.base_layer.weight.quant_type is not None
    assert ffn.lora_A["dmap_lora_0"].weight.device.type == "meta"
    inputs = wan_transformer_inputs(resident.config)
    with torch.no_grad():
        expected, got = resident(*inputs).sample, streamed(*inputs).sample
    assert torch.equal(got, expected)

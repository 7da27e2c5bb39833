"""FLUX.1 from a community single file (BFL's original layout) and from a GGUF file (Q8_0 and Q4_K tensors),
`dmap run FILE --pipeline FOLDER`: latents identical to diffusers loading the same file its own way
(`from_single_file`, `GGUFQuantizationConfig`): the safetensors file unsplit and split on two simulated GPUs,
the GGUF file split (the same placement code, after its own reading).

diffusers' `convert_flux_transformer_checkpoint_to_diffusers` (0.42.1) splits each single block's fused projection
with a hard-coded inner dimension of 3072, so the model here is FLUX.1's width (24 heads of 128) with one double
and one single block (~0.5B parameters, bf16) around tiny-flux's other components: the smallest FLUX.1 the converter
loads. Slow: it writes and loads about 1 GB several times. What is compared is how each file is read (its layout
converted, its quantized tensors dequantized for each forward as diffusers does) and placed, so one step and a prompt
of 32 T5 tokens (not 512) do: every run calls the transformer once, on 36 tokens, where two steps on 516 tokens made
each GGUF run dequantize the whole transformer twice (the file's test was over a minute of CPU).
"""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

PROMPT, SIZE, STEPS, SEED, TOKENS = "a red fox in the snow", 32, 1, 7, 32


@pytest.fixture(scope="module")
def flux1_files(tmp_path_factory):
    """(pipeline folder, BFL-layout .safetensors, .gguf) of one FLUX.1-wide random transformer."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from original_layouts import flux1_original, q8_0_rows, write_gguf
    from safetensors.torch import load_file, save_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("flux1-single-file")
    configs = shutil.copytree(PRESETS_DIR / "tiny-flux", root / "configs")
    config = json.loads((configs / "transformer" / "config.json").read_text())
    config.update(num_attention_heads=24, attention_head_dim=128, axes_dims_rope=[16, 56, 56])
    (configs / "transformer" / "config.json").write_text(json.dumps(config))
    folder = write_random_pipeline(configs, root / "flux1", seed=0, dtype="bfloat16")
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    original = flux1_original(state)
    back = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    del back, state
    save_file(original, root / "flux1-mid.safetensors")
    def quant_of(array):
        if array.ndim == 2 and array.shape[1] % 256 == 0 and array.size >= 1 << 22:  # the big matrices
            return "Q4_K"
        return q8_0_rows(array)

    write_gguf(root / "flux1-mid-Q4_K.gguf", original, "flux", quant_of, q4_k_scales=(0.0005, 0.0002))
    del original
    weights.unlink()  # the files stand in for it; nothing may read the folder's own transformer weights
    return folder, root / "flux1-mid.safetensors", root / "flux1-mid-Q4_K.gguf"


def _diffusers_latents(folder, file):
    kwargs = {}
    if file.suffix == ".gguf":
        kwargs["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=torch.bfloat16)
    transformer = diffusers.FluxTransformer2DModel.from_single_file(
        str(file), config=str(folder), subfolder="transformer", torch_dtype=torch.bfloat16, local_files_only=True,
        **kwargs)
    pipe = diffusers.FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, max_sequence_length=TOKENS,
                generator=torch.Generator().manual_seed(SEED), output_type="latent").images


def _dmap_latents(folder, file, tmp_path, **extra):
    from safetensors.torch import load_file

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    tmp_path.mkdir()
    request = RunRequest.of(source=str(file), pipeline=str(folder), prompt=PROMPT, steps=STEPS, height=SIZE,
                            width=SIZE, seed=SEED, max_sequence_length=TOKENS, dtype="bfloat16",
                            output=str(tmp_path / "fox.png"), save_latents=str(tmp_path / "latents.safetensors"), **extra)
    result = run(request)
    return result, load_file(tmp_path / "latents.safetensors")["latents"]


@pytest.mark.parametrize("which", ["safetensors", "gguf"])
def test_flux1_file_runs_identical_to_diffusers_unsplit_and_split(flux1_files, which, tmp_path):
    folder, safetensors_file, gguf_file = flux1_files
    file = safetensors_file if which == "safetensors" else gguf_file
    expected = _diffusers_latents(folder, file)
    if which == "safetensors":  # the GGUF file goes through the same placement: its split run below suffices
        result, latents = _dmap_latents(folder, file, tmp_path / "whole", max_memory="cpu=16GB")
        assert result.plan.components["transformer"].weights_bytes < 1.1e9
        assert torch.equal(latents, expected)
        whole = result.plan
    else:
        from dm_cli.api import plan

        whole = plan(str(file), pipeline=str(folder), max_memory="cpu=16GB", height=SIZE, width=SIZE,
                     max_sequence_length=TOKENS, dtype="bfloat16", steps=STEPS, check=False)
    placed = whole.components["transformer"]  # each GPU: most of the weights (not all), the activations
    budget = f"{int((placed.weights_bytes * 0.8 + max(placed.activation_by_device.values())) / 1e6)}MB"
    result, latents = _dmap_latents(folder, file, tmp_path / "split", max_memory=f"0={budget},1={budget},cpu=16GB",
                                    overhead="0=0,1=0", simulate=True)
    assert result.plan.components["transformer"].is_split, result.plan.components["transformer"]
    assert result.split_check and result.split_problems == []
    assert torch.equal(latents, expected)

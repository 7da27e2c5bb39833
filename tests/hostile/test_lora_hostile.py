"""Hostile LoRA files (issue 44, G): what used to fail after the models loaded (peft's raw line, `Incompatible keys
detected: .`, a state_dict error) or ran to exit 0 with an all-black image and a raw numpy RuntimeWarning is refused
by `plan` from the header (and the few alpha scalars), or when the adapter loads, or at the denoising step whose
latents turn non-finite: exit 2, one sentence, no traceback, no warning, nothing written. A kohya FLUX LoRA that
fits still plans and runs as diffusers runs it."""

import json
import warnings

import numpy as np
import pytest
from conftest import run_dmap

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

PROMPT, SIZE, STEPS, SEED = "a red fox in the snow", 32, 2, 7
QKV, PROJ = "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj"


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """(tiny FLUX.1 pipeline, a peft LoRA of its transformer as diffusers saves one, the folder for attack files)."""
    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("lora-hostile")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "fox.safetensors",
                     diffusers.FluxPipeline, seed=1)
    return folder, lora, root


def _save(path, tensors: dict, metadata=None):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _kohya_flux(path, inner=32, rank=4, alpha=4.0):
    """A kohya (sd-scripts) FLUX LoRA of the first double block: its fused qkv and its output projection."""
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for name, out in ((QKV, 96), (PROJ, 32)):
        tensors[f"{name}.lora_down.weight"] = torch.randn(rank, inner, generator=generator) * 0.3
        tensors[f"{name}.lora_up.weight"] = torch.randn(out, rank, generator=generator) * 0.3
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    return _save(path, tensors)


def _refused(*args) -> str:
    """The CLI's answer to an attack: exit 2, one sentence, no traceback, no warning on the way."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_dmap(*args)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    return err


def _plan(folder, lora_spec) -> str:
    return _refused("plan", folder, "--max-memory", "cpu=8GB", "--lora", lora_spec)


def _run(folder, lora_spec, out) -> str:
    err = _refused("run", folder, "-p", PROMPT, "--steps", STEPS, "--height", SIZE, "--width", SIZE, "-o", out,
                   "--lora", lora_spec)
    assert not out.exists(), "nothing is written"
    return err


@pytest.mark.parametrize("layout", ["peft", "kohya", "metadata"])
def test_rank_0_is_refused_by_plan_naming_the_key(flux, layout):
    folder, _, root = flux
    path = root / f"rank0-{layout}.safetensors"
    if layout == "peft":
        key = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"
        _save(path, {key: torch.zeros(0, 32), key.replace("lora_A", "lora_B"): torch.zeros(32, 0)})
    elif layout == "kohya":
        key = f"{PROJ}.lora_down.weight"
        _save(path, {key: torch.zeros(0, 32), f"{PROJ}.lora_up.weight": torch.zeros(32, 0)})
    else:  # diffusers' adapter metadata says r=0 over tensors of rank 4
        key = "transformer.r"
        _save(path, {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
                     "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)},
              {"lora_adapter_metadata": json.dumps({"transformer.r": 0, "transformer.lora_alpha": 4})})
    err = _plan(folder, path)
    assert "rank 0" in err and key in err, err


def test_an_sdxl_kohya_lora_given_to_flux_is_refused_by_plan(flux):
    folder, _, root = flux
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    path = _save(root / "sdxl-kohya.safetensors", {f"{key}.lora_down.weight": torch.ones(4, 320),
                                                   f"{key}.lora_up.weight": torch.ones(320, 4),
                                                   f"{key}.alpha": torch.tensor(4.0)})
    err = _plan(folder, path)
    assert "matches no layer" in err and f"{key}.lora_down.weight" in err and "another model" in err, err


def test_a_kohya_flux_lora_of_other_shapes_is_refused_by_plan(flux):
    folder, _, root = flux
    path = _kohya_flux(root / "kohya-wide.safetensors", inner=48)  # the tiny FLUX's layers take 32 features
    err = _plan(folder, path)
    assert "does not fit transformer" in err and "transformer_blocks.0.attn.to_" in err and "48" in err, err


@pytest.mark.parametrize("rank", [4, 6])  # 6: the fused qkv splits by rank, a conversion that reads values
def test_a_kohya_flux_lora_that_fits_plans_its_converted_layers_and_runs_like_diffusers(flux, tmp_path, rank):
    from test_lora import flux_oracle

    folder, _, root = flux
    path = _kohya_flux(root / f"kohya-r{rank}.safetensors", rank=rank)
    code, out, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", "--lora", f"{path}:0.7", "--json")
    assert code == 0, err
    # the converted layers are counted where they live: q, k, v and to_out of the first double block, float32
    (entry,) = json.loads(out)["loras"]
    from dm_cli.model.lora import converted_layers, read_lora
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.placement.lora_sizing import lora_targets

    (adapter,) = lora_targets(resolve_source(str(folder)), (read_lora(str(path)),))
    assert sorted(layer.module for layer in adapter.layers) == [
        f"transformer_blocks.0.attn.{name}" for name in ("to_k", "to_out.0", "to_q", "to_v")]
    assert entry["bytes"] == sum(layer.numel for layer in adapter.layers) * 4
    assert converted_layers(read_lora(str(path)), None).layers == ()  # no pipeline: nothing converted
    code, _, err = run_dmap("run", folder, "-p", PROMPT, "--steps", STEPS, "--height", SIZE, "--width", SIZE,
                            "--seed", SEED, "-o", tmp_path / "kohya.png", "--lora", f"{path}:0.7")
    assert code == 0, err
    from PIL import Image

    with Image.open(tmp_path / "kohya.png") as image:
        assert np.array_equal(np.array(image), flux_oracle(folder, [(path, 0.7)]))


@pytest.mark.parametrize("where", ["kohya alpha", "metadata alpha", "huge alpha"])
def test_a_nan_or_oversized_alpha_is_refused_by_plan(flux, where):
    folder, lora, root = flux
    path = root / f"alpha-{where.replace(' ', '-')}.safetensors"
    if where == "kohya alpha":
        _kohya_flux(path, alpha=float("nan"))
        key, words = f"{PROJ}.alpha", "finite"
    elif where == "huge alpha":
        _kohya_flux(path, alpha=1e30)
        key, words = f"{PROJ}.alpha", "oversized"
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(lora), "pt") as handle:
            metadata = json.loads(handle.metadata()["lora_adapter_metadata"])
        metadata["transformer.lora_alpha"] = float("nan")
        _save(path, load_file(str(lora)), {"lora_adapter_metadata": json.dumps(metadata)})
        key, words = "transformer.lora_alpha", "finite"
    err = _plan(folder, path)
    assert key in err and words in err, err


@pytest.mark.parametrize("scale", ["1e308", "-5000"])
def test_an_oversized_scale_is_refused_by_plan(flux, scale):
    folder, lora, _ = flux
    err = _plan(folder, f"{lora}:{scale}")
    assert "oversized" in err and scale in err, err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_when_the_adapter_loads(flux, tmp_path, value):
    from safetensors.torch import load_file

    folder, lora, _ = flux
    tensors = load_file(str(lora))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = torch.full_like(tensors[key], value)
    path = _save(tmp_path / "poisoned.safetensors", tensors)
    err = _run(folder, path, tmp_path / "out.png")
    assert key in err and "NaN or infinite" in err, err


def test_a_lora_that_overflows_stops_at_the_step_instead_of_writing_a_black_image(flux, tmp_path):
    """Finite weights, each well inside float32, whose products are not: the latents turn non-finite."""
    from safetensors.torch import load_file

    folder, lora, _ = flux
    path = _save(tmp_path / "loud.safetensors", {k: v * 1e18 for k, v in load_file(str(lora)).items()})
    err = _run(folder, f"{path}:0.5", tmp_path / "out.png")
    assert f"Denoising step 1 of {STEPS}" in err and "loud.safetensors:0.5" in err and "nothing was written" in err



def test_an_sdxl_kohya_lora_is_matched_against_the_unet_after_diffusers_converts_it(tmp_path):
    """diffusers converts kohya's SDXL keys to its `lora.down` form, then to peft's: the layers checked are those."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-sdxl", tmp_path / "tiny-sdxl", seed=0)
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet")
    layers = {name: module for name, module in unet.named_modules()
              if name.endswith(("attn1.to_q", "attn2.to_k")) and isinstance(module, torch.nn.Linear)}

    def kohya_sdxl(path, extra_inputs=0):
        tensors = {}
        for name, module in layers.items():
            key = "lora_unet_" + name.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = torch.ones(4, module.in_features + extra_inputs)
            tensors[f"{key}.lora_up.weight"] = torch.ones(module.out_features, 4)
            tensors[f"{key}.alpha"] = torch.tensor(4.0)
        return _save(path, tensors)

    fits = kohya_sdxl(tmp_path / "fits.safetensors")
    code, out, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", "--lora", fits, "--json")
    assert code == 0, err
    assert json.loads(out)["loras"][0]["bytes"] == sum(4 * (m.in_features + m.out_features) * 4 for m in layers.values())
    err = _plan(folder, kohya_sdxl(tmp_path / "wider.safetensors", extra_inputs=8))
    assert "does not fit unet" in err and "attn" in err, err

"""Pipeline families: one registry, family-agnostic tracer/planner/runner, unknown families still inspected and planned."""

import json

import pytest
from conftest import PRESETS, run_dmap

from dm_cli.families import FAMILY_MODULES, all_families, family_for, pipeline_stages, supported_pipelines
from dm_cli.inputs import InputSpec

CONNECTORS = {
    "_class_name": "LTX2TextConnectors", "caption_channels": 16, "text_proj_in_factor": 2,
    "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 4, "video_connector_num_layers": 1,
    "video_connector_num_learnable_registers": 4, "audio_connector_num_attention_heads": 2,
    "audio_connector_attention_head_dim": 4, "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": 4,
    "video_hidden_dim": 8, "audio_hidden_dim": 8,
}
VOCODER = {"_class_name": "LTX2Vocoder", "in_channels": 8, "hidden_channels": 16, "out_channels": 2,
           "upsample_kernel_sizes": [4, 4], "upsample_factors": [2, 2], "resnet_kernel_sizes": [3],
           "resnet_dilations": [[1]]}


def test_one_registry_matches_every_bundled_pipeline_and_lone_denoisers():
    assert len({f.name for f in all_families()}) == len(all_families()) >= len(FAMILY_MODULES)  # a module may hold variants
    for preset in ("flux.1-dev", "sdxl-base-1.0", "sd-1.5", "sd3-medium", "tiny-flux", "tiny-sdxl", "tiny-sd15", "tiny-sd3",
                   "wan2.2-t2v-a14b", "tiny-wan"):
        index = json.loads((PRESETS / preset / "model_index.json").read_text())
        family = family_for(index["_class_name"])
        assert family is not None and family.runs(index["_class_name"]), preset
        assert index[family.denoiser][1] in family.denoiser_classes
    # a lone UNet: SDXL by its text_time conditioning, else SD 1.x
    assert family_for(None, "UNet2DConditionModel", {"addition_embed_type": "text_time"}).name == "sdxl"
    assert family_for(None, "UNet2DConditionModel", {}).name == "sd15"
    # related classes are traced like the family, but only the listed ones run
    assert family_for("StableDiffusionXLImg2ImgPipeline").name == "sdxl"
    assert not family_for("StableDiffusionXLImg2ImgPipeline").runs("StableDiffusionXLImg2ImgPipeline")
    assert family_for("PixArtAlphaPipeline") is None
    assert "FluxPipeline" in supported_pipelines()


def test_guidance_multiplies_denoiser_calls_by_family():
    cfg = InputSpec(64, 64, guidance_scale=5.0)
    assert family_for("StableDiffusionXLPipeline").cfg_batch(cfg) == 2
    assert family_for("StableDiffusionXLPipeline").cfg_batch(InputSpec(64, 64, guidance_scale=1.0)) == 1
    assert family_for("FluxPipeline").cfg_batch(cfg) == 1  # guidance-distilled: one call, batch unchanged


def test_stages_come_from_the_family_and_unknown_pipelines_fall_back_to_diffusers():
    stages = pipeline_stages("StableDiffusionXLPipeline", ["vae", "unet", "text_encoder_2", "text_encoder"])
    assert [(s.name, s.components) for s in stages] == [
        ("encode", ("text_encoder", "text_encoder_2")), ("denoise", ("unet",)), ("decode", ("vae",))]
    wan = pipeline_stages("WanPipeline", ["vae", "transformer_2", "transformer", "text_encoder"])
    assert [(s.name, s.components, s.exclusive) for s in wan] == [
        ("encode", ("text_encoder",), False), ("denoise", ("transformer", "transformer_2"), True),
        ("decode", ("vae",), False)]
    stages = pipeline_stages("PixArtAlphaPipeline", ["vae", "transformer", "text_encoder"])
    assert [s.name for s in stages] == ["encode", "denoise", "decode"]


def _ltx2_folder(root, library="ltx2"):
    root.mkdir()
    # a pipeline class no family claims: its components come from the ltx2 pipeline module all the same
    index = {"_class_name": "AudioConnectorsPipeline", "_diffusers_version": "0.42.1",
             "connectors": [library, "LTX2TextConnectors"], "vocoder": ["ltx2", "LTX2Vocoder"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (root / "model_index.json").write_text(json.dumps(index))
    for name, config in (("connectors", CONNECTORS), ("vocoder", VOCODER)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def test_components_from_a_diffusers_pipeline_module_are_inspected_and_planned(tmp_path):
    """LTX-2 names its connectors and vocoder as ["ltx2", ...]: diffusers resolves them in diffusers.pipelines.ltx2."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    folder = _ltx2_folder(tmp_path / "ltx2")
    code, out, err = run_dmap("inspect", folder, "--json")
    assert code == 0, err
    report = {c["name"]: c for c in json.loads(out)["components"]}
    for name, cls, config in (("connectors", LTX2TextConnectors, CONNECTORS), ("vocoder", LTX2Vocoder, VOCODER)):
        model = cls.from_config(config)
        assert report[name]["params"] == sum(p.numel() for p in model.parameters()), name
    # an unknown family still gets a weights-only plan, with a warning that names what is missing
    code, out, err = run_dmap("plan", folder, "--max-memory", "0=1GB,cpu=4GB", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan["components"]) == {"connectors", "vocoder"}
    assert any("AudioConnectorsPipeline" in w for w in plan["warnings"]), plan["warnings"]


@pytest.mark.parametrize("library", ["os", "../ltx2", "ltx2.connectors", "_ltx2", "subprocess"])
def test_a_library_outside_diffusers_pipelines_is_refused_never_imported(tmp_path, library, monkeypatch):
    import importlib

    folder = _ltx2_folder(tmp_path / "bad", library)
    imported, real = [], importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a, **k: (imported.append(name), real(name, *a, **k))[1])
    code, _, err = run_dmap("inspect", folder)
    assert code == 2 and library in err and "diffusers pipeline module" in err
    # `os` is imported already, so sys.modules cannot tell: no import was even asked for the library
    assert not [name for name in imported if library in name or name.endswith(library.strip("./_"))]

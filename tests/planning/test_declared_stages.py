"""Stages declared by families (issue 19 item 5): a family lists its stages, the components each runs and what
each consumes and produces; the planner places per stage (a component may serve several), the plan file
records them, and the stage loop runs each by its kind.

The acceptance case is a test-only family: Stable Diffusion whose VAE encodes an input image before the
denoiser (the latents denoising starts from) and decodes after it, as image-to-image pipelines do.
"""

import json

import numpy as np
import pytest

from dm_cli.families.stages import (
    EMBEDS,
    IMAGE,
    IMAGE_LATENTS,
    IMAGES,
    LATENTS,
    PROMPT,
    Stage,
    declared,
    default_stages,
)
from dm_cli.inputs import PlacementSpec
from dm_cli.planning.placement.blocks import Block, ComponentInput
from dm_cli.planning.placement.search import Device, plan_pipeline

PROMPT_TEXT = "a red fox in the snow"
SIZE, STEPS, SEED = 32, 2, 7
IMG2IMG_STAGES = [("encode", ["text_encoder"]), ("encode_image", ["vae"]), ("denoise", ["unet"]), ("decode", ["vae"])]


def input_image(job_seed: int, size: int):
    import torch

    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(job_seed)) * 2 - 1


def _image_to_image_family():
    from dm_cli.families.sd15 import SD15Family

    class VaeEncodesFirst(SD15Family):
        """Test only: the VAE encodes an input image (from the job's seed) to the latents denoising starts from."""

        name = "sd15-vae-encodes-first"
        declared_stages = (
            Stage("encode", ("text_encoder",), consumes=(PROMPT,), produces=(EMBEDS,)),
            Stage("encode_image", ("vae",), consumes=(IMAGE,), produces=(IMAGE_LATENTS,)),
            Stage("denoise", ("unet",), consumes=(EMBEDS, IMAGE_LATENTS), produces=(LATENTS,)),
            Stage("decode", ("vae",), consumes=(LATENTS,), produces=(IMAGES,)),
        )

        def encode_image(self, pipe, job, device):
            image = input_image(job.seed, job.height).to(device)
            return pipe.vae.encode(image).latent_dist.mean * pipe.vae.config.scaling_factor

        def image_kwargs(self, pipe, job, image_latents):
            return {"latents": image_latents}

    return VaeEncodesFirst()


@pytest.fixture
def img2img_family(monkeypatch):
    """The test family registered ahead of the others (it matches StableDiffusionPipeline first)."""
    import dm_cli.families as families

    family = _image_to_image_family()
    registered = families.all_families()
    monkeypatch.setattr(families, "all_families", lambda: (family, *registered))
    return family


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    return write_random_pipeline(PRESETS_DIR / "tiny-sd15", tmp_path_factory.mktemp("pipelines") / "sd15", seed=0)


def _oracle(folder):
    """diffusers' own pipeline, denoising from the VAE-encoded input image."""
    import diffusers
    import torch

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = pipe.vae.encode(input_image(SEED, SIZE)).latent_dist.mean * pipe.vae.config.scaling_factor
    image = pipe(PROMPT_TEXT, latents=latents, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


def _recording_loads(monkeypatch) -> list:
    from dm_cli.run.loops.stages import StageLoop

    loaded = []
    load_stage = StageLoop.load_stage

    def recording(self, names, stage=None):
        loaded.extend(n for n in names if n not in self.loaded)
        load_stage(self, names, stage)

    monkeypatch.setattr(StageLoop, "load_stage", recording)
    return loaded


def test_a_vae_that_encodes_before_the_denoiser_and_decodes_after_plans_and_runs(img2img_family, sd15, tmp_path,
                                                                                 monkeypatch):
    pytest.importorskip("torch")
    from PIL import Image

    from dm_cli.inputs import Generation
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_file import Plan
    from dm_cli.planning.plan_options import PlanOptions
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    expected = _oracle(sd15)
    loaded = _recording_loads(monkeypatch)
    for mode, vae_loads in (("staged", 2), ("resident", 1)):
        plan = make_plan(str(sd15), PlanOptions(PlacementSpec("cpu=8GB", mode=mode), generation=Generation(height=SIZE, width=SIZE), check=False))
        assert plan.mode == mode
        assert [(s.name, s.components) for s in plan.stages] == IMG2IMG_STAGES  # both of the VAE's, in order
        assert plan.components["vae"].stage == "encode_image"
        assert plan.components["vae"].stages == ("encode_image", "decode")
        data = json.loads(json.dumps(plan.to_json()))
        assert data["version"] == 1
        assert [(s["name"], s["consumes"], s["produces"]) for s in data["stages"]] == [
            ("encode", ["prompt"], ["embeds"]), ("encode_image", ["image"], ["image_latents"]),
            ("denoise", ["embeds", "image_latents"], ["latents"]), ("decode", ["latents"], ["images"])]
        assert data["components"]["vae"]["stages"] == ["encode_image", "decode"]
        back = Plan.from_json(data)
        assert [(s.name, s.kind) for s in back.stages] == [
            ("encode", "encode"), ("encode_image", "encode_image"), ("denoise", "denoise"), ("decode", "decode")]
        assert back.components["vae"].stages == ("encode_image", "decode")
        # staged: the VAE loads for each of its stages; resident: once, for the whole run
        plan_path = tmp_path / f"plan-{mode}.json"
        plan_path.write_text(json.dumps(data))
        loaded.clear()
        out = tmp_path / f"{mode}.png"
        result = run(RunRequest.of(source=str(sd15), prompt=PROMPT_TEXT, device_map=str(plan_path), steps=STEPS,
                                seed=SEED, output=str(out)))
        assert loaded.count("vae") == vae_loads and loaded.count("unet") == 1
        ran = [s.name for s in result.stages if s.name != "load"]
        assert ran == [name for name, _ in IMG2IMG_STAGES]
        with Image.open(out) as image:
            assert np.array_equal(np.array(image), expected)  # denoised from the encoded input image


def test_every_existing_family_declares_todays_stages():
    """The Family default: encode / denoise / decode around the denoiser and experts, as before."""
    from dm_cli.families import all_families, offload_sequence, pipeline_stages

    for family in all_families():
        if family.max_input_images:  # image-input families declare an encode_image stage (tests/families/test_flux_edit.py)
            continue
        if family.name == "ltx-2":  # the audio track adds a decode_audio stage (tests/families/test_ltx2.py)
            assert [s.kind for s in family.declared_stages][-1] == "decode_audio"
            continue
        assert not family.declared_stages
        for pipeline in family.pipelines:
            seq = offload_sequence(pipeline)
            names = [*seq, "controlnet"] if seq else ["text_encoder", family.denoiser, "vae"]
            stages = pipeline_stages(pipeline, names)
            assert stages == default_stages(names, seq, (family.denoiser, *family.experts))
            assert [(s.name, s.consumes, s.produces) for s in stages] == [
                ("encode", (PROMPT,), (EMBEDS,)), ("denoise", (EMBEDS,), (LATENTS,)), ("decode", (LATENTS,), (IMAGES,))]
            assert [s.kind for s in stages] == ["encode", "denoise", "decode"]
    unknown = pipeline_stages("PixArtAlphaPipeline", ["vae", "transformer", "text_encoder"])
    assert [s.kind for s in unknown] == ["encode", "denoise", "decode"]
    assert [s.kind for s in default_stages(["a", "b"], None)] == [None]  # no denoiser: one stage no runner runs


def test_declared_stages_keep_the_components_a_pipeline_has_and_refuse_one_no_stage_runs():
    family = _image_to_image_family()
    assert [(s.name, s.components) for s in family.stages(["vae"], None)] == [
        ("encode_image", ("vae",)), ("decode", ("vae",))]
    with pytest.raises(ValueError, match="safety_checker"):
        declared(family.declared_stages, ["text_encoder", "unet", "vae", "safety_checker"])


def test_a_plan_file_written_before_stages_recorded_their_values_still_loads_and_runs_by_name():
    from dm_cli.planning.plan_file import Plan

    document = {
        "format": "dmap-plan", "version": 1, "source": "x", "dtype": "float32", "strategy": "auto", "mode": "staged",
        "devices": {"cpu": {"capacity_bytes": 10**10}}, "inputs": {"height": 32, "width": 32, "batch_size": 1},
        "components": {n: {"class": "C", "weights_bytes": 1, "device_map": {"": "cpu"}, "stage": s}
                       for n, s in (("text_encoder", "encode"), ("unet", "denoise"), ("vae", "decode"))},
        "stages": [{"name": "encode", "components": ["text_encoder"], "peak_bytes": {}},
                   {"name": "denoise", "components": ["unet"], "peak_bytes": {}},
                   {"name": "decode", "components": ["vae"], "peak_bytes": {}},
                   {"name": "upscale", "components": ["vae"], "peak_bytes": {}}],
    }
    plan = Plan.from_json(document)
    assert [(s.consumes, s.produces, s.kind) for s in plan.stages] == [
        ((PROMPT,), (EMBEDS,), "encode"), ((EMBEDS,), (LATENTS,), "denoise"), ((LATENTS,), (IMAGES,), "decode"),
        ((), (), None)]
    assert plan.components["vae"].stages == ()
    assert "consumes" not in json.dumps(document)  # written as it was, read as it meant
    document["stages"][0]["produces"] = "embeds"
    with pytest.raises(ValueError, match="produces must be a list"):
        Plan.from_json(document)


def chain(name, sizes, **kw):
    return ComponentInput(name, "Model", [Block(f"blocks.{i}", s) for i, s in enumerate(sizes)], **kw)


def test_the_planner_gives_a_component_of_two_stages_one_map_and_room_in_both():
    """Staged: the VAE is placed with the first stage that runs it and keeps that map; the later stage places
    its other components in the room it leaves. Resident: it is placed (and counted) once."""
    text = chain("text_encoder", [3, 3])
    vae = chain("vae", [1], splittable=False, activation_peak=1)
    unet = chain("unet", [4, 4])
    stages = [Stage("encode", ("text_encoder", "vae")), Stage("denoise", ("unet",)), Stage("decode", ("vae", "text_encoder"))]
    devices = [Device(0, 10), Device(1, 10), Device("cpu", 100)]
    staged = plan_pipeline([text, vae, unet], stages, devices, mode="staged")
    assert [s.name for s in staged.stages] == ["encode", "denoise", "decode"]
    assert staged.components["vae"].stages == ("encode", "decode")
    assert staged.components["text_encoder"].stages == ("encode", "decode")
    encode, _, decode = staged.stages
    assert encode.peak_bytes == decode.peak_bytes  # the same maps, loaded again
    for stage in staged.stages:
        assert all(peak <= 10 for device, peak in stage.peak_bytes.items() if device != "cpu")
    resident = plan_pipeline([text, vae, unet], stages, devices, mode="resident")
    assert sum(u.weights for u in resident.stages[0].use.values()) == text.weights_bytes + vae.weights_bytes + unet.weights_bytes
    # a later stage's new component goes where the kept one leaves room
    small = chain("post", [9])
    later = [Stage("decode", ("vae",)), Stage("post", ("vae", "post"))]
    placed = plan_pipeline([vae, small], later, [Device(0, 10), Device(1, 10), Device("cpu", 100)], mode="staged")
    vae_device = placed.components["vae"].device_map[""]
    assert placed.components["post"].device_map == {"": 1 - vae_device}
    assert placed.offloaded_bytes == 0

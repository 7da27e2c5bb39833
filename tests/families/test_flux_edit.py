"""FLUX.1 image-to-image (FluxImg2ImgPipeline) and FLUX.1 Kontext (FluxKontextPipeline): the input image VAE-encoded in
its own stage, the denoise and decode as the stage loop runs them, pixel-identical to diffusers' own call, unsplit
and with the transformer split over two simulated devices; their rules; and plans of the real Kontext with a
reference (its tokens appended to the denoiser's)."""

import json

import numpy as np
import pytest

from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT, SEED, STEPS, SIZE = "a red fox in the snow", 7, 4, 32
REFERENCE = (48, 32)  # width, height: a Kontext reference of another size than the output
TRANSFORMER_UNITS = ("x_embedder", "time_text_embed", "context_embedder", "pos_embed", "transformer_blocks.0",
                     "single_transformer_blocks.0", "norm_out", "proj_out")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    root = tmp_path_factory.mktemp("flux-edit")
    return {name: write_random_pipeline(PRESETS_DIR / name, root / name, seed=0)
            for name in ("tiny-flux-img2img", "tiny-flux-kontext")}


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """A photo-like input (a gradient with noise) of REFERENCE size, stored with an EXIF rotation: the reader
    must turn it upright as diffusers' load_image does."""
    from PIL import Image

    rng = np.random.default_rng(0)
    width, height = REFERENCE
    ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    pixels = np.clip(ramp + rng.normal(0, 30, ramp.shape), 0, 255).astype(np.uint8)
    stored = Image.fromarray(pixels).transpose(Image.Transpose.ROTATE_90)  # stored sideways ...
    exif = Image.Exif()
    exif[0x0112] = 8  # ... and tagged "rotate 90 clockwise to view"
    path = tmp_path_factory.mktemp("inputs") / "fox.png"
    stored.save(path, exif=exif)
    return path


def hand_plan(folder, family, devices: int) -> dict:
    """The family's declared stages with their values; the transformer split over `devices` simulated devices
    (staged), or everything on the CPU (resident: one load)."""
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    stages = family.stages([c.name for c in source.components], None)
    maps = {c.name: {"": "cpu"} for c in source.components}
    if devices:
        maps["transformer"] = {unit: min(i * devices // len(TRANSFORMER_UNITS), devices - 1)
                               for i, unit in enumerate(TRANSFORMER_UNITS)}
        maps["vae"] = {"": devices - 1}
    used = {c.name: [s.name for s in stages if c.name in s.components] for c in source.components}
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32",
        "mode": "staged" if devices else "resident",  # staged: the VAE loads for each of its two stages
        "devices": {str(d): {"capacity_bytes": 10**9} for d in range(devices)} | {"cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1},
        "components": {c.name: {"class": c.cls, "device_map": maps[c.name], "stage": used[c.name][0],
                                "stages": used[c.name]} for c in source.components},
        "stages": [{"name": s.name, "components": list(s.components), "peak_bytes": {}, "consumes": list(s.consumes),
                    "produces": list(s.produces)} for s in stages],
    }


def settled_job(folder, settings: dict, images):
    """The job dmap runs: the generation settled and validated by the family, as `dmap run` does."""
    from dm_cli.families import Job, family_for
    from dm_cli.inputs import Generation
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    family = family_for(source.pipeline_class)
    comps = {c.name: c for c in source.components}
    generation = Generation(height=SIZE, width=SIZE, steps=STEPS, images=images).with_settings(settings)
    generation = family.settle(generation, comps["transformer"].config, comps["vae"].config)
    family.validate(generation, source.pipeline_class, comps["transformer"].config, comps["vae"].config, tuple(comps))
    return source, family, Job.of(generation, PROMPT, SEED)


def dmap_pixels(folder, settings: dict, images, devices: int):
    """The stage loop over the hand plan: encode, encode_image, denoise, decode; (pixels, split problems, stages)."""
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.loops.stages import StageLoop
    from dm_cli.run.sessions.session import frozen_gc

    source, family, job = settled_job(folder, settings, images)
    plan = Plan.from_json(json.loads(json.dumps(hand_plan(folder, family, devices))))
    with frozen_gc():  # as dmap run does: each unload's collection skips the libraries
        loop = StageLoop(source, plan, family, simulate=devices > 0, tracked_steps=None, measure=False)
        try:
            carry, results = loop.run_job(job)
        finally:
            loop.close()
    return np.array(carry.images[0]), loop.split_problems, [r.name for r in results if r.name != "load"]


def oracle(pipeline_class: str, folder, path, **kwargs):
    pipe = getattr(diffusers, pipeline_class).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    image = diffusers.utils.load_image(str(path))
    out = pipe(prompt=PROMPT, image=image, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
               height=SIZE, width=SIZE, **kwargs).images[0]
    return np.array(out)


STAGES = ["encode", "encode_image", "denoise", "decode"]


def test_flux_img2img_is_pixel_identical_to_diffusers_unsplit_and_split(folders, image_file):
    from dm_cli.io.input_images import describe_image

    folder = folders["tiny-flux-img2img"]
    expected = oracle("FluxImg2ImgPipeline", folder, image_file, strength=0.6)
    images = (describe_image(image_file),)
    for devices in (0, 2):
        pixels, problems, ran = dmap_pixels(folder, {}, images, devices)  # strength: the family's default, 0.6
        assert ran == STAGES and problems == []
        assert np.array_equal(pixels, expected), (devices, int(np.abs(pixels.astype(int) - expected).max()))
    # the input image matters, and strength does: another strength is another image
    other, _, _ = dmap_pixels(folder, {"strength": 0.9}, images, 0)
    assert not np.array_equal(other, expected)
    assert np.array_equal(other, oracle("FluxImg2ImgPipeline", folder, image_file, strength=0.9))


def test_flux_kontext_is_pixel_identical_to_diffusers_unsplit_and_split(folders, image_file, monkeypatch):
    """And the transformer sees the reference tokens as `reference_size` (the plan's trace) sizes them."""
    from dm_cli.families import call_spec
    from dm_cli.families.flux_kontext import reference_size
    from dm_cli.inputs import InputSpec
    from dm_cli.io.input_images import describe_image
    from dm_cli.model.sources import resolve_source

    folder = folders["tiny-flux-kontext"]
    settings = {"auto_resize": False, "max_area": SIZE * SIZE}  # the tiny twin at a tiny size: no 1024-pixel reference
    expected = oracle("FluxKontextPipeline", folder, image_file, _auto_resize=False, max_area=SIZE * SIZE)
    images = (describe_image(image_file),)
    assert images[0].size == REFERENCE  # upright, as load_image turns it
    calls = []
    forward = diffusers.FluxTransformer2DModel.forward

    def recording(self, hidden_states, *args, **kwargs):
        calls.append((tuple(hidden_states.shape), tuple(kwargs["img_ids"].shape)))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(diffusers.FluxTransformer2DModel, "forward", recording)
    for devices in (0, 2):
        pixels, problems, ran = dmap_pixels(folder, settings, images, devices)
        assert ran == STAGES and problems == []
        assert np.array_equal(pixels, expected), (devices, int(np.abs(pixels.astype(int) - expected).max()))
    ref_w, ref_h = reference_size(*REFERENCE, vae_scale=1, auto_resize=False)
    assert (ref_w, ref_h) == REFERENCE  # multiples of 2 already (the tiny VAE does not downscale)
    tokens = (SIZE // 2) ** 2 + (ref_w // 2) * (ref_h // 2)
    assert calls == [((1, tokens, 4), (tokens, 3))] * (2 * STEPS)
    # the plan's trace assumes the default resize (auto_resize on): the preferred resolution of the aspect ratio
    source = resolve_source(str(folder))
    comp = source.component("transformer")
    traced = call_spec(comp, source.pipeline_class, InputSpec(SIZE, SIZE, image_sizes=(REFERENCE,)))
    auto_w, auto_h = reference_size(*REFERENCE, vae_scale=1)
    assert (auto_w, auto_h) == (1248, 832)  # 3:2
    assert traced.kwargs["hidden_states"].shape == (1, (SIZE // 2) ** 2 + (auto_w // 2) * (auto_h // 2), 4)
    assert call_spec(comp, source.pipeline_class, InputSpec(SIZE, SIZE)).kwargs["hidden_states"].shape == (
        1, (SIZE // 2) ** 2, 4)
    # without a reference Kontext is text to image, as the pipeline is without `image`
    pipe = diffusers.FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    plain = np.array(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                          height=SIZE, width=SIZE, max_area=SIZE * SIZE).images[0])
    pixels, _, _ = dmap_pixels(folder, settings, (), 0)
    assert np.array_equal(pixels, plain) and not np.array_equal(plain, expected)


def test_reference_size_and_preferred_resolutions_are_the_pipelines():
    from diffusers.pipelines.flux import pipeline_flux_kontext

    from dm_cli.families.flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS, kept_size, output_size, reference_size

    assert list(PREFERRED_KONTEXT_RESOLUTIONS) == pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS
    assert reference_size(1024, 1024, 8) == (1024, 1024)
    assert reference_size(4000, 3000, 8) == (1184, 880)  # 4:3 -> the nearest preferred ratio
    assert reference_size(1023, 777, 8, auto_resize=False) == (1008, 768)
    assert output_size(1024, 1024, 1024**2, 8) == (1024, 1024)
    assert output_size(768, 1024, 1024**2, 8) == (880, 1168)
    height, width = kept_size(768, 1024, 1024**2, 8)
    assert output_size(height, width, 1024**2, 8) == (height, width)


def test_rules_one_sentence_each(folders, image_file):
    from dm_cli.errors import UsageError
    from dm_cli.io.input_images import describe_image

    image = describe_image(image_file)
    kontext, img2img = folders["tiny-flux-kontext"], folders["tiny-flux-img2img"]
    with pytest.raises(UsageError, match=r"^FLUX.1 image-to-image needs an input image: add --image PATH\.$"):
        settled_job(img2img, {}, ())
    with pytest.raises(UsageError, match="leaves none of the 4 steps"):
        settled_job(img2img, {"strength": 0.0}, (image,))
    with pytest.raises(UsageError, match="--strength must be from 0 to 1"):
        settled_job(img2img, {"strength": 1.5}, (image,))
    with pytest.raises(UsageError, match="at most 1 input image"):
        settled_job(img2img, {}, (image, image))
    with pytest.raises(UsageError, match="--max-area is for FLUX.1 Kontext"):
        settled_job(img2img, {"max_area": 1024}, (image,))
    with pytest.raises(UsageError, match="--strength is for FLUX.1 image-to-image"):
        settled_job(kontext, {"strength": 0.5}, (image,))
    with pytest.raises(UsageError, match="--auto-resize must be true or false"):
        settled_job(kontext, {"auto_resize": 2}, (image,))
    # a size the pipeline would resize is refused, naming sizes it keeps
    with pytest.raises(UsageError, match=r"ask for --height 36 --width 36, or keep 32x32 with --max-area 1024\.$"):
        settled_job(kontext, {"max_area": 32 * 40}, (image,))


def test_families_match_before_flux_and_run_their_own_pipelines():
    from dm_cli.families import FAMILY_MODULES, family_for

    assert FAMILY_MODULES.index("flux_kontext") < FAMILY_MODULES.index("flux")
    assert FAMILY_MODULES.index("flux_img2img") < FAMILY_MODULES.index("flux")
    assert family_for("FluxKontextPipeline").name == "flux-kontext"
    assert family_for("FluxImg2ImgPipeline").name == "flux-img2img"
    assert family_for("FluxPipeline").name == "flux"
    assert family_for("FluxKontextInpaintPipeline").name == "flux"  # traced as FLUX, not run
    assert family_for(None, "FluxTransformer2DModel").name == "flux-kontext"  # a lone transformer: the first match


def test_plan_flux_kontext_with_a_1024_reference_fits_two_24gb_gpus():
    from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions
    from dm_cli.planning.trace.trace import trace_component

    plan = make_plan("flux-kontext", PlanOptions(PlacementSpec("0=24GB,1=24GB,cpu=64GB"), check=False,
                                                 generation=Generation(height=1024, width=1024,
                                                                       images=(InputImage(1024, 1024),))))
    assert [s.name for s in plan.stages] == STAGES and plan.components["vae"].stages == ("encode_image", "decode")
    assert plan.offloaded_bytes == 0 and plan.dtype == "bfloat16"
    assert all(peak <= 24e9 for s in plan.stages for d, peak in s.peak_bytes.items() if d != "cpu")
    source = resolve_source("flux-kontext")
    comp = source.component("transformer")
    alone = trace_component(comp, source.pipeline_class, InputSpec(1024, 1024), "bfloat16").activation_peak
    with_reference = plan.activation_peaks["transformer"]
    print(f"Kontext transformer activations at 1024x1024: {alone / 1e9:.3f} GB alone, "
          f"{with_reference / 1e9:.3f} GB with a 1024x1024 reference")
    assert with_reference > 1.5 * alone


def test_image_reaches_the_pipeline_from_the_cli_the_api_and_a_queue_item(folders, image_file, tmp_path):
    """`dmap run --image`, `dm_cli.load(...).generate(image=...)` (a path and a PIL image) and a JSONL item's
    "image": the same pixels as diffusers' own call, and the input's digest in each output's metadata."""
    from conftest import run_dmap
    from PIL import Image

    import dm_cli

    folder = folders["tiny-flux-img2img"]
    expected = oracle("FluxImg2ImgPipeline", folder, image_file, strength=0.6)
    common = ["--steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE), "--seed", str(SEED),
              "--max-memory", "cpu=8GB"]
    code, _, err = run_dmap("run", str(folder), "-p", PROMPT, "--image", str(image_file), *common,
                            "-o", str(tmp_path / "cli.png"), "--json")
    assert code == 0, err
    with Image.open(tmp_path / "cli.png") as image:
        assert np.array_equal(np.array(image), expected) and image.text["input_images"].startswith("48x32:")
        digest = image.text["input_images"]
    with dm_cli.load(str(folder), max_memory="cpu=8GB", height=SIZE, width=SIZE) as session:
        (by_path,) = session.generate([PROMPT], seed=SEED, steps=STEPS, image=str(image_file))
        upright = diffusers.utils.load_image(str(image_file))
        (by_pil,) = session.generate([PROMPT], seed=SEED, steps=STEPS, image=upright)
    assert np.array_equal(np.array(by_path.image), expected) and by_path.metadata["input_images"] == digest
    assert np.array_equal(np.array(by_pil.image), expected) and by_pil.metadata["input_images"].startswith("48x32:")
    line = {"prompt": PROMPT, "seed": SEED, "image": str(image_file), "output": "q.png"}
    (tmp_path / "q.jsonl").write_text(json.dumps(line) + "\n")
    code, _, err = run_dmap("run", str(folder), "--prompts", str(tmp_path / "q.jsonl"), *common,
                            "-o", str(tmp_path / "q"), "--json")
    assert code == 0, err
    with Image.open(tmp_path / "q" / "q.png") as image:
        assert np.array_equal(np.array(image), expected) and image.text["input_images"] == digest
    code, _, err = run_dmap("run", str(folder), "-p", PROMPT, *common, "-o", str(tmp_path / "none.png"))
    assert code == 2 and "needs an input image" in err, err

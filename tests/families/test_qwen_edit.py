"""Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline), Qwen-Image-Edit (QwenImageEditPipeline) and Qwen-Image
image-to-image (QwenImageImg2ImgPipeline): the images VAE-encoded in their own stage, the prompt encoded with their
vision tokens, pixel-identical to diffusers' own call unsplit and with the transformer split over two simulated
devices; the sizes and tokens the plan assumes; the torchvision-free processor; exact counts of the real preset; and
the activation estimate against the CPU profiler with 0, 1 and 3 images.

The edit pipelines resize every image to about 1024² pixels for the VAE (the module's VAE_IMAGE_SIZE), whatever the
output size: 16,384 tokens per image for the tiny twin, minutes per run on a CPU. The pixel tests shrink that constant
to 64² for diffusers and dmap alike (dmap's run reads the pipeline module's constant); the plan tests use the real one.
"""

import json

import numpy as np
import pytest
from conftest import run_dmap
from test_qwenimage import units  # placement units in registration order

from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT, NEGATIVE, SEED, STEPS, SIZE = "a red fox in the snow", "blurry", 7, 2, 32
IMAGES = ((48, 32), (32, 40))  # (width, height) of the two input images: other sizes and aspects than the output
STAGES = ["encode", "encode_image", "denoise", "decode"]
# reference sizes.json (diffusers 0.42.1 / transformers 5.24.0, built on the meta device)
SIZES = {
    "qwen-image-edit": {"text_encoder": ("Qwen2_5_VLForConditionalGeneration", 8_292_166_656),
                        "transformer": ("QwenImageTransformer2DModel", 20_430_401_088),
                        "vae": ("AutoencoderKLQwenImage", 126_892_531)},
    "tiny-qwenimage-edit": {"text_encoder": ("Qwen2_5_VLForConditionalGeneration", 4_897_712),
                            "transformer": ("QwenImageTransformer2DModel", 190_720),
                            "vae": ("AutoencoderKLQwenImage", 4_054_447)},
}


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS_DIR / "tiny-qwenimage-edit", tmp_path_factory.mktemp("edit") / "tiny", seed=0)


@pytest.fixture(scope="module")
def img2img_folder(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    return write_random_pipeline(PRESETS_DIR / "tiny-qwenimage-img2img", tmp_path_factory.mktemp("i2i") / "tiny", seed=0)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("inputs")
    paths = []
    for i, (width, height) in enumerate(IMAGES):
        ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
        pixels = np.clip(ramp + rng.normal(0, 30, ramp.shape), 0, 255).astype(np.uint8)
        paths.append(root / f"in{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


@pytest.fixture()
def small_vae_size(monkeypatch):
    """The Plus pipeline's VAE_IMAGE_SIZE at 64² for this test: diffusers' __call__ and dmap's encode_image read it."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)




def hand_plan(folder, devices: int) -> dict:
    """The family's declared stages; the transformer split over `devices` simulated devices (its blocks halved),
    the VAE on the last one (staged: it loads for each of its two stages), or everything on the CPU (resident)."""
    from dm_cli.families import family_for
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    family = family_for(source.pipeline_class)
    stages = family.stages([c.name for c in source.components], None)
    comps = {c.name: c for c in source.components}
    maps = {name: {"": "cpu"} for name in comps}
    if devices:
        den = comps["transformer"]
        names = units(build_on_meta(den.library, den.cls, den.config))
        per = -(-len(names) // devices)
        maps["transformer"] = {unit: i // per for i, unit in enumerate(names)}
        maps["vae"] = {"": devices - 1}
    used = {name: [s.name for s in stages if name in s.components] for name in comps}
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32",
        "mode": "staged" if devices else "resident",
        "devices": {str(d): {"capacity_bytes": 10**9} for d in range(devices)} | {"cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1},
        "components": {n: {"class": c.cls, "device_map": maps[n], "stage": used[n][0], "stages": used[n]}
                       for n, c in comps.items()},
        "stages": [{"name": s.name, "components": list(s.components), "peak_bytes": {}, "consumes": list(s.consumes),
                    "produces": list(s.produces)} for s in stages],
    }


def dmap_pixels(folder, paths, devices: int, negative=None, settings=None):
    """The stage loop over the hand plan, for the job `dmap run` settles: (pixels, split problems, stages run)."""
    from dm_cli.families import Job, family_for
    from dm_cli.inputs import Generation
    from dm_cli.io.input_images import describe_image
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.loops.stages import StageLoop
    from dm_cli.run.sessions.session import frozen_gc

    source = resolve_source(str(folder))
    family = family_for(source.pipeline_class)
    comps = {c.name: c for c in source.components}
    generation = Generation(height=SIZE, width=SIZE, steps=STEPS, negative_prompt=negative,
                            images=tuple(describe_image(p) for p in paths)).with_settings(settings or {})
    generation = family.settle(generation, comps["transformer"].config, comps["vae"].config)
    family.validate(generation, source.pipeline_class, comps["transformer"].config, comps["vae"].config, tuple(comps))
    plan = Plan.from_json(json.loads(json.dumps(hand_plan(folder, devices))))
    with frozen_gc():
        loop = StageLoop(source, plan, family, simulate=devices > 0, tracked_steps=None, measure=False)
        try:
            carry, results = loop.run_job(Job.of(generation, PROMPT, SEED))
        finally:
            loop.close()
    return np.array(carry.images[0]), loop.split_problems, [r.name for r in results if r.name != "load"]


def oracle(pipeline_class: str, folder, paths, **kwargs):
    """diffusers' own call on the same folder (the processor: dmap's torchvision-free one, which the folder's
    Qwen2VLProcessor cannot be without torchvision)."""
    from dm_cli.model.tokenizers import qwen2_vl_processor

    extra = {"processor": qwen2_vl_processor(folder / "processor")} if (folder / "processor").is_dir() else {}
    pipe = getattr(diffusers, pipeline_class).from_pretrained(folder, **extra)
    pipe.set_progress_bar_config(disable=True)
    images = [diffusers.utils.load_image(str(p)) for p in paths]
    image = images if pipeline_class == "QwenImageEditPlusPipeline" else images[0]
    out = pipe(image=image, prompt=PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
               height=SIZE, width=SIZE, **kwargs).images[0]
    return np.array(out)


def check_identical(folder, paths, negative=None):
    expected = oracle("QwenImageEditPlusPipeline", folder, paths, negative_prompt=negative)
    for devices in (0, 2):
        pixels, problems, ran = dmap_pixels(folder, paths, devices, negative)
        assert ran == STAGES and problems == [], (devices, problems)
        assert np.array_equal(pixels, expected), (devices, int(np.abs(pixels.astype(int) - expected).max()))
    return expected


def test_edit_plus_with_one_image_is_pixel_identical_to_diffusers_unsplit_and_split(edit_folder, image_files,
                                                                                      small_vae_size, monkeypatch):
    """And the transformer sees the output's tokens, then the image's, as the family counts them."""
    from dm_cli.families.qwenimage_edit import calculate_dimensions

    calls = []
    forward = diffusers.QwenImageTransformer2DModel.forward

    def recording(self, hidden_states, *args, **kwargs):
        calls.append((tuple(hidden_states.shape), kwargs["img_shapes"]))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(diffusers.QwenImageTransformer2DModel, "forward", recording)
    check_identical(edit_folder, image_files[:1])
    vae_w, vae_h = calculate_dimensions(64 * 64, IMAGES[0][0] / IMAGES[0][1])
    ref = (vae_h // 4 // 2) * (vae_w // 4 // 2)  # the tiny VAE's scale is 4
    shapes = [[(1, SIZE // 8, SIZE // 8), (1, vae_h // 8, vae_w // 8)]]
    assert calls == [((1, (SIZE // 8) ** 2 + ref, 16), shapes)] * (3 * STEPS)  # oracle, unsplit, split


@pytest.mark.slow
@pytest.mark.parametrize("negative", [None, NEGATIVE])
def test_edit_plus_with_two_images_is_pixel_identical_with_and_without_a_negative_prompt(edit_folder, image_files,
                                                                                          small_vae_size, negative):
    check_identical(edit_folder, image_files, negative)


@pytest.mark.slow
def test_edit_plus_with_one_image_and_a_negative_prompt_is_pixel_identical(edit_folder, image_files, small_vae_size):
    one = check_identical(edit_folder, image_files[:1], NEGATIVE)
    assert not np.array_equal(one, oracle("QwenImageEditPlusPipeline", edit_folder, image_files[:1]))


@pytest.mark.slow
def test_edit_with_one_image_is_pixel_identical_to_diffusers_unsplit_and_split(tmp_path_factory, image_files,
                                                                                monkeypatch):
    """QwenImageEditPipeline: one image, for Qwen2.5-VL and the VAE at the same size; its module has no constant,
    so its calculate_dimensions is asked for 1/256 of the area (64² for 1024²), for diffusers and dmap alike."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    from dm_cli.model.demo import write_random_pipeline

    full = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: full(area // 256, ratio))

    folder = write_random_pipeline(PRESETS_DIR / "tiny-qwenimage-edit-single", tmp_path_factory.mktemp("e1") / "t", seed=0)
    expected = oracle("QwenImageEditPipeline", folder, image_files[:1], negative_prompt=NEGATIVE)
    for devices in (0, 2):
        pixels, problems, ran = dmap_pixels(folder, image_files[:1], devices, NEGATIVE)
        assert ran == STAGES and problems == [], problems
        assert np.array_equal(pixels, expected), (devices, int(np.abs(pixels.astype(int) - expected).max()))


def test_img2img_at_strength_0_6_is_pixel_identical_to_diffusers_unsplit_and_split(img2img_folder, image_files):
    folder = img2img_folder
    expected = oracle("QwenImageImg2ImgPipeline", folder, image_files[:1], strength=0.6)
    for devices in (0, 2):
        pixels, problems, ran = dmap_pixels(folder, image_files[:1], devices)  # the family's default: 0.6
        assert ran == STAGES and problems == [], problems
        assert np.array_equal(pixels, expected), (devices, int(np.abs(pixels.astype(int) - expected).max()))


def test_the_copied_constants_and_sizes_are_the_pipelines():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as transformers_resize

    from dm_cli.families import qwenimage_edit as family

    assert family.CONDITION_IMAGE_SIZE == pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE
    assert family.VAE_IMAGE_SIZE == pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE
    for ratio in (1.0, 1.5, 0.8, 16 / 9):
        assert family.calculate_dimensions(1024**2, ratio) == pipeline_qwenimage_edit_plus.calculate_dimensions(
            1024**2, ratio) == pipeline_qwenimage_edit.calculate_dimensions(1024**2, ratio)[:2]
    for height, width in ((384, 384), (320, 480), (1024, 1024), (20, 4000), (5000, 3000)):
        assert family.smart_resize(height, width, 28) == transformers_resize(height, width, 28, 3136, 12845056)
    assert family.vision_tokens(384, 384, {}) == 196 and family.reference_tokens(1024, 1024, 8) == 4096


def test_the_offline_processor_gives_the_vision_tokens_the_text_encoder_expects(edit_folder):
    """Qwen2VLProcessor needs torchvision in transformers 5; dmap's PIL one puts as many image tokens at the encoder's
    image_token_id as the vision tower makes (the model checks the count), and the folder loads through dmap."""
    from PIL import Image

    from dm_cli.families.qwenimage_edit import vision_tokens
    from dm_cli.model.sources import resolve_source
    from dm_cli.model.tokenizers import qwen2_vl_processor
    from dm_cli.run.load.loading import build_pipeline

    folder = edit_folder
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    processor = qwen2_vl_processor(folder / "processor")
    text = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>a red fox"
    out = processor(text=[text], images=[Image.new("RGB", (384, 384))], padding=True, return_tensors="pt")
    image_tokens = int((out["input_ids"] == config["image_token_id"]).sum())
    assert image_tokens == vision_tokens(384, 384, config["vision_config"]) == 196
    assert out["image_grid_thw"].tolist() == [[1, 28, 28]] and out["pixel_values"].shape == (784, 3 * 2 * 14 * 14)
    pipe = build_pipeline(resolve_source(str(folder)), torch.float32, {})
    assert type(pipe.processor).__name__ == "ImageOnlyQwen2VLProcessor"


@pytest.mark.parametrize("preset", sorted(SIZES) + ["qwen-image-edit-2511"])
def test_inspect_counts_match_the_reference_exactly(preset):
    code, out, err = run_dmap("inspect", preset, "--json")
    assert code == 0, err
    got = {c["name"]: (c["class"], c["params"]) for c in json.loads(out)["components"] if c.get("params")}
    assert got == SIZES.get(preset, SIZES["qwen-image-edit"])


def test_families_rules_and_default_size(edit_folder, image_files):
    from dm_cli.errors import UsageError
    from dm_cli.families import FAMILY_MODULES, family_for
    from dm_cli.inputs import Generation, InputImage

    assert FAMILY_MODULES.index("qwenimage_edit") < FAMILY_MODULES.index("qwenimage")
    assert family_for("QwenImageEditPlusPipeline").name == "qwen-image-edit-plus"
    assert family_for("QwenImageEditPipeline").name == "qwen-image-edit"
    assert family_for("QwenImageImg2ImgPipeline").name == "qwen-image-img2img"
    assert family_for("QwenImagePipeline").name == "qwen-image"
    assert family_for(None, "QwenImageTransformer2DModel").name == "qwen-image"  # a lone transformer: text to image
    plus, edit = family_for("QwenImageEditPlusPipeline"), family_for("QwenImageEditPipeline")
    config = json.loads((edit_folder / "transformer" / "config.json").read_text())
    vae = json.loads((edit_folder / "vae" / "config.json").read_text())

    def settle(family, **kwargs):
        generation = family.settle(Generation(**kwargs), config, vae)
        family.validate(generation, family.pipelines[0], config, vae)
        return generation

    wide, tall = InputImage(1600, 900), InputImage(600, 800)
    assert (settle(plus, images=(tall, wide)).width, settle(plus, images=(tall, wide)).height) == (1376, 768)  # last
    assert (settle(edit, images=(tall,)).width, settle(edit, images=(tall,)).height) == (896, 1184)
    with pytest.raises(UsageError, match=r"^Qwen-Image-Edit-Plus needs an input image: add --image PATH\.$"):
        settle(plus)
    with pytest.raises(UsageError, match="at most 3 input image"):
        settle(plus, images=(wide,) * 4)
    with pytest.raises(UsageError, match="at most 1 input image"):
        settle(edit, images=(wide,) * 2)
    with pytest.raises(UsageError, match="makes one image per prompt: drop --num-images"):
        settle(plus, images=(wide,), num_images=2)
    assert settle(edit, images=(wide,), num_images=2).num_images == 2
    with pytest.raises(UsageError, match=r"leaves a 4000x20 image no usable side"):
        settle(plus, images=(InputImage(4000, 20),))
    code, _, err = run_dmap("plan", "tiny-qwenimage-img2img", "--image-size", "32x32", "--strength", "1.5", "-q")
    assert code == 2 and "--strength must be from 0 to 1" in err, err


def test_plan_qwen_image_edit_traces_the_references_tokens_and_vision_tokens():
    from dm_cli.families import call_spec, family_for
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import trace_message

    source = resolve_source("qwen-image-edit")
    transformer, encoder, vae = (source.component(n) for n in ("transformer", "text_encoder", "vae"))
    three = InputSpec(1024, 1024, image_sizes=((1024, 1024), (1600, 900), (512, 512)))
    spec = call_spec(transformer, source.pipeline_class, three)
    assert spec.kwargs["hidden_states"].shape == (1, 4096 + 4096 + 4128 + 4096, 64)
    assert spec.kwargs["img_shapes"] == [[(1, 64, 64), (1, 64, 64), (1, 48, 86), (1, 64, 64)]]
    text = spec.kwargs["encoder_hidden_states"].shape[1]
    assert text == 512 + 3 * 6 + 196 + 180 + 196  # the prompt, and each image's "Picture N:" and vision tokens
    assert "4096 image tokens + 12320 reference tokens (4096 + 4128 + 4096)" in trace_message(transformer, spec, three)
    # what `dmap plan` reports per image (Input images: ... tokens), and trims to fit
    assert family_for(source.pipeline_class).reference_tokens(three, vae.config) == (4096, 4128, 4096)
    assert call_spec(encoder, source.pipeline_class, three).kwargs["input_ids"].shape == (1, 64 + text + 5)
    # the VAE is traced for the larger of its two stages: the 1376x768 encode of the wide image, or the decode
    larger = call_spec(vae, source.pipeline_class, three)
    assert larger.method == "encode" and larger.kwargs["x"].shape == (1, 3, 1, 768, 1376)
    one = InputSpec(1024, 1024, image_sizes=((1024, 1024),))
    assert call_spec(vae, source.pipeline_class, one).method == "decode"


def edit_call_peaks(config: dict, size: int, references: tuple) -> tuple[int, int]:
    """(measured, estimated) activation peak of one Qwen-Image-Edit-Plus transformer call with these images: the
    CPU profiler over the inputs the family's call spec makes (scripts/measure_activations.py's way), against the
    meta trace of the same call."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    from dm_cli.inputs import InputSpec

    inputs = InputSpec(size, size, image_sizes=references)
    return measure_activations.family_call_peaks("QwenImageTransformer2DModel", config, "QwenImageEditPlusPipeline", size, inputs=inputs)


def test_activation_estimate_with_0_1_and_3_images_matches_the_cpu_profiler(monkeypatch):
    """A reduced Qwen-Image-Edit-2511 transformer (its 128-wide heads and zero_cond_t, 2 heads, 2 blocks), 256x256
    output (256 tokens), 512 text tokens; the VAE size shrunk to 256² so that each image adds 256 tokens (at the real
    1024² one image adds 4,096: a minute of CPU per call): within ±20%."""
    import sys

    from conftest import REPO

    from dm_cli.families import qwenimage_edit

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    monkeypatch.setattr(qwenimage_edit, "VAE_IMAGE_SIZE", 256 * 256)
    config = dict(measure_activations.reduced_qwenimage_config(heads=2, layers=2), zero_cond_t=True)
    ratios = {}
    for count in (0, 1, 3):
        measured, estimated = edit_call_peaks(config, 256, ((256, 256),) * count)
        assert measured > 1_000_000
        ratios[count] = estimated / measured
        print(f"{count} images: measured {measured / 1e6:.2f} MB, estimated {estimated / 1e6:.2f} MB, "
              f"ratio {ratios[count]:.3f}")
    assert all(0.8 <= r <= 1.2 for r in ratios.values()), ratios

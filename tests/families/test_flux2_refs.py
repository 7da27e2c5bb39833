"""FLUX.2 [dev] and [klein] with reference images (`image=`): the references VAE-encoded in their own stage, the
denoise through the pipeline's own __call__, pixel-identical to diffusers' own call with 1 and 2 references,
unsplit and with the transformer split over two simulated devices; the sizes and tokens the plan assumes; the
rules on references; and the real FLUX.2 [dev] planned with three."""

import functools
import json

import numpy as np
import pytest
from conftest import run_dmap
from test_flux2 import PIPELINES, PROMPT, SEED, SIZE, STEPS, TOKENS, diffusers_pipeline, flux2_folders, split_plan  # noqa: F401

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

REFERENCES = ((64, 80), (96, 64))  # width, height: two sizes, neither the output's (the pipeline's minimum side is 64)


@pytest.fixture(scope="module")
def reference_files(tmp_path_factory):
    """Photo-like references (a gradient with noise), one per REFERENCES size, the second stored with an EXIF
    rotation the reader must undo as diffusers' load_image does."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("references")
    rng = np.random.default_rng(1)
    paths = []
    for n, (width, height) in enumerate(REFERENCES):
        ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)[:, :, ::-1 if n else 1]
        image = Image.fromarray(np.clip(ramp + rng.normal(0, 40, ramp.shape), 0, 255).astype(np.uint8))
        path = folder / f"ref{n}.png"
        if n:
            exif = Image.Exif()
            exif[0x0112] = 8  # "rotate 90 clockwise to view": stored sideways
            image.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif)
        else:
            image.save(path)
        paths.append(path)
    return paths


@functools.lru_cache(maxsize=None)
def oracle_pipeline(folder):
    pipe = diffusers_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def oracle(folder, paths):
    """diffusers' own call with the references as load_image reads them (one: a lone image, not a list)."""
    pipe = oracle_pipeline(folder)
    images = [diffusers.utils.load_image(str(p)) for p in paths]
    image = pipe(prompt=PROMPT, image=(images[0] if len(images) == 1 else images) or None, num_inference_steps=STEPS,
                 generator=torch.Generator().manual_seed(SEED), height=SIZE, width=SIZE,
                 max_sequence_length=TOKENS, text_encoder_out_layers=(1,)).images[0]
    return np.array(image)


def reference_plan(folder, n_devices: int) -> dict:
    """test_flux2's hand plan (transformer and text encoder split over n devices, or all on the CPU), with the
    family's declared stages: encode, encode_image, denoise, decode (the VAE in two of them)."""
    from dm_cli.families import family_for
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    stages = family_for(source.pipeline_class).stages([c.name for c in source.components], None)
    plan = split_plan(folder, n_devices) if n_devices else split_plan(folder, 1)
    if not n_devices:
        plan["components"] = {n: {**c, "device_map": {"": "cpu"}} for n, c in plan["components"].items()}
        plan["devices"] = {"cpu": {"capacity_bytes": 10**10}}
    for name, comp in plan["components"].items():
        comp["stages"] = [s.name for s in stages if name in s.components]
        comp["stage"] = comp["stages"][0]
    plan["stages"] = [{"name": s.name, "components": list(s.components), "peak_bytes": {},
                       "consumes": list(s.consumes), "produces": list(s.produces)} for s in stages]
    return plan


def dmap_run(folder, paths, tmp_path, n_devices: int):
    """`dmap run` in-process with `--image` per reference, on the hand plan (`--simulate` when split)."""
    from PIL import Image

    plan_path = tmp_path / f"plan-{n_devices}.json"
    plan_path.write_text(json.dumps(reference_plan(folder, n_devices)))
    out = tmp_path / f"{len(paths)}-{n_devices}.png"
    images = [arg for p in paths for arg in ("--image", str(p))]
    code, stdout, err = run_dmap("run", str(folder), "-p", PROMPT, *images, "--steps", STEPS, "--height", SIZE,
                                 "--width", SIZE, "--seed", SEED, "--max-sequence-length", TOKENS, "-d", plan_path,
                                 "-o", out, "--json", *(["--simulate"] if n_devices else []))
    assert code == 0, err
    with Image.open(out) as image:
        return np.array(image), dict(image.text), json.loads(stdout)


@pytest.mark.parametrize("count", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~15 s more per twin
@pytest.mark.parametrize("preset", list(PIPELINES))
def test_references_are_pixel_identical_to_diffusers_unsplit_and_split(preset, count, flux2_folders,
                                                                        reference_files, tmp_path, monkeypatch):
    """And the transformer sees the sequence the plan's trace assumes: the generated tokens, then each
    reference's, at every call."""
    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source

    folder, paths = flux2_folders[preset], reference_files[:count]
    expected = oracle(folder, paths)
    if count == 1:
        assert not np.array_equal(expected, oracle(folder, []))  # the references change the image
    calls = []
    forward = diffusers.Flux2Transformer2DModel.forward

    def recording(self, hidden_states, *args, **kwargs):
        calls.append((tuple(hidden_states.shape), tuple(kwargs["img_ids"].shape)))
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(diffusers.Flux2Transformer2DModel, "forward", recording)
    for n_devices in (0, 2):
        pixels, text, result = dmap_run(folder, paths, tmp_path, n_devices)
        assert np.array_equal(pixels, expected), (preset, count, n_devices,
                                                  int(np.abs(pixels.astype(int) - expected).max()))
        assert [s["name"] for s in result["stages"] if s["name"] != "load"] == [
            "encode", "encode_image", "denoise", "decode"]
        assert len(text["input_images"].split(",")) == count, text["input_images"]  # each input's size and digest
        if n_devices:
            assert result["split_check"] and result["split_problems"] == [], result
    source = resolve_source(str(folder))
    spec = call_spec(source.component("transformer"), source.pipeline_class,
                     InputSpec(SIZE, SIZE, image_sizes=REFERENCES[:count], max_sequence_length=TOKENS))
    sequence = (SIZE // 2) ** 2 + sum(w // 2 * h // 2 for w, h in REFERENCES[:count])  # the tiny VAE keeps the size
    assert spec.kwargs["hidden_states"].shape == (1, sequence, 4) and spec.kwargs["img_ids"].shape == (1, sequence, 4)
    true_cfg = json.loads((folder / "model_index.json").read_text()).get("is_distilled") is False
    per_run = STEPS * (2 if true_cfg else 1)  # [klein] base: a second, unconditional call per step
    assert calls == [((1, sequence, 4), (1, sequence, 4))] * (2 * per_run)  # oracle's calls came before the patch


def test_reference_size_is_the_pipelines_resize(reference_files):
    """`reference_size` against Flux2Pipeline's own step 4 (resize to about 1024^2, crop to multiples of 16)
    on images of several sizes and aspect ratios, as the real VAE's scale (8) sizes them."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from PIL import Image

    from dm_cli.families.flux2 import reference_size, tokens_per_reference

    processor = Flux2ImageProcessor(vae_scale_factor=16)
    for width, height in ((1024, 1024), (1023, 777), (2000, 1500), (4000, 3000), (1500, 300), (64, 64), (1536, 1024)):
        image = Image.new("RGB", (width, height))
        if width * height > 1024 * 1024:
            image = processor._resize_to_target_area(image, 1024 * 1024)
        tensor = processor.preprocess(image, height=image.height // 16 * 16, width=image.width // 16 * 16,
                                      resize_mode="crop")
        assert reference_size(width, height, 8) == (tensor.shape[3], tensor.shape[2]), (width, height)
    assert tokens_per_reference(1024, 1024, 8) == 4096  # one 1024^2 reference doubles a 1024^2 sequence
    assert tokens_per_reference(4000, 3000, 8) == tokens_per_reference(1182, 886, 8) == 73 * 55


def test_rules_one_sentence_each(flux2_folders, reference_files, tmp_path):
    from PIL import Image

    folder = flux2_folders["tiny-flux2"]
    common = ["-p", PROMPT, "--steps", STEPS, "--height", SIZE, "--width", SIZE, "--max-memory", "cpu=8GB"]
    small, wide = tmp_path / "small.png", tmp_path / "wide.png"
    Image.new("RGB", (63, 100)).save(small)
    Image.new("RGB", (900, 100)).save(wide)
    code, _, err = run_dmap("run", str(folder), "--image", small, *common, "-o", tmp_path / "a.png")
    assert code == 2 and "at least 64x64 pixels, and reference 1 is 63x100" in err, err
    code, _, err = run_dmap("run", str(folder), "--image", reference_files[0], "--image", wide, *common,
                            "-o", tmp_path / "b.png")
    assert code == 2 and "8:1 aspect ratio, and reference 2 is 900x100" in err, err
    eleven = [arg for _ in range(11) for arg in ("--image", str(reference_files[0]))]
    code, _, err = run_dmap("run", str(folder), *eleven, *common, "-o", tmp_path / "c.png")
    assert code == 2 and "at most 10 input image(s), not 11" in err, err
    code, _, err = run_dmap("plan", "flux2", "--image-size", "50x900", "--max-memory", "0=80GB,cpu=200GB")
    assert code == 2 and "reference 1 is 50x900" in err, err


def test_a_plan_without_an_encode_image_stage_refuses_references(flux2_folders, reference_files, tmp_path):
    """A FLUX.2 plan written before references (encode, denoise, decode) runs text to image as before, and
    refuses references in one sentence rather than dropping them."""
    folder = flux2_folders["tiny-flux2"]
    plan_path = tmp_path / "old.json"
    plan_path.write_text(json.dumps(split_plan(folder, 2)))
    common = ["-p", PROMPT, "--steps", STEPS, "--height", SIZE, "--width", SIZE, "--seed", SEED,
              "--max-sequence-length", TOKENS, "-d", plan_path, "--simulate"]
    code, _, err = run_dmap("run", str(folder), "--image", reference_files[0], *common, "-o", tmp_path / "r.png")
    assert code == 2 and "no encode_image stage" in err, err
    code, _, err = run_dmap("run", str(folder), *common, "-o", tmp_path / "t.png")
    assert code == 0, err


def test_plan_reports_reference_tokens_and_the_vae_encode_of_a_larger_reference():
    """The transformer's trace carries each reference's tokens; the VAE is traced for the larger of its two
    stages (a reference bigger than the output: its encode)."""
    from dm_cli.families import call_spec
    from dm_cli.inputs import InputSpec
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import trace_message

    source = resolve_source("flux2")
    transformer, vae = source.component("transformer"), source.component("vae")
    three = InputSpec(1024, 1024, image_sizes=((1024, 1024), (2000, 1500), (768, 512)))
    spec = call_spec(transformer, source.pipeline_class, three)
    assert spec.kwargs["hidden_states"].shape == (1, 4096 + 4096 + 4015 + 1536, 128)
    assert "4096 image tokens + 9647 reference tokens (4096 + 4015 + 1536)" in trace_message(transformer, spec, three)
    assert call_spec(vae, source.pipeline_class, three).method == "decode"  # no reference larger than the output
    small = InputSpec(512, 512, image_sizes=((1024, 1024),))
    encode = call_spec(vae, source.pipeline_class, small)
    assert encode.method == "encode" and encode.kwargs["x"].shape == (1, 3, 1024, 1024)


def reference_call_peaks(config: dict, size: int, references: tuple) -> tuple[int, int]:
    """(measured, estimated) activation peak of one FLUX.2 transformer call with these references' tokens:
    the CPU profiler over the inputs the family's call spec makes (scripts/measure_activations.py's way),
    against the meta trace of the same call."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    from dm_cli.inputs import InputSpec

    inputs = InputSpec(size, size, max_sequence_length=measure_activations.FLUX2_TEXT_TOKENS, image_sizes=references)
    return measure_activations.family_call_peaks("Flux2Transformer2DModel", config, "Flux2Pipeline", size, inputs=inputs)


def test_activation_estimate_with_0_1_and_3_references_matches_the_cpu_profiler():
    """A reduced-width FLUX.2 transformer ([dev]'s 128-wide heads and block layout, 4 heads, 1 double + 2 single
    blocks), 256x256 output (256 tokens), 512 text tokens, 256x256 references of 256 tokens each: within ±20%."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import measure_activations

    config = dict(measure_activations.reduced_flux2_config(4), num_layers=1, num_single_layers=2)
    ratios = {}
    for count in (0, 1, 3):
        measured, estimated = reference_call_peaks(config, 256, ((256, 256),) * count)
        assert measured > 1_000_000
        ratios[count] = estimated / measured
        print(f"{count} references: measured {measured / 1e6:.2f} MB, estimated {estimated / 1e6:.2f} MB, "
              f"ratio {ratios[count]:.3f}")
    assert all(0.8 <= r <= 1.2 for r in ratios.values()), ratios


def test_plan_reports_what_the_references_add_and_suggests_fewer_when_they_do_not_fit():
    """`dmap plan` with references: the tokens each adds and the transformer's activations with and without them
    (also in the plan file); on a device too small for three, the nearest change names the most that fit."""
    from dm_cli.errors import DoesNotFitError
    from dm_cli.inputs import Generation, InputImage, PlacementSpec
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_file import Plan
    from dm_cli.planning.plan_options import PlanOptions

    def plan(count: int, budget: str = "0=10GB"):
        generation = Generation(height=64, width=64, images=(InputImage(128, 128),) * count,
                                max_sequence_length=16)  # the denoise peaks
        return make_plan("tiny-flux2", PlanOptions(PlacementSpec(budget, mode="staged", overhead="0=0"), generation=generation,
                                                  check=False))

    three = plan(3)
    report = three.input_images
    assert report["component"] == "transformer" and report["tokens"] == [64 * 64] * 3  # the tiny VAE keeps the size
    assert report["activation_peak_bytes"] == three.activation_peaks["transformer"]
    assert report["activation_peak_without_bytes"] < report["activation_peak_bytes"] / 4
    assert Plan.from_json(json.loads(json.dumps(three.to_json()))).input_images == report
    assert not plan(0).input_images and "input_images" not in plan(0).to_json()
    code, out, err = run_dmap("plan", "tiny-flux2", "--height", 64, "--width", 64, *["--image-size", "128x128"] * 3,
                              "--max-sequence-length", 16, "--max-memory", "0=10GB")
    assert code == 0, err
    assert "Input images: 3 add 4,096 + 4,096 + 4,096 tokens to transformer's" in " ".join(out.split()), out
    peak = {n: max(s.peak_bytes["0"] for s in p.stages) for n, p in ((2, plan(2)), (3, three))}
    assert peak[2] < peak[3] == next(s.peak_bytes["0"] for s in three.stages if s.name == "denoise")
    with pytest.raises(DoesNotFitError, match=r"fits with 2 input image\(s\) \(the first 2\)"):
        plan(3, f"0={(peak[2] + peak[3]) // 2}B")

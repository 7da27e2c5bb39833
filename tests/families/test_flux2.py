"""FLUX.2 [dev] and [klein]: presets, offline tokenizers, meta traces, plans, and runs against diffusers."""

import json

import pytest

from dm_cli.inputs import InputSpec, PlacementSpec
from dm_cli.model.inspection import inspect_source
from dm_cli.model.sources import PRESETS_DIR

torch = pytest.importorskip("torch")


def test_tiny_klein_twin_is_diffusers_test_components():
    """tiny-flux2-klein = the get_dummy_components arguments of diffusers' Flux2KleinPipeline tests."""
    import diffusers
    import transformers

    with torch.device("meta"):
        transformer = diffusers.Flux2Transformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False)
        text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            intermediate_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=512))
        vae = diffusers.AutoencoderKLFlux2(
            sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
            norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    expected = {"transformer": transformer, "text_encoder": text_encoder, "vae": vae}
    report = {c.name: c for c in inspect_source("tiny-flux2-klein").components}
    assert set(report) == set(expected)
    for name, model in expected.items():
        assert report[name].params == sum(p.numel() for p in model.parameters()), name
        assert report[name].cls == type(model).__name__
    index = json.loads((PRESETS_DIR / "tiny-flux2-klein" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["tokenizer"][1] == "Qwen2TokenizerFast"


def test_offline_pixtral_tokenizer_as_flux2_uses_it(tmp_path):
    """The Mistral tokenizer of the offline PixtralProcessor folder, driven as Flux2Pipeline drives it."""
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input
    from transformers import AutoTokenizer

    from dm_cli.model.tokenizers import write_tokenizer_for

    config = json.loads((PRESETS_DIR / "tiny-flux2" / "text_encoder" / "config.json").read_text())
    folder = write_tokenizer_for("PixtralProcessor", tmp_path / "tokenizer", config)
    assert json.loads((folder / "processor_config.json").read_text())["processor_class"] == "PixtralProcessor"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids("[IMG]") == config["image_token_index"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 3, 4)
    messages = format_input(["a red fox"], SYSTEM_MESSAGE)
    [text] = tokenizer.apply_chat_template(messages, tokenize=False)  # a batch of one conversation
    assert text.startswith("<s>[SYSTEM_PROMPT]You are") and text.endswith("[INST]a red fox[/INST]")
    batch = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                          padding="max_length", truncation=True, max_length=300)
    assert batch["input_ids"].shape == (1, 300)
    assert int(batch["input_ids"].max()) < config["text_config"]["vocab_size"]
    assert 0 < int(batch["attention_mask"].sum()) < 300  # padded to max_length with <pad>
    assert int(batch["input_ids"][0, -1]) == 4


def test_offline_qwen_tokenizer_as_flux2_klein_uses_it(tmp_path):
    from transformers import Qwen2TokenizerFast

    from dm_cli.model.tokenizers import write_tokenizer_for

    config = json.loads((PRESETS_DIR / "tiny-flux2-klein" / "text_encoder" / "config.json").read_text())
    tokenizer = Qwen2TokenizerFast.from_pretrained(write_tokenizer_for("Qwen2TokenizerFast", tmp_path / "tok", config))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a red fox"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\na red fox<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tokenizer(text, padding="max_length", max_length=40, truncation=True)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tokenizer.pad_token_id
    assert tokenizer.decode([i for i in ids if i != tokenizer.pad_token_id]) == text


def test_mistral3_default_tie_is_noted_and_planned_untied():
    """FLUX.2 [dev]'s text encoder config leaves tie_word_embeddings unset: built tied, loaded untied."""
    report = inspect_source("flux2")
    encoder = next(c for c in report.components if c.name == "text_encoder")
    assert encoder.params == 23_340_272_640  # as built (sizes.json)
    [note] = [n for n in report.notes if n.startswith("text_encoder")]
    assert "24,011,361,280" in note and "planned as loaded untied" in note


def test_checkpoint_storing_lm_head_is_counted_as_transformers_loads_it(tmp_path):
    """A checkpoint with lm_head beside the embeddings: transformers keeps both, and so does dmap's count."""
    import transformers
    from safetensors.torch import save_file

    config = json.loads((PRESETS_DIR / "tiny-flux2" / "text_encoder" / "config.json").read_text())
    del config["tie_word_embeddings"]  # as FLUX.2 [dev]'s config.json
    config["architectures"] = ["Mistral3ForConditionalGeneration"]
    cls = transformers.Mistral3ForConditionalGeneration
    model = cls(cls.config_class.from_dict({k: v for k, v in config.items() if k != "transformers_version"}))
    tied = sum(p.numel() for p in model.parameters())
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

    report = inspect_source(str(folder))
    loaded = cls.from_pretrained(folder)
    assert loaded.lm_head.weight.data_ptr() != loaded.model.language_model.embed_tokens.weight.data_ptr()
    assert report.components[0].params == sum(p.numel() for p in loaded.parameters())
    assert report.components[0].params == tied + state["lm_head.weight"].numel()
    assert "its checkpoint stores lm_head.weight" in report.notes[0]


# --- the family ------------------------------------------------------------------------------------


def test_flux2_family_matches_before_flux_and_knows_its_defaults():
    from dm_cli.families import family_for
    from dm_cli.families.flux2 import out_layers
    from dm_cli.inputs import Generation

    for cls in ("Flux2Pipeline", "Flux2KleinPipeline"):
        family = family_for(cls)
        assert family.name == "flux2" and family.runs(cls)
    assert family_for("FluxPipeline").name == "flux"
    assert family_for(None, "Flux2Transformer2DModel", {}).name == "flux2"
    family = family_for("Flux2Pipeline")
    assert (family.default_steps, family.default_guidance, family.default_max_sequence_length) == (50, 4.0, 512)
    assert family.default_image_size({}, {"block_out_channels": [128, 256, 512, 512]}) == 1024
    assert family.size_multiple({}, {"block_out_channels": [128, 256, 512, 512]}) == 16
    assert family.refusal(Generation(negative_prompt="blurry"))  # no negative prompt: guidance is distilled
    # the hidden states the pipelines stack: their defaults, and diffusers' tests' choice for the tiny twins
    configs = {p: json.loads((PRESETS_DIR / p / "text_encoder" / "config.json").read_text())
               for p in ("flux.2-dev", "flux.2-klein-4b", "tiny-flux2", "tiny-flux2-klein")}
    assert out_layers("Flux2Pipeline", configs["flux.2-dev"], 15360) == (10, 20, 30)
    assert out_layers("Flux2KleinPipeline", configs["flux.2-klein-4b"], 7680) == (9, 18, 27)
    assert out_layers("Flux2Pipeline", configs["tiny-flux2"], 16) == (1,)
    assert out_layers("Flux2KleinPipeline", configs["tiny-flux2-klein"], 16) == (1,)


def test_klein_true_cfg_is_separate_calls_only_when_not_distilled():
    from dm_cli.families import family_for

    family = family_for("Flux2KleinPipeline")
    assert family.true_cfg({"_class_name": "Flux2KleinPipeline", "is_distilled": False}, 4.0)
    assert not family.true_cfg({"_class_name": "Flux2KleinPipeline", "is_distilled": True}, 4.0)  # klein 4B
    assert not family.true_cfg({"_class_name": "Flux2KleinPipeline", "is_distilled": False}, 1.0)
    assert not family.true_cfg({"_class_name": "Flux2Pipeline"}, 4.0)
    assert family.cfg_batch(InputSpec(64, 64, guidance_scale=4.0)) == 1  # never a doubled batch


# --- meta traces and plans ------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["flux2", "flux2-klein"])
def test_plan_traces_every_component_at_1024(preset):
    from dm_cli.planning.make import make_plan
    from dm_cli.planning.plan_options import PlanOptions

    plan = make_plan(preset, PlanOptions(PlacementSpec("0=40GB,1=40GB,2=40GB,3=40GB,cpu=200GB")))
    assert not [w for w in plan.warnings if "meta device" in w or "registration order" in w], plan.warnings
    assert all(plan.activation_peaks[name] > 0 for name in plan.components), plan.activation_peaks  # all traced
    assert plan.check["ran"] and not plan.check["problems"]
    # the VAE also encodes reference images (none here: tests/families/test_flux2_refs.py)
    assert [s.name for s in plan.stages] == ["encode", "encode_image", "denoise", "decode"]


def test_flux2_transformer_call_is_what_flux2pipeline_feeds_it():
    from dm_cli.families import family_for
    from dm_cli.model.sources import resolve_source

    source = resolve_source("flux2")
    family = family_for(source.pipeline_class)
    spec = family.call_spec(source.component("transformer"), InputSpec(1024, 1024))
    shapes = spec.shapes()["kwargs"]
    assert shapes["hidden_states"]["shape"] == [1, 4096, 128]  # (1024/16)^2 packed latent tokens
    assert shapes["encoder_hidden_states"]["shape"] == [1, 512, 15360]  # 3 stacked Mistral layers x 5120
    assert shapes["img_ids"]["shape"] == [1, 4096, 4] and shapes["txt_ids"]["shape"] == [1, 512, 4]
    assert shapes["guidance"]["shape"] == [1]  # guidance-distilled: batch never doubled
    encoder = family.call_spec(source.component("text_encoder"), InputSpec(1024, 1024))
    assert encoder.kwargs["output_hidden_states"] is True and encoder.kwargs["input_ids"].shape == (1, 512)


@pytest.mark.parametrize("budget, mode", [
    ("0=40GB,1=40GB,2=40GB,3=40GB,cpu=200GB", None),
    (",".join(f"{i}=24GB" for i in range(8)), None),
    ("0=48GB,1=48GB,2=48GB", "staged"),
])
def test_flux2_dev_fits_and_checks(budget, mode):
    from typer.testing import CliRunner

    from dm_cli.cli import app

    args = ["plan", "flux2", "--max-memory", budget, "--json"] + (["--mode", mode] if mode else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["check"]["ran"] and plan["check"]["problems"] == []
    assert not [w for w in plan["warnings"] if "meta device" in w or "registration order" in w]
    assert all(c["activation_peak_bytes"] > 0 for c in plan["components"].values())
    if mode:
        assert plan["mode"] == mode
    # planned untied, as transformers loads the published checkpoint: lm_head (131072 x 5120) counted apart
    assert plan["components"]["text_encoder"]["weights_bytes"] == 46_680_545_664 + 2 * 131072 * 5120
    for stage in plan["stages"]:
        for device, peak in stage["peak_bytes"].items():
            assert peak <= plan["devices"][device]["capacity_bytes"]


def test_tied_lm_head_away_from_embeddings_is_caught_by_the_split_check():
    """Mistral-3 built tied (tiny twin): lm_head on another GPU than the embeddings it shares fails."""
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.trace.trace import check_device_map

    source = resolve_source("tiny-flux2")
    comp = source.component("text_encoder")
    lm = "model.language_model"
    good = {"model.vision_tower": 0, "model.multi_modal_projector": 0, f"{lm}.embed_tokens": 0, "lm_head": 0,
            f"{lm}.layers.0": 1, f"{lm}.norm": 1, f"{lm}.rotary_emb": 1}
    inputs = InputSpec(64, 64, max_sequence_length=32)
    assert check_device_map(comp, source.pipeline_class, inputs, "float32", good) == []
    problems = check_device_map(comp, source.pipeline_class, inputs, "float32", good | {"lm_head": 1})
    assert problems and "lm_head" in problems[0] and "devices 0 and 1" in problems[0]


# --- dmap run against diffusers' own pipelines -------------------------------------------------------

PROMPT, SIZE, STEPS, SEED, TOKENS = "a red fox in the snow", 32, 2, 7, 64
PIPELINES = {"tiny-flux2": "Flux2Pipeline", "tiny-flux2-klein": "Flux2KleinPipeline"}


@pytest.fixture(scope="module")
def flux2_folders(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline

    root = tmp_path_factory.mktemp("flux2")
    return {preset: write_random_pipeline(PRESETS_DIR / preset, root / preset, seed=0) for preset in PIPELINES}


def diffusers_pipeline(folder):
    """diffusers' own pipeline from the folder. PixtralProcessor needs torchvision (not a dmap
    dependency); without it, each component is loaded by its own class and the processor's tokenizer
    alone, which is all the pipeline uses for text."""
    import diffusers
    import transformers

    index = json.loads((folder / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    try:
        return cls.from_pretrained(folder)
    except ImportError:
        pass
    except ValueError as error:  # transformers' placeholder for a processor it cannot import (no torchvision);
        if "Placeholder" not in str(error):  # anything else diffusers refuses is a real failure
            raise
    parts = {}
    for name, value in index.items():
        if not isinstance(value, list):
            continue
        library, class_name = value
        if class_name.endswith("Processor"):
            parts[name] = transformers.AutoTokenizer.from_pretrained(folder / name)
        else:
            module = diffusers if library == "diffusers" else transformers
            parts[name] = getattr(module, class_name).from_pretrained(folder, subfolder=name)
    settings = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
    return cls(**parts, **settings)


def oracle(folder):
    import numpy as np

    pipe = diffusers_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    # the tiny encoders have 1-2 layers: diffusers' own tests pass text_encoder_out_layers=(1,), as dmap picks
    image = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE, max_sequence_length=TOKENS, text_encoder_out_layers=(1,)).images[0]
    return np.array(image)


def _units(module, prefix=""):
    """Leaf-most blocks in registration order: ModuleLists expanded, wrappers (model, language_model) opened."""
    units = []
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, torch.nn.ModuleList):
            units += [f"{full}.{i}" for i in range(len(child))]
        elif name in ("model", "language_model"):
            units += _units(child, full + ".")
        elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            units.append(full)
    return units


def split_plan(folder, n_devices):
    """A dmap-plan document with the transformer and the text encoder each split over n devices."""
    from dm_cli.model.skeleton import build_on_meta
    from dm_cli.model.sources import resolve_source

    source = resolve_source(str(folder))
    comps = {c.name: c for c in source.components}
    maps = {name: {"": "cpu"} for name in comps}
    devices = list(range(n_devices))
    for name in ("transformer", "text_encoder"):
        comp = comps[name]
        model = build_on_meta(comp.library, comp.cls, comp.config)
        units = [u for u in _units(model) if u != "lm_head"]
        per = -(-len(units) // n_devices)
        order = devices if name == "transformer" else devices[::-1]
        maps[name] = {u: order[i // per] for i, u in enumerate(units)}
        if "lm_head" in dict(model.named_children()):  # tied to the embeddings in tiny-flux2: kept with them
            embed = next(u for u in units if u.endswith("embed_tokens"))
            maps[name]["lm_head"] = maps[name][embed]
        assert len(set(maps[name].values())) == n_devices
    maps["vae"] = {"": devices[-1]}
    return {
        "format": "dmap-plan", "version": 1, "source": str(folder), "dtype": "float32", "strategy": "auto",
        "mode": "staged", "devices": {str(d): {"capacity_bytes": 10**9} for d in devices} | {"cpu": {"capacity_bytes": 10**10}},
        "inputs": {"height": SIZE, "width": SIZE, "batch_size": 1, "max_sequence_length": TOKENS},
        "components": {n: {"class": comps[n].cls, "weights_bytes": 0, "device_map": maps[n]} for n in comps},
        "stages": [{"name": "encode", "components": ["text_encoder"], "peak_bytes": {}},
                   {"name": "denoise", "components": ["transformer"], "peak_bytes": {}},
                   {"name": "decode", "components": ["vae"], "peak_bytes": {}}],
    }


def dmap_image(folder, tmp_path, plan=None, simulate=False, name="out.png"):
    import numpy as np
    from PIL import Image

    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    device_map = "auto"
    if plan is not None:
        device_map = str(tmp_path / f"plan-{name}.json")
        (tmp_path / f"plan-{name}.json").write_text(json.dumps(plan))
    result = run(RunRequest.of(source=str(folder), prompt=PROMPT, device_map=device_map, steps=STEPS, height=SIZE,
                            width=SIZE, seed=SEED, output=str(tmp_path / name), simulate=simulate,
                            max_sequence_length=TOKENS,
                            max_memory=None if plan is not None else "cpu=8GB"))
    with Image.open(tmp_path / name) as image:
        return np.array(image), result


@pytest.mark.parametrize("preset", list(PIPELINES))
def test_run_is_pixel_identical_to_diffusers_unsplit_and_split(preset, flux2_folders, tmp_path):
    import numpy as np

    folder = flux2_folders[preset]
    expected = oracle(folder)
    image, result = dmap_image(folder, tmp_path)
    assert np.array_equal(image, expected), preset
    assert result.pipeline_class == PIPELINES[preset]
    for n_devices in (2, 3):
        image, result = dmap_image(folder, tmp_path, split_plan(folder, n_devices), simulate=True, name=f"{n_devices}.png")
        assert result.split_check and result.split_problems == [], result.split_problems
        assert np.array_equal(image, expected), (preset, n_devices)

"""FLUX.2 [dev] and [klein]: presets, offline tokenizers, meta traces, plans, and runs against diffusers."""

import json

import pytest

from dm_cli.inspection import inspect_source
from dm_cli.sources import PRESETS_DIR

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

    from dm_cli.offline_tokenizers import write_tokenizer_for

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

    from dm_cli.offline_tokenizers import write_tokenizer_for

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

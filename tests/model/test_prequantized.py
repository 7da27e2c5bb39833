"""Folders saved quantized (a `quantization_config` in config.json), built with the libraries' own `save_pretrained`
after their own 4-bit / 8-bit loading: inspected from their headers at the bytes the loaded model holds, with the
format named; planned; run without re-quantizing, pixel for pixel the same as the pipeline those loaders give;
`dmap shard` copies them byte for byte and refuses --dtype."""

import json
import shutil

import numpy as np
import pytest
from conftest import run_dmap

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

from test_nf4 import _held_bytes, quantized_by_the_library  # noqa: E402
from test_nf4_run import NF4, nf4_plan, oracle  # noqa: E402
from test_run import PROMPT, SEED, SIZE, STEPS, _png, dmap_run, folders  # noqa: E402,F401


@pytest.fixture(scope="module")
def saved(folders, tmp_path_factory):
    """tiny-flux with its transformer (diffusers) and T5 (transformers) saved in NF4 by the libraries."""
    from dm_cli.model.sources import resolve_source

    plain = folders("tiny-flux")
    folder = tmp_path_factory.mktemp("prequantized") / "tiny-flux-nf4"
    shutil.copytree(plain, folder)
    source = resolve_source(str(plain))
    for name in NF4:
        shutil.rmtree(folder / name)
        quantized_by_the_library(source.component(name), plain).save_pretrained(folder / name)
    return plain, folder


def _inspect(*args):
    code, out, err = run_dmap("inspect", *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    return {c["name"]: c for c in report["components"]}, report["notes"]


def test_inspected_from_headers_at_the_bytes_the_loaded_model_holds(saved):
    plain, folder = saved
    ours, notes = _inspect(folder)
    theirs, _ = _inspect(plain, "--weights", "transformer=nf4,text_encoder_2=nf4", "--dtype", "bfloat16")
    for name in NF4:
        assert ours[name]["bytes"] == theirs[name]["bytes"], name
        assert any(n.startswith(f"{name}: saved quantized by bitsandbytes (bnb-nf4)") for n in notes), notes
    from dm_cli.model.sources import resolve_source

    # transformers' own loader of the saved folder (no re-quantization: the file says 4-bit) holds the same bytes
    model = quantized_by_the_library(resolve_source(str(folder)).component("text_encoder_2"), folder)
    assert isinstance(model.encoder.block[0].layer[0].SelfAttention.q, bnb.nn.Linear4bit)
    assert _held_bytes(model) == ours["text_encoder_2"]["bytes"]


def test_an_8bit_folder_is_inspected_exactly_and_its_run_refused_for_diffusers(folders, tmp_path):
    plain = folders("tiny-flux")
    config = transformers.BitsAndBytesConfig(load_in_8bit=True)
    model = transformers.T5EncoderModel.from_pretrained(plain / "text_encoder_2", quantization_config=config,
                                                        dtype=torch.bfloat16, device_map="cpu")
    model.save_pretrained(tmp_path / "t5-int8")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(m.weight.SCB.numel() * 4 for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt))
    ours, notes = _inspect(tmp_path / "t5-int8")
    assert ours["t5-int8"]["bytes"] == held
    assert any("bnb-int8" in n for n in notes)


def test_planned_and_run_without_requantizing_pixel_identical_unsplit_and_split(saved, tmp_path):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    plain, folder = saved
    expected = oracle(plain)  # the libraries' own 4-bit loading of the unquantized folder
    whole = run(RunRequest.of(source=str(folder), prompt=PROMPT, max_memory="cpu=4GB", steps=STEPS, height=SIZE,
                              width=SIZE, seed=SEED, output=str(tmp_path / "a.png"), dtype="bfloat16"))
    planned = {n: c["weights_bytes"] for n, c in whole.plan.to_json()["components"].items()}
    theirs, _ = _inspect(folder)
    assert all(planned[n] == theirs[n]["bytes"] for n in NF4)
    plan = nf4_plan(folder, 2)
    for comp in plan["components"].values():
        comp["storage_dtype"] = "bfloat16"  # stored quantized already: the plan asks for no --weights
    split = dmap_run(folder, plan, tmp_path, simulate=True, name="b.png")
    assert split.split_problems == []
    for name in ("a.png", "b.png"):
        assert np.array_equal(_png(tmp_path / name)[0], expected), name


def test_asking_nf4_again_and_torchao_folders_are_one_sentence(saved, tmp_path):
    _, folder = saved
    code, _, err = run_dmap("plan", folder, "--weights", "transformer=nf4", "--max-memory", "cpu=1GB", "--height", "0")
    assert code == 2 and "a folder saved quantized, quantized already: drop --weights transformer=nf4" in err, err
    shutil.copytree(folder / "transformer", tmp_path / "ao")
    config = json.loads((tmp_path / "ao" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "torchao", "quant_type": "int8_weight_only"}
    (tmp_path / "ao" / "config.json").write_text(json.dumps(config))
    code, _, err = run_dmap("inspect", tmp_path / "ao")
    assert code == 2 and "saved quantized by torchao" in err and "Traceback" not in err, err


def test_shard_copies_a_saved_folder_byte_for_byte_and_refuses_dtype(saved, tmp_path):
    from safetensors import safe_open

    _, folder = saved
    code, _, err = run_dmap("shard", folder / "text_encoder_2", "--max-shard-size", "0", "--dtype", "float16",
                            "-o", tmp_path / "cast")
    assert code == 2 and "was saved quantized (bnb-nf4)" in err, err
    code, _, err = run_dmap("shard", folder / "text_encoder_2", "--max-shard-size", "0", "-o", tmp_path / "copy")
    assert code == 0, err
    files = [next((folder / "text_encoder_2").glob("*.safetensors")), next((tmp_path / "copy").glob("*.safetensors"))]
    with safe_open(str(files[0]), "pt") as a, safe_open(str(files[1]), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    # the copy's config still says 4-bit: transformers loads it as saved
    reloaded = transformers.T5EncoderModel.from_pretrained(tmp_path / "copy", dtype=torch.bfloat16, device_map="cpu")
    assert isinstance(reloaded.encoder.block[0].layer[0].SelfAttention.q, bnb.nn.Linear4bit)

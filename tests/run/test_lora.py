"""LoRA adapters (`--lora [COMPONENT=]FILE[:SCALE]`): pixel-identical to diffusers' own `load_lora_weights` +
`set_adapters` for FLUX.1 and Wan 2.2 (unsplit and split on simulated GPUs), bytes counted in the plan, hostile
files and LoRAs for other models refused in one sentence, digest and scale in the metadata and the resume key."""

import json
import struct

import numpy as np
import pytest
from conftest import run_dmap

from dm_cli.errors import UsageError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

PROMPT = "a red fox in the snow"
SIZE, STEPS, SEED = 32, 2, 7
WAN_FRAMES, WAN_STEPS = 9, 4  # 4 steps: two per expert (boundary 0.875)
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


def make_lora(model_cls, folder, path, pipeline_cls, seed, rank=4, alpha=8, targets=ATTENTION):
    """A peft LoRA of a fresh copy of the component in `folder`, its B matrices random (peft starts them at zero,
    which would change nothing), saved as diffusers saves LoRAs (`transformer.` keys, adapter metadata)."""
    from peft import LoraConfig, get_peft_model_state_dict

    model = model_cls.from_pretrained(folder)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets))
    model.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    state = get_peft_model_state_dict(model)
    pipeline_cls.save_lora_weights(str(path.parent), transformer_lora_layers=state, weight_name=path.name,
                                   transformer_lora_adapter_metadata=config.to_dict())
    return path


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """(tiny FLUX.1 pipeline with random weights, a LoRA of its transformer)."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("lora-flux")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    lora = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", root / "fox-lora.safetensors",
                     diffusers.FluxPipeline, seed=1)
    return folder, lora


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """(tiny Wan 2.2 pipeline, a LoRA of the high-noise expert, a LoRA of the low-noise expert)."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("lora-wan")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan", root / "tiny-wan", seed=0)
    high = make_lora(diffusers.WanTransformer3DModel, folder / "transformer", root / "high.safetensors",
                     diffusers.WanPipeline, seed=2)
    low = make_lora(diffusers.WanTransformer3DModel, folder / "transformer_2", root / "low.safetensors",
                    diffusers.WanPipeline, seed=3)
    return folder, high, low


def flux_oracle(folder, loras=(), fused=False):
    """diffusers' own: from_pretrained, load_lora_weights, set_adapters (`fused`: then fuse_lora and
    unload_lora_weights), the pipeline's call."""
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    for index, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"a{index}")
    if loras:
        pipe.set_adapters([f"a{i}" for i in range(len(loras))], [scale for _, scale in loras])
    if loras and fused:
        pipe.fuse_lora(components=["transformer"])
        pipe.unload_lora_weights()
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


def _png(path):
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image), dict(image.text)


def _run(source, tmp_path, name, **extra):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    extra = {"steps": STEPS, "height": SIZE, "width": SIZE, **extra}
    request = RunRequest.of(source=str(source), prompt=PROMPT, seed=SEED, output=str(tmp_path / name), **extra)
    return run(request)


def _split_plan(folder, tmp_path, lora: dict):
    """A plan file splitting the transformer over two GPUs (the encoders and the VAE on the cpu), with its LoRA."""
    from test_run import hand_plan

    plan = hand_plan(folder, 2)
    plan["loras"] = [lora]
    path = tmp_path / "split-plan.json"
    path.write_text(json.dumps(plan))
    return path


def _count_fusions(monkeypatch) -> list:
    """The classes of the models diffusers' fuse_lora runs on, from now on in this test."""
    from diffusers.loaders.peft import PeftAdapterMixin

    fused = []
    fuse_lora = PeftAdapterMixin.fuse_lora

    def spy(self, *args, **kwargs):
        fused.append(type(self).__name__)
        return fuse_lora(self, *args, **kwargs)

    monkeypatch.setattr(PeftAdapterMixin, "fuse_lora", spy)
    return fused


def test_flux_lora_is_pixel_identical_to_diffusers_unsplit_and_split_on_two_simulated_gpus(flux, tmp_path,
                                                                                           monkeypatch):
    folder, lora = flux
    plain = flux_oracle(folder)
    expected = flux_oracle(folder, [(lora, 0.7)])
    expected_fused = flux_oracle(folder, [(lora, 0.7)], fused=True)
    assert not np.array_equal(plain, expected), "the LoRA must change the image"
    fused = _count_fusions(monkeypatch)

    # the plan fuses it (everything resident, float weights): diffusers' fuse_lora path, which at float32 and this
    # size writes the same pixels as the unfused one
    result = _run(folder, tmp_path, "whole.png", max_memory="cpu=8GB", loras=[f"{lora}:0.7"])
    pixels, text = _png(tmp_path / "whole.png")
    assert np.array_equal(pixels, expected_fused) and np.array_equal(pixels, expected)
    entry = result.plan.loras[0]
    assert entry["component"] == "transformer" and entry["scale"] == 0.7 and entry["fused"] is True
    assert text["lora"] == f"transformer:{entry['digest']}:0.7" and text["lora_files"] == lora.name
    assert text["lora_fused"] == "transformer" and fused == ["FluxTransformer2DModel"]

    # a plan file without `fused` (older, or written by hand): unfused, peft's layers on both simulated GPUs
    split = _split_plan(folder, tmp_path, {k: entry[k] for k in ("path", "component", "scale", "digest")})
    result = _run(folder, tmp_path, "split.png", device_map=str(split), simulate=True, loras=[f"{lora}:0.7"])
    assert result.plan.components["transformer"].is_split
    assert result.split_check and result.split_problems == [], result.split_problems
    pixels, text = _png(tmp_path / "split.png")
    assert np.array_equal(pixels, expected) and "lora_fused" not in text and len(fused) == 1


def test_a_plan_file_made_for_another_lora_is_refused(flux, tmp_path):
    folder, lora = flux
    entry = {"path": str(lora), "component": "transformer", "scale": 0.5, "digest": "0" * 64}
    split = _split_plan(folder, tmp_path, entry)
    with pytest.raises(UsageError, match="made for LoRA"):
        _run(folder, tmp_path, "no.png", device_map=str(split), simulate=True, loras=[f"{lora}:0.5"])
    with pytest.raises(UsageError, match="made for LoRA"):  # a plan with a LoRA, a run without
        _run(folder, tmp_path, "no.png", device_map=str(split), simulate=True)
    assert not (tmp_path / "no.png").exists()


def wan_oracle(folder, high=None, low=None):
    from dm_cli.io.video import to_uint8

    pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if high is not None:
        pipe.load_lora_weights(str(high[0]), adapter_name="high")
        pipe.transformer.set_adapters(["high"], [high[1]])
    if low is not None:
        pipe.load_lora_weights(str(low[0]), adapter_name="low", load_into_transformer_2=True)
        pipe.transformer_2.set_adapters(["low"], [low[1]])
    frames = pipe(PROMPT, num_frames=WAN_FRAMES, height=SIZE, width=SIZE, num_inference_steps=WAN_STEPS,
                  generator=torch.Generator().manual_seed(SEED), output_type="np").frames
    return to_uint8(frames[0])


def _frames(folder):
    from PIL import Image

    return np.stack([np.array(Image.open(p)) for p in sorted(folder.glob("frame-*.png"))])


def test_wan22_loras_per_expert_are_pixel_identical_unsplit_and_split_on_two_simulated_gpus(wan, tmp_path):
    folder, high, low = wan
    expected = wan_oracle(folder, (high, 1.0), (low, 0.6))
    assert not np.array_equal(expected, wan_oracle(folder, None, (low, 0.6))), "the high-noise LoRA changes frames"
    loras = [str(high), f"transformer_2={low}:0.6"]
    whole = _run(folder, tmp_path, "whole/", steps=WAN_STEPS, num_frames=WAN_FRAMES, max_memory="cpu=8GB",
                 loras=loras)
    assert np.array_equal(_frames(tmp_path / "whole"), expected)
    assert [(e["component"], e["scale"]) for e in whole.plan.loras] == [("transformer", 1.0), ("transformer_2", 0.6)]

    split = _run(folder, tmp_path, "split/", steps=WAN_STEPS, num_frames=WAN_FRAMES, simulate=True, loras=loras,
                 max_memory="0=400KB,1=400KB,cpu=1GB", overhead="0=0,1=0")
    assert split.plan.components["transformer"].is_split and split.plan.components["transformer_2"].is_split
    assert split.split_check and split.split_problems == [], split.split_problems
    assert np.array_equal(_frames(tmp_path / "split"), expected)


def _plan_json(*args):
    code, out, err = run_dmap("plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_plan_counts_the_adapter_bytes_beside_the_layers_they_patch(flux, tmp_path):
    from safetensors import safe_open

    folder, lora = flux
    size = (folder, "--height", SIZE, "--width", SIZE)
    args = (*size, "--max-memory", "cpu=8GB")
    without = _plan_json(*args)
    with_lora = _plan_json(*args, "--lora", f"{lora}:0.5")
    with safe_open(str(lora), "pt") as handle:
        numel = sum(handle.get_slice(k).get_shape().numel() if hasattr(handle.get_slice(k).get_shape(), "numel")
                    else int(np.prod(handle.get_slice(k).get_shape())) for k in handle.keys())
    added = numel * 4  # float32, as the tiny pipeline is stored: peft keeps lora_A/B in the layer's dtype
    (entry,) = with_lora["loras"]
    assert entry["bytes"] == added and entry["tensors"] == 14 and entry["fused"] is True and entry["scale"] == 0.5
    weights = lambda plan, name: plan["components"][name]["weights_bytes"]  # noqa: E731
    assert weights(with_lora, "transformer") == weights(without, "transformer") + added
    assert weights(with_lora, "vae") == weights(without, "vae") and "loras" not in without
    peak = lambda plan: max(s["peak_bytes"].get("cpu", 0) for s in plan["stages"])  # noqa: E731
    assert peak(with_lora) >= peak(without) + added
    code, out, _ = run_dmap("plan", *args, "--lora", f"{lora}:0.5")
    assert code == 0 and f"LoRA {lora.name}: scale 0.5 on transformer, 14 tensors" in " ".join(out.split())
    assert "fused into them at load" in " ".join(out.split())
    # what stops a fusion is said: fp8 storage, GGUF layers, blocks streamed from cpu or disk
    for extra, why in (((*args, "--weights", "transformer=fp8"), "stored as fp8"),
                       ((*size, "--max-memory", "0=1900KB,cpu=8GB", "--overhead", "0=0"), "stream from cpu or disk")):
        plan = _plan_json(*extra, "--lora", f"{lora}:0.5")
        assert plan["loras"][0]["fused"] is False, plan["components"]["transformer"]["device_map"]
        assert any("stays unfused" in w and why in w for w in plan["warnings"]), plan["warnings"]
    # in the block of the layer it patches: a split after the first double block moves that block's adapters
    from dm_cli.inputs import LoraAdapter
    from dm_cli.model.lora import read_lora
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.placement.lora_sizing import lora_extra_bytes

    adapter = read_lora(f"{lora}:0.5")
    assert isinstance(adapter, LoraAdapter) and adapter.tensors == 14
    comp = resolve_source(str(folder)).component("transformer")
    from dm_cli.model.skeleton import as_loaded

    skeleton = as_loaded(comp).skeleton
    extra, report = lora_extra_bytes(comp, skeleton, (adapter,), "float32")
    assert sum(extra.values()) == added and report[0][1] == added
    assert all(name.endswith(".weight") and ".attn.to_" in name for name in extra)
    assert any(name.startswith("transformer_blocks.0.") for name in extra)
    assert any(name.startswith("single_transformer_blocks.0.") for name in extra)


def _write_safetensors(path, tensors: dict, header_extra=None):
    """A safetensors file by hand: {name: (dtype code, shape)} with zero data."""
    header, offset = {}, 0
    sizes = {"F32": 4, "F16": 2, "I64": 8}
    for name, (dtype, shape) in tensors.items():
        size = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header.update(header_extra or {})
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)
    return path


@pytest.mark.parametrize("case,words", [
    ("garbage", "not a readable LoRA file"),
    ("missing", "does not exist"),
    ("empty", "holds no tensors"),
    ("ints", "floating point"),
    ("other-model", "for another model"),
    ("other-sizes", "other sizes"),
    ("half", "no lora_B weight"),
    ("text-encoder", "denoiser"),
    ("pickle", "pickle"),
])
def test_bad_lora_files_are_one_sentence_and_exit_2(flux, tmp_path, case, words):
    folder, _ = flux
    path = tmp_path / "bad.safetensors"
    if case == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif case == "empty":
        _write_safetensors(path, {})
    elif case == "ints":
        _write_safetensors(path, {"transformer.x.lora_A.weight": ("I64", (4, 4))})
    elif case == "other-model":
        _write_safetensors(path, {"transformer.down_blocks.0.to_q.lora_A.weight": ("F32", (4, 32)),
                                  "transformer.down_blocks.0.to_q.lora_B.weight": ("F32", (32, 4))})
    elif case == "other-sizes":
        _write_safetensors(path, {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": ("F32", (4, 7)),
                                  "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": ("F32", (9, 4))})
    elif case == "half":
        _write_safetensors(path, {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": ("F32", (4, 32))})
    elif case == "text-encoder":
        _write_safetensors(path, {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": ("F32", (4, 32)),
                                  "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": ("F32", (32, 4))})
    elif case == "pickle":
        path = tmp_path / "bad.bin"
        path.write_bytes(b"\x80\x04K\x01.")
    for command in (["plan", folder, "--max-memory", "cpu=8GB"],
                    ["run", folder, "-p", PROMPT, "--steps", 1, "--height", SIZE, "--width", SIZE,
                     "-o", tmp_path / "out.png"]):
        code, out, err = run_dmap(*command, "--lora", path)
        assert code == 2, (case, err)
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("suffix,words", [
    (":nan", "finite number"), (":1e999", "finite number"), (":abc", "finite number"),
    ("", "transformer_2"),  # FLUX has no second expert (the component is given below)
])
def test_bad_scales_and_components_are_refused(flux, suffix, words):
    folder, lora = flux
    spec = f"{lora}{suffix}" if suffix else f"transformer_2={lora}"
    code, _, err = run_dmap("plan", folder, "--max-memory", "cpu=8GB", "--lora", spec)
    assert code == 2 and words in err and "Traceback" not in err, err


def test_parse_takes_the_scale_only_when_it_is_a_number(tmp_path):
    from dm_cli.model.lora import parse_lora

    odd = tmp_path / "a:b=c.safetensors"
    odd.write_bytes(b"")
    assert parse_lora(str(odd)) == (None, str(odd), 1.0)
    assert parse_lora(f"{odd}:0.25") == (None, str(odd), 0.25)
    assert parse_lora("transformer_2=x.safetensors:-1.5") == ("transformer_2", "x.safetensors", -1.5)
    assert parse_lora("dir:with:colons/x.safetensors") == (None, "dir:with:colons/x.safetensors", 1.0)
    with pytest.raises(UsageError, match="needs a file"):
        parse_lora(":0.5")


def _fp8_or_int8_oracle(folder, lora, fmt, dtype):
    """diffusers' own: the transformer int8 by torchao then the LoRA (peft's torchao layer), or the LoRA then
    `enable_layerwise_casting` to fp8 (the order diffusers documents: its default skip patterns keep the adapters
    in the compute dtype)."""
    from test_weight_formats import _quantize_int8

    compute = getattr(torch, dtype)
    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=compute)
    pipe.set_progress_bar_config(disable=True)
    if fmt == "int8":
        _quantize_int8(pipe.transformer, "transformer", None)
    pipe.load_lora_weights(str(lora), adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    if fmt == "fp8":
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute)
    image = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                 height=SIZE, width=SIZE).images[0]
    return np.array(image)


@pytest.mark.parametrize("fmt,dtype", [("fp8", "float32"), ("int8", "bfloat16")])
def test_fp8_and_int8_bases_take_a_lora_identical_to_diffusers_unsplit_and_split(flux, fmt, dtype, tmp_path):
    folder, lora = flux
    if fmt == "int8":
        pytest.importorskip("torchao")
    expected = _fp8_or_int8_oracle(folder, lora, fmt, dtype)
    common = {"weights": f"transformer={fmt}", "dtype": dtype, "loras": [f"{lora}:0.7"]}
    result = _run(folder, tmp_path, "whole.png", max_memory="cpu=8GB", **common)
    assert result.plan.weights["transformer"] == fmt
    assert np.array_equal(_png(tmp_path / "whole.png")[0], expected)
    entry = result.plan.loras[0]
    split = json.loads(_split_plan(folder, tmp_path, {k: entry[k] for k in ("path", "component", "scale", "digest")})
                       .read_text())
    split["dtype"] = dtype
    for name, comp in split["components"].items():
        comp["storage_dtype"] = {"fp8": "float8_e4m3fn", "int8": "int8"}[fmt] if name == "transformer" else dtype
    path = tmp_path / "split-plan.json"
    path.write_text(json.dumps(split))
    result = _run(folder, tmp_path, "split.png", device_map=str(path), simulate=True, **common)
    assert result.plan.components["transformer"].is_split
    assert result.split_check and result.split_problems == [], result.split_problems
    assert np.array_equal(_png(tmp_path / "split.png")[0], expected)


def test_a_fused_lora_leaves_no_peft_layer_and_changes_the_weights(flux):
    from dataclasses import replace

    from peft.tuners.tuners_utils import BaseTunerLayer

    from dm_cli.model.lora import read_lora
    from dm_cli.model.sources import resolve_source
    from dm_cli.run.hooks.adapters import load_loras
    from dm_cli.run.load.loading import load_component

    folder, lora = flux
    comp = resolve_source(str(folder)).component("transformer")
    adapter = replace(read_lora(f"{lora}:0.7"), component="transformer")
    base, unfused, fused = (load_component(comp, {"": "cpu"}, "float32", False) for _ in range(3))
    load_loras(diffusers.FluxPipeline.from_pretrained(folder), "transformer", unfused, (adapter,))
    load_loras(diffusers.FluxPipeline.from_pretrained(folder), "transformer", fused, (adapter,), fuse=True)
    assert any(isinstance(m, BaseTunerLayer) for m in unfused.modules())
    assert not any(isinstance(m, BaseTunerLayer) for m in fused.modules()) and not hasattr(fused, "peft_config")
    q = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(fused.state_dict()[q], base.state_dict()[q])  # the LoRA is in the weight now
    config = base.config
    generator = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 16, config.in_channels, generator=generator),
              "encoder_hidden_states": torch.randn(1, 8, config.joint_attention_dim, generator=generator),
              "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator),
              "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}
    with torch.no_grad():
        plain, one, other = (model(**inputs).sample for model in (base, unfused, fused))
    assert not torch.allclose(plain, one, atol=1e-4)  # the LoRA matters
    assert torch.allclose(one, other, atol=1e-5)  # fused or not, the same sums (in another order)


@pytest.mark.parametrize("fmt", [None, "fp8"])
def test_blocks_streamed_from_cpu_and_disk_take_their_adapters(flux, fmt, tmp_path, monkeypatch):
    """accelerate's offload hooks keep streamed layers on the meta device between forwards; their adapters are
    streamed with them (beside fp8 weights too, in the compute dtype). On a CPU-only machine a cpu/disk map runs
    through the same hooks (execution device cpu)."""
    from dataclasses import replace

    from test_run import _units, hand_plan

    from dm_cli.model.lora import read_lora
    from dm_cli.run.hooks.adapters import load_loras
    from dm_cli.run.load.loading import load_component

    folder, lora = flux
    expected = _fp8_or_int8_oracle(folder, lora, fmt, "float32") if fmt else flux_oracle(folder, [(lora, 0.7)])
    config = diffusers.FluxTransformer2DModel.load_config(folder / "transformer")
    streamed = {u: ("disk" if "blocks" in u else "cpu") for u in _units(diffusers.FluxTransformer2DModel.from_config(config))}
    plan = hand_plan(folder)
    plan["components"]["transformer"]["device_map"] = streamed
    if fmt:
        plan["dtype"] = "float32"
        for name, comp in plan["components"].items():
            comp["storage_dtype"] = "float8_e4m3fn" if name == "transformer" else "float32"
    adapter = replace(read_lora(f"{lora}:0.7"), component="transformer")
    plan["loras"] = [adapter.to_json()]
    path = tmp_path / "streamed-plan.json"
    path.write_text(json.dumps(plan))
    extra = {"weights": f"transformer={fmt}", "dtype": "float32"} if fmt else {}
    fused = _count_fusions(monkeypatch)
    _run(folder, tmp_path, "streamed.png", device_map=str(path), loras=[f"{lora}:0.7"], **extra)
    assert np.array_equal(_png(tmp_path / "streamed.png")[0], expected) and fused == []

    from dm_cli.model.sources import resolve_source

    comp = {c.name: c for c in resolve_source(str(folder)).components}["transformer"]
    model = load_component(comp, streamed, "float32", False, fmt)
    load_loras(diffusers.FluxPipeline.from_pretrained(folder), "transformer", model, (adapter,), torch.float32)
    to_q = model.transformer_blocks[0].attn.to_q
    assert to_q.base_layer.weight.device.type == "meta"  # streamed: on the device only during its forward
    assert to_q.base_layer.weight.dtype == (torch.float8_e4m3fn if fmt else torch.float32)
    assert to_q.lora_A["dmap_lora_0"].weight.device.type == "meta"
    assert to_q.lora_A["dmap_lora_0"].weight.dtype == torch.float32
    assert to_q.lora_A["dmap_lora_0"]._hf_hook.offload  # streamed with it, from the cpu


def diffusers_free_plan(folder, lora):
    import dm_cli

    return dm_cli.plan(str(folder), max_memory="cpu=8GB", height=SIZE, width=SIZE, check=False, lora=[str(lora)])


def test_queue_resume_compares_the_lora_and_items_choose_among_the_loaded_ones(flux, tmp_path):
    folder, lora = flux
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox"}) + "\n" + json.dumps({"prompt": "an owl", "lora": f"{lora}:0.7"}) + "\n")
    out = tmp_path / "queue"
    args = ["run", folder, "--prompts", prompts, "--steps", 1, "--height", SIZE, "--width", SIZE, "-o", out,
            "--max-memory", "cpu=8GB", "--json"]
    code, stdout, err = run_dmap(*args, "--lora", f"{lora}:0.7")
    assert code == 0, err
    first = json.loads(stdout)
    meta = _png(out / "00000.png")[1]
    assert meta["lora"].startswith("transformer:") and meta["lora"].endswith(":0.7")
    code, stdout, err = run_dmap(*args, "--lora", f"{lora}:0.7")  # the same LoRA: both items complete
    assert code == 0, err
    assert first["generated"] == [0, 1] and json.loads(stdout)["skipped"] == [0, 1]
    prompts.write_text(json.dumps({"prompt": "a fox"}) + "\n" + json.dumps({"prompt": "an owl"}) + "\n")
    code, stdout, err = run_dmap(*args, "--lora", f"{lora}:0.3")  # another scale: nothing is skipped
    assert code == 0, err
    result = json.loads(stdout)
    assert result["generated"] == [0, 1] and set(result["redone"].values()) == {"made for another lora"}
    assert _png(out / "00001.png")[1]["lora"].endswith(":0.3")
    code, stdout, err = run_dmap(*args)  # no LoRA at all: redone too
    assert code == 0 and json.loads(stdout)["generated"] == [0, 1], err
    assert "lora" not in _png(out / "00000.png")[1]
    prompts.write_text(json.dumps({"prompt": "an owl", "lora": f"{lora}:0.9"}) + "\n")  # the run's LoRA, another scale
    code, _, err = run_dmap(*args[:-1], "--lora", f"{lora}:0.3")
    assert code == 0, err
    meta = _png(out / "00000.png")[1]
    assert meta["lora"].endswith(":0.9") and "lora_fused" not in meta  # switched per item: unfused
    prompts.write_text(json.dumps({"prompt": "an owl", "lora": "other.safetensors"}) + "\n")
    code, _, err = run_dmap(*args[:-1], "--lora", f"{lora}:0.3")
    assert code == 2 and f"the loaded ones are {lora.name}" in err, err


def test_api_load_and_plan_take_lora(flux):
    import dm_cli

    folder, lora = flux
    expected = flux_oracle(folder, [(lora, 0.7)])
    plan = dm_cli.plan(str(folder), max_memory="cpu=8GB", height=SIZE, width=SIZE, lora=f"{lora}:0.7")
    assert plan.loras[0]["scale"] == 0.7
    with dm_cli.load(str(folder), plan, height=SIZE, width=SIZE, lora=[f"{lora}:0.7"]) as pipe:
        (out,) = pipe.generate([PROMPT], seed=SEED, steps=STEPS)
    assert np.array_equal(np.array(out.image), expected) and out.metadata["lora"].endswith(":0.7")
    with pytest.raises(UsageError, match="made for LoRA"):
        dm_cli.load(str(folder), plan, height=SIZE, width=SIZE)


def test_sdxl_unet_lora_is_pixel_identical_to_diffusers(tmp_path):
    """A UNet pipeline: diffusers' load_lora_weights into the unet, the text encoders untouched."""
    from peft import LoraConfig, get_peft_model_state_dict

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-sdxl", tmp_path / "tiny-sdxl", seed=0)
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(ATTENTION)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    diffusers.StableDiffusionXLPipeline.save_lora_weights(str(tmp_path), unet_lora_layers=get_peft_model_state_dict(unet),
                                                          weight_name="unet-lora.safetensors")
    lora = tmp_path / "unet-lora.safetensors"
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora), adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    expected = np.array(pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS,
                             height=64, width=64).images[0])
    result = _run(folder, tmp_path, "sdxl.png", max_memory="cpu=8GB", loras=[f"{lora}:0.7"], height=64, width=64)
    assert result.plan.loras[0]["component"] == "unet"
    assert np.array_equal(_png(tmp_path / "sdxl.png")[0], expected)


def _profiled_transformer_peak(folder, inputs, lora=None) -> int:
    """The CPU profiler's activation peak of the FLUX transformer's denoising call (float32, one thread)."""
    import sys

    from conftest import REPO

    from dm_cli.families import call_spec
    from dm_cli.model.sources import resolve_source

    sys.path.insert(0, str(REPO / "scripts"))
    from measure_activations import profiled_call_peak

    comp = {c.name: c for c in resolve_source(str(folder)).components}["transformer"]
    spec = call_spec(comp, "FluxPipeline", inputs)
    pipe = diffusers.FluxPipeline.from_pretrained(folder)
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name="a")
    return profiled_call_peak(getattr(pipe.transformer.eval(), spec.method), spec.kwargs)


def test_lora_activations_are_counted_as_the_profiler_measures_them(flux, tmp_path):
    """An unfused LoRA computes lora_B(lora_A(x)) * scale beside each patched layer's output: two more tensors of
    the output's size, on top of what is live while the layer runs. Feed-forward LoRAs raise the transformer's peak,
    attention LoRAs (whose layers run below the attention's own peak) do not: the estimate follows both."""
    from dm_cli.inputs import InputSpec
    from dm_cli.model.lora import read_lora
    from dm_cli.model.sources import resolve_source
    from dm_cli.planning.placement.components import prepare_component
    from dm_cli.planning.placement.lora_sizing import lora_targets

    folder, attention = flux
    feed_forward = make_lora(diffusers.FluxTransformer2DModel, folder / "transformer", tmp_path / "ff.safetensors",
                             diffusers.FluxPipeline, seed=4,
                             targets=("ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out", "ff_context.net.0.proj"))
    source = resolve_source(str(folder))
    comp = {c.name: c for c in source.components}["transformer"]
    inputs = InputSpec(128, 128)

    def estimated(lora=None):
        loras = lora_targets(source, (read_lora(str(lora)),)) if lora else ()
        return prepare_component(comp, "FluxPipeline", inputs, "float32", use_cache=False, loras=loras).spec.activation_peak

    plain = _profiled_transformer_peak(folder, inputs)
    assert estimated() == pytest.approx(plain, rel=0.01)
    assert estimated(attention) == estimated()
    assert _profiled_transformer_peak(folder, inputs, attention) == pytest.approx(plain, rel=0.01)
    raised = _profiled_transformer_peak(folder, inputs, feed_forward)
    assert raised > plain * 1.03, (raised, plain)
    assert estimated(feed_forward) == pytest.approx(raised, rel=0.01)

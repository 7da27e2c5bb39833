"""`dmap shard FILE --to-diffusers`: a community single file (Wan's ComfyUI-layout safetensors, a Q8_0 GGUF, a
FLUX.2 file in BFL's layout with fused q/k/v) written as the diffusers component folder `from_pretrained` loads,
tensor for tensor what diffusers' own `from_single_file` builds from the same file.

The files are written here from tiny random models through the inverses of diffusers' conversions
(tests/original_layouts.py), each checked by running diffusers' conversion back.
"""

import json
import shutil

import pytest
from conftest import run_dmap
from original_layouts import flux2_name, q8_0_rows, wan_name, write_gguf

pytest.importorskip("torch")


def _gguf(path, original, quant_rows=True):
    """Matrices whose rows hold whole Q8_0 blocks in Q8_0 (gguf's own quantizer), the rest F32."""
    return write_gguf(path, original, "wan", q8_0_rows if quant_rows else (lambda array: None))


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """(tiny Wan 2.2 pipeline folder, ComfyUI-layout bf16 .safetensors of its transformer, Q8_0 .gguf of it)."""
    import torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file, save_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("to-diffusers")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-wan", root / "tiny-wan", seed=1)
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    original = {wan_name(k): v.to(torch.bfloat16) for k, v in state.items()}
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == state.keys()
    save_file(original, root / "wan-comfy.safetensors")
    _gguf(root / "wan-Q8_0.gguf", original)
    return folder, root / "wan-comfy.safetensors", root / "wan-Q8_0.gguf"


def _shard(*args):
    code, out, err = run_dmap("shard", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def _from_single_file(cls, folder, file, subfolder, dtype=None):
    import diffusers

    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    if file.suffix == ".gguf":
        kwargs["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    return cls.from_single_file(str(file), config=str(folder), subfolder=subfolder, local_files_only=True, **kwargs)


def _state(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_comfyui_safetensors_loads_as_from_single_file_builds_it(wan, tmp_path):
    import diffusers
    import torch

    folder, file, _ = wan
    report = _shard(file, "--to-diffusers", "--pipeline", folder, "-o", tmp_path / "out")
    assert report["verified"] and report["components"][0]["converted_tensors"] == 0  # renames only: byte copies
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    loaded = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out")  # plain diffusers, nothing of dmap's
    expected = _from_single_file(diffusers.WanTransformer3DModel, folder, file, "transformer", torch.bfloat16)
    got, want = _state(loaded), _state(expected)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name].to(tensor.dtype), tensor), name  # (_keep_in_fp32_modules load as float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (folder / "transformer" / "config.json").read_text())


def test_shards_and_index_as_diffusers_writes_them(wan, tmp_path):
    import diffusers
    import torch

    from dm_cli.model.shard import shard_to_diffusers

    folder, file, _ = wan
    result = shard_to_diffusers(str(file), "50KB", output=tmp_path / "out", dtype="fp32", pipeline=str(folder),
                                min_shard_size=1)  # tiny shards for a tiny model (the CLI's least is 1 MB)
    assert result.verified
    files = result.to_json()["components"][0]["files"]
    assert len(files) > 1 and (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    loaded = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out")
    expected = _from_single_file(diffusers.WanTransformer3DModel, folder, file, "transformer", torch.float32)
    got = _state(loaded)
    for name, tensor in _state(expected).items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name


def test_gguf_is_dequantized_as_diffusers_dequantizes_it(wan, tmp_path):
    import diffusers
    import torch
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    folder, _, file = wan
    report = _shard(file, "--to-diffusers", "--pipeline", folder, "-o", tmp_path / "out")
    assert report["dtype"] == "bfloat16" and any("dequantized" in n for n in report["notes"]), report
    from safetensors import safe_open

    loaded = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out", torch_dtype=torch.bfloat16)
    expected = _from_single_file(diffusers.WanTransformer3DModel, folder, file, "transformer", torch.bfloat16)
    keep = diffusers.WanTransformer3DModel._keep_in_fp32_modules
    got, quantized = _state(loaded), 0
    with safe_open(tmp_path / "out" / "diffusion_pytorch_model.safetensors", "pt") as handle:
        stored = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    assert set(stored) == set(dict(expected.named_parameters())) | {n for n in stored if n in dict(expected.named_buffers())}
    for name, tensor in _state(expected).items():
        if name not in stored:  # a buffer the model computes (rope.freqs_cos)
            continue
        quantized += hasattr(tensor, "quant_type")
        kept = any(module in name.split(".") for module in keep)
        want = dequantize_gguf_tensor(tensor).to(torch.float32 if kept else torch.bfloat16)
        assert stored[name] == ("F32" if kept else "BF16"), name  # as written, not as loaded
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert quantized >= 3  # the file really is quantized (the matrices with 32 columns), and the comparison saw it


def _flux2_file(tmp_path):
    """A tiny FLUX.2 transformer in BFL's layout (fused q/k/v and the swapped norm_out halves) as diffusers' own
    conversion reads it, and the random diffusers-layout state it came from."""
    import torch
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from safetensors.torch import save_file

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("model_index.json", "transformer", "scheduler"):
        source = PRESETS_DIR / "tiny-flux2" / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, configs / name)
    index = json.loads((configs / "model_index.json").read_text())
    keep = {k: v for k, v in index.items() if k.startswith("_") or k in ("transformer", "scheduler")}
    (configs / "model_index.json").write_text(json.dumps(keep))
    folder = write_random_pipeline(configs, tmp_path / "tiny-flux2", seed=2)
    from safetensors.torch import load_file

    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    order = {"to_q": 0, "to_k": 1, "to_v": 2, "add_q_proj": 0, "add_k_proj": 1, "add_v_proj": 2}
    parts: dict = {}
    for name in sorted(state, key=lambda n: [order.get(p, -1) for p in n.split(".")]):
        parts.setdefault(flux2_name(name), []).append(state[name])
    original = {name: torch.cat(p) if len(p) > 1 else p[0] for name, p in parts.items()}
    if "norm_out.linear.weight" in state:  # BFL stores the final modulation as (shift, scale); diffusers (scale, shift)
        scale, shift = state["norm_out.linear.weight"].chunk(2)
        original["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    save_file(original, tmp_path / "flux2-bfl.safetensors")
    return folder, tmp_path / "flux2-bfl.safetensors"


def test_fused_projections_are_split_as_diffusers_splits_them(tmp_path):
    import diffusers
    import torch

    folder, file = _flux2_file(tmp_path)
    _shard(file, "--to-diffusers", "--pipeline", folder, "-o", tmp_path / "out")
    loaded = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "out")
    expected = _from_single_file(diffusers.Flux2Transformer2DModel, folder, file, "transformer", torch.float32)
    got = _state(loaded)
    assert got.keys() == _state(expected).keys()
    for name, tensor in _state(expected).items():
        assert torch.equal(got[name].float(), tensor), name


def test_a_real_size_file_is_planned_from_its_header_alone(tmp_path):
    """No --pipeline: the bundled preset `dmap inspect` recognizes (Wan 2.2 A14B); a dry run over a 28 GB file of
    holes reads no tensor byte (its pages are never touched, so it takes seconds and no memory)."""
    from original_layouts import to_original

    from dm_cli.model.skeleton import load_skeleton
    from dm_cli.model.sources import resolve_source

    comp = resolve_source("wan2.2").component("transformer")
    skeleton = load_skeleton(comp.name, comp.library, comp.cls, comp.config)
    shapes = to_original({t.name: t.shape for t in skeleton.tensors if t.kind != "buffer_np"}, "wan")
    file = tmp_path / "wan2.2_t2v_high_noise_14B_bf16.safetensors"
    _header_only_safetensors(file, shapes)
    report = _shard(file, "--to-diffusers", "--dry-run", "-o", tmp_path / "out")
    assert report["dry_run"] and not (tmp_path / "out").exists()
    assert report["components"][0]["total_size"] == file.stat().st_size - _header_bytes(file)
    assert report["components"][0]["tensors"] == len(shapes)
    assert any("preset wan2.2" in note for note in report["notes"]), report["notes"]


def _header_bytes(path) -> int:
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def _header_only_safetensors(path, shapes, dtype="BF16"):
    """A safetensors file of these shapes whose data is a hole (a sparse file)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 2
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        handle.truncate(8 + len(raw) + offset)
    return path


def test_refusals_are_one_sentence(wan, tmp_path):
    import torch
    from safetensors.torch import save_file

    folder, file, gguf_file = wan
    diffusers_file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    unknown = tmp_path / "unknown.safetensors"
    save_file({"some.weight": torch.zeros(4, 4)}, unknown)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(file.read_bytes()[:-100])
    hostile_gguf = tmp_path / "hostile.gguf"
    hostile_gguf.write_bytes(gguf_file.read_bytes()[:4096])
    (tmp_path / "taken").mkdir()
    cases = [
        ((diffusers_file, "--pipeline", folder), "already in diffusers' layout"),
        ((diffusers_file,), "no original layout"),
        ((unknown,), "no original layout"),
        ((unknown, "--pipeline", folder), "does not"),
        ((file,), "bundles no config"),  # tiny Wan is no bundled preset's size: --pipeline gives the config
        ((file, "--pipeline", folder, "-o", tmp_path / "taken"), "exists"),
        ((file, "--pipeline", folder, "--dtype", "fp8"), "fp8"),
        ((file, "--pipeline", folder, "--in-place"), "drop --variant and --in-place"),
        ((file, "--pipeline", "tiny-flux"), "does not"),
        ((folder, "--pipeline", folder), "not one"),
        ((truncated, "--pipeline", folder), "truncated"),
        ((hostile_gguf, "--pipeline", folder), "hostile.gguf"),
        ((tmp_path / "missing.gguf", "--pipeline", folder), "does not exist"),
    ]
    for args, message in cases:
        code, _, err = run_dmap("shard", *args, "--to-diffusers", *(() if "-o" in args else ("-o", tmp_path / "o")))
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists() and list((tmp_path / "taken").iterdir()) == []
    code, _, err = run_dmap("shard", folder, "--pipeline", folder)
    assert code == 2 and "--pipeline goes with --to-diffusers" in err
    # with --overwrite the folder is replaced, atomically
    _shard(file, "--to-diffusers", "--pipeline", folder, "-o", tmp_path / "taken", "--overwrite")
    assert (tmp_path / "taken" / "config.json").is_file()

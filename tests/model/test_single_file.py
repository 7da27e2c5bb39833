"""`dmap inspect FILE.safetensors` on single-file checkpoints in an original layout (BFL FLUX, ComfyUI
`model.diffusion_model.` files, full LDM checkpoints with VAE and text encoders): the model diffusers' single-file
loader would take it for, the bundled config it maps to, and the parts in the file, from the header alone.

Each file is written from the key names and shapes of the real layout (sparse: the tensors are zeros never
written), with the real shapes where recognition or dmap's config check reads them and one element elsewhere.
The reference for "what model is this" is diffusers' own `infer_diffusers_model_type`, run on the same tensors
loaded as a real state dict.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_dmap

from dm_cli.io.checkpoint import read_safetensors_header
from dm_cli.model.formats import single_file_layout
from dm_cli.model.inspection import inspect_source

BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
CP = "model.diffusion_model."


def write(path: Path, tensors: dict, dtype: str = "BF16") -> Path:
    """A valid safetensors file: name -> shape (or (dtype, shape)); the data is a hole of zeros."""
    header, offset = {}, 0
    for name, spec in tensors.items():
        kind, shape = spec if isinstance(spec, tuple) else (dtype, spec)
        size = BYTES[kind]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return path


def blocks(stem: str, count: int, leaf: str = "norm.weight") -> dict:
    return {f"{stem}.{i}.{leaf}": [1] for i in range(count)}


def flux1(prefix: str = "", dev: bool = True, hidden: int = 3072) -> dict:
    keys = {"img_in.weight": [hidden, 64], "img_in.bias": [hidden], "time_in.in_layer.weight": [hidden, 1],
            "double_blocks.0.img_attn.norm.key_norm.scale": [128], **blocks("double_blocks", 19),
            **blocks("single_blocks", 38)}
    if dev:
        keys["guidance_in.in_layer.bias"] = [hidden]
    return {prefix + k: v for k, v in keys.items()}


def flux2(hidden: int, double: int, single: int) -> dict:
    return {"img_in.weight": [hidden, 128], "single_stream_modulation.lin.weight": [1, hidden],
            "double_blocks.0.img_attn.norm.key_norm.scale": [128], **blocks("double_blocks", double),
            **blocks("single_blocks", single)}


CLIP_L = {"text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight": [77, 768]}


def sd3_full() -> dict:
    return {CP + "joint_blocks.0.context_block.adaLN_modulation.1.bias": [9216], CP + "pos_embed": [1, 36864, 1],
            CP + "x_embedder.proj.weight": [1536, 16, 2, 2], **{CP + k: v for k, v in blocks("joint_blocks", 24).items()},
            **CLIP_L, "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight": [77, 1280],
            "text_encoders.t5xxl.transformer.shared.weight": [32128, 4], "first_stage_model.decoder.conv_in.weight": [512, 16, 3, 3]}


def sdxl_full() -> dict:
    return {CP + "input_blocks.0.0.weight": [320, 4, 3, 3],
            CP + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": ("F16", [640, 2048]),
            CP + "output_blocks.8.0.skip_connection.weight": [320, 640, 1, 1],
            "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight": [77, 768],
            "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias": [1280],
            "conditioner.embedders.1.model.positional_embedding": [77, 1280],
            "first_stage_model.encoder.conv_in.weight": [128, 3, 3, 3]}


def sd15_full() -> dict:
    return {CP + "input_blocks.0.0.weight": [320, 4, 3, 3],
            CP + "input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight": [320, 768],
            CP + "output_blocks.11.0.skip_connection.weight": [320, 640, 1, 1],
            "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight": [77, 768],
            "first_stage_model.decoder.conv_out.weight": [3, 128, 3, 3],
            "alphas_cumprod": ("F32", [1000]), "model_ema.decay": ("F32", [])}


def wan(dim: int, in_dim: int, layers: int) -> dict:
    return {CP + "head.modulation": [1, 2, dim], CP + "patch_embedding.weight": [dim, in_dim, 1, 2, 2],
            **{CP + k: v for k, v in blocks("blocks", layers).items()}}


# file -> (tensors, dtype, diffusers' model type, dmap's preset or None, the model named)
RECOGNIZED = {
    "flux1-dev": (flux1(), "BF16", "flux-dev", "flux", "FLUX.1 [dev] transformer, original (BFL) layout → diffusers "
                  "FluxTransformer2DModel, config from preset flux"),
    "flux1-dev-fp8": (flux1(CP), "F8_E4M3", "flux-dev", "flux", "ComfyUI prefix model.diffusion_model."),
    "flux1-schnell": ({**flux1(CP, dev=False), **CLIP_L, "text_encoders.t5xxl.transformer.shared.weight": [32128, 4],
                       "vae.decoder.conv_in.weight": [512, 16, 3, 3]}, "BF16", "flux-schnell", "flux-schnell",
                      "FLUX.1 [schnell] transformer"),
    "flux1-dev-narrow": (flux1(hidden=1536), "BF16", "flux-dev", None, "no bundled config"),
    "flux2-klein-4b": (flux2(3072, 5, 20), "BF16", "flux-2-dev", "flux2-klein", "FLUX.2 [klein] 4B transformer"),
    "flux2-dev": (flux2(6144, 8, 48), "BF16", "flux-2-dev", "flux2", "FLUX.2 [dev] transformer"),
    "sd3-medium-incl-clips": (sd3_full(), "F16", "sd3", "sd3", "Stable Diffusion 3 Medium transformer"),
    "sdxl-base": (sdxl_full(), "F16", "xl_base", "sdxl", "SDXL base unet, original (LDM) layout"),
    "sd15": (sd15_full(), "F16", "v1", "sd15", "Stable Diffusion 1.x unet"),
    "wan2.2-t2v-high-noise-14b": (wan(5120, 16, 40), "F8_E4M3", "wan-t2v-14B", "wan2.2", "Wan 14B text-to-video"),
    "wan2.1-t2v-1.3b": (wan(1536, 16, 30), "BF16", "wan-t2v-1.3B", None,
                        "no bundled config (diffusers' default: Wan-AI/Wan2.1-T2V-1.3B-Diffusers)"),
    "wan-vae": ({"decoder.middle.0.residual.0.gamma": [384, 1, 1, 1], "conv2.weight": [16, 16, 1, 1, 1]}, "BF16",
                "wan-t2v-14B", "wan2.2", "Wan 2.1 VAE (the VAE of Wan 2.1 and Wan 2.2 A14B) vae"),
    "z-image-turbo": ({"layers.0.adaLN_modulation.0.weight": [1, 256], "x_embedder.weight": [3840, 64],
                       **blocks("layers", 30)}, "BF16", "z-image-turbo", "z-image", "Z-Image Turbo transformer"),
}
# file -> (tensors, diffusers' answer: a model type, or None where it raises): not recognized, a bag of tensors
NOT_RECOGNIZED = {
    "bag": ({"w": [4], "encoder.weight": [2, 2]}, "v1"),
    "qwen-image-comfy": ({CP + "txt_norm.weight": [3584], CP + "img_in.weight": [3072, 64],
                          CP + "transformer_blocks.0.img_mod.1.weight": [1, 3072]}, "v1"),
    "sd3-bad-pos-embed": ({"joint_blocks.0.context_block.adaLN_modulation.1.bias": [9216], "pos_embed": [1, 7, 1]}, None),
    "flux-dev-no-img-in": ({"double_blocks.0.img_attn.norm.key_norm.scale": [128], "guidance_in.in_layer.bias": [8]},
                           None),
    "sd3-scalar": ({"joint_blocks.0.context_block.adaLN_modulation.1.bias": []}, None),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    made = {name: write(folder / f"{name}.safetensors", spec[0], spec[1]) for name, spec in RECOGNIZED.items()}
    made.update({name: write(folder / f"{name}.safetensors", spec[0]) for name, spec in NOT_RECOGNIZED.items()})
    return made


@pytest.mark.parametrize("name", sorted(RECOGNIZED))
def test_original_layouts_are_recognized(files, name):
    tensors, dtype, model_type, preset, said = RECOGNIZED[name]
    code, out, err = run_dmap("inspect", files[name], "--json")
    assert code == 0, err
    data = json.loads(out)
    found = data["single_file"]
    assert (found["model_type"], found["preset"]) == (model_type, preset)
    assert said in found["summary"]
    header = read_safetensors_header(files[name])
    assert sum(p["bytes"] for p in found["parts"]) == header.data_bytes == data["total"]["bytes"]
    assert sum(p["params"] for p in found["parts"]) == sum(t.numel for t in header.tensors.values())
    if preset is not None:
        assert found["config_checks"] and all(c["file"] == c["config"] for c in found["config_checks"])
    else:
        assert found["parts"][0]["config"] is None


def test_parts_of_mixed_checkpoints(files):
    def parts(name):
        return {p["name"]: p for p in inspect_source(str(files[name])).single_file["parts"]}

    sd15 = parts("sd15")
    assert list(sd15) == ["unet", "vae", "text_encoder", "other"]
    assert sd15["unet"]["prefix"] == CP and sd15["vae"]["prefix"] == "first_stage_model."
    assert sd15["unet"]["config"] == {"preset": "sd15", "component": "unet"} and sd15["other"]["config"] is None
    assert sd15["other"]["params"] == 1001 and sd15["other"]["bytes"] == 4004 and sd15["other"]["tensors"] == 2
    assert sd15["text_encoder"]["params"] == 77 * 768 and sd15["text_encoder"]["bytes"] == 77 * 768 * 2
    sdxl = parts("sdxl-base")
    assert list(sdxl) == ["unet", "vae", "text_encoder", "text_encoder_2"]
    assert sdxl["text_encoder_2"]["params"] == 1280 + 77 * 1280 and sdxl["text_encoder_2"]["config"] == {"preset": "sdxl", "component": "text_encoder_2"}
    assert sdxl["unet"]["dtype"] == "float16"
    sd3 = parts("sd3-medium-incl-clips")
    assert list(sd3) == ["transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"]
    assert sd3["text_encoder_3"]["params"] == 32128 * 4
    flux = parts("flux1-schnell")
    assert list(flux) == ["transformer", "vae", "text_encoder", "text_encoder_2"]  # T5 is FLUX's text_encoder_2
    assert flux["vae"]["prefix"] == "vae."
    assert list(parts("flux1-dev")) == ["transformer"] and parts("flux1-dev")["transformer"]["prefix"] == ""
    fp8 = parts("flux1-dev-fp8")["transformer"]
    assert fp8["dtype"] == "float8_e4m3fn" and fp8["bytes"] == fp8["params"]


def test_config_check_picks_the_preset_by_shapes(files):
    klein = inspect_source(str(files["flux2-klein-4b"])).single_file
    assert klein["preset"] == "flux2-klein"
    assert any(n.startswith("not preset flux2's transformer config: hidden size 3072 in the file, 6144") for n in klein["notes"])
    narrow = inspect_source(str(files["flux1-dev-narrow"])).single_file
    assert narrow["preset"] is None and any("hidden size 1536 in the file, 3072 in the config" in n for n in narrow["notes"])
    wan = inspect_source(str(files["wan2.2-t2v-high-noise-14b"])).single_file
    assert any("transformer_2 has the same config" in n for n in wan["notes"])


def test_table_names_the_model_and_the_parts(files):
    code, out, err = run_dmap("inspect", files["sd15"], env={"COLUMNS": "160"})
    assert code == 0, err
    assert "recognized: Stable Diffusion 1.x unet, original (LDM) layout → diffusers UNet2DConditionModel, config " \
           "from preset sd15" in " ".join(out.split())
    assert "parts in the file" in out and "first_stage_model." in out and "sd15/text_encoder" in out


@pytest.mark.parametrize("name", sorted(NOT_RECOGNIZED))
def test_unknown_layouts_stay_a_bag_of_tensors(files, name):
    code, out, err = run_dmap("inspect", files[name], "--json")
    assert code == 0, err
    data = json.loads(out)
    assert "single_file" not in data and data["components"][0]["class"] == "?"
    code, out, err = run_dmap("inspect", files[name])
    assert code == 0 and "recognized" not in out


def _diffusers_single_file_utils() -> dict:
    """diffusers' own `infer_diffusers_model_type`, `CHECKPOINT_KEY_NAMES` and `DIFFUSERS_DEFAULT_PIPELINE_PATHS`,
    taken from the installed `diffusers/loaders/single_file_utils.py` as written (the function compiled from its
    source text, the tables read as the literals they are) without importing diffusers: that import takes ~12 s
    here (it pulls in torchao), more than this whole file may."""
    import ast
    import importlib.util

    import torch

    path = Path(importlib.util.find_spec("diffusers").origin).parent / "loaders" / "single_file_utils.py"
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("CHECKPOINT_KEY_NAMES", "DIFFUSERS_DEFAULT_PIPELINE_PATHS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "infer_diffusers_model_type":
            scope = {"torch": torch, "CHECKPOINT_KEY_NAMES": None}
            exec(compile(ast.Module([node], []), str(path), "exec"), scope)  # noqa: S102 - the installed library's code
            found["infer"] = scope
    found["infer"]["CHECKPOINT_KEY_NAMES"] = found["CHECKPOINT_KEY_NAMES"]
    found["infer_diffusers_model_type"] = found.pop("infer")["infer_diffusers_model_type"]
    return found


def test_diffusers_gives_the_same_answer_on_the_same_tensors(files):
    """diffusers' infer_diffusers_model_type on a real state dict of each file = dmap's header-only answer."""
    from safetensors.torch import load_file

    infer_diffusers_model_type = _diffusers_single_file_utils()["infer_diffusers_model_type"]
    expected = {name: spec[2] for name, spec in RECOGNIZED.items()} | {n: s[1] for n, s in NOT_RECOGNIZED.items()}
    for name, path in files.items():
        state = load_file(path)
        try:
            theirs = infer_diffusers_model_type(state)
        except Exception:  # noqa: BLE001 - where diffusers raises, dmap says "not recognized"
            theirs = None
        ours = single_file_layout.infer_model_type({k: tuple(v.shape) for k, v in state.items()})
        assert ours == theirs == expected[name], name


def test_key_names_and_default_repos_are_diffusers_own():
    theirs = _diffusers_single_file_utils()
    assert single_file_layout.CHECKPOINT_KEY_NAMES == theirs["CHECKPOINT_KEY_NAMES"]
    repos = {name: "/".join(filter(None, (p["pretrained_model_name_or_path"], p.get("subfolder"))))
             for name, p in theirs["DIFFUSERS_DEFAULT_PIPELINE_PATHS"].items()}
    ours = {name: row[3] for name, row in single_file_layout.MODEL_TYPES.items() if row[3] is not None}
    assert ours == repos


def test_hostile_names_are_escaped_and_never_crash(tmp_path):
    evil = {"\x1b]0;pwned\x07\x1b[2J.weight": [2], "double_blocks." + "9" * 5000 + ".x": [1],
            "double_blocks.\u00b2.x": [1], "n" * 1_000_000: [1], "\u202eevil.weight": [1]}
    path = write(tmp_path / "flux1-dev-evil.safetensors", {**flux1(), **evil})
    for args in (["--json"], [], ["--depth", "1"]):
        code, out, err = run_dmap("inspect", path, *args)
        assert code == 0, err
        assert "\x1b" not in out + err and "\u202e" not in out + err and "Traceback" not in err
    found = inspect_source(str(path)).single_file
    assert found["preset"] == "flux"  # the 5000-digit and non-ASCII indices are not counted as blocks
    assert found["parts"][0]["tensors"] == len(flux1()) + len(evil)


def test_recognizing_needs_no_torch(files):
    code = ("import sys, json; from dm_cli.cli import main\ntry:\n    main(['inspect', sys.argv[1], '--json'])\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, str(files["sdxl-base"])], capture_output=True, text=True)
    assert proc.stderr.strip().endswith("NO-TORCH"), proc.stderr
    assert json.loads(proc.stdout)["single_file"]["preset"] == "sdxl"

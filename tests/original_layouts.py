"""diffusers' tensor names back to the original (community) layouts, for tests that write single files: the inverse
of diffusers' `convert_wan_transformer_to_diffusers`, `convert_flux2_transformer_checkpoint_to_diffusers` and
`convert_flux_transformer_checkpoint_to_diffusers` (0.42.1). The tests check each inverse by running diffusers' own
conversion back.

`to_original(names_and_shapes, layout)` returns {original name: shape}; FLUX.2's fused projections (q, k, v of the
double blocks) are concatenated along rows, as the original checkpoints store them.
"""

WAN_RENAMES = [  # diffusers -> Wan (convert_wan_transformer_to_diffusers, read backwards)
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"), ("attn1", "self_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
]

FLUX2_TOP = [  # diffusers -> BFL FLUX.2, outside the blocks
    ("x_embedder", "img_in"), ("context_embedder", "txt_in"),
    ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    ("single_stream_modulation.linear", "single_stream_modulation.lin"),
    ("proj_out", "final_layer.linear"), ("norm_out.linear", "final_layer.adaLN_modulation.1"),
]
FLUX2_DOUBLE = {
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm", "attn.to_out.0": "img_attn.proj",
    "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2", "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm", "attn.to_add_out": "txt_attn.proj",
    "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
    "attn.to_q": "img_attn.qkv", "attn.to_k": "img_attn.qkv", "attn.to_v": "img_attn.qkv",
    "attn.add_q_proj": "txt_attn.qkv", "attn.add_k_proj": "txt_attn.qkv", "attn.add_v_proj": "txt_attn.qkv",
}
FLUX2_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
                "attn.norm_k": "norm.key_norm"}
NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def wan_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name.removeprefix("proj_out.")
    name = name.replace("scale_shift_table", "modulation")
    for new, old in WAN_RENAMES:
        name = name.replace(new, old)
    return "model.diffusion_model." + name  # ComfyUI's prefix


def flux2_name(name: str) -> str:
    for prefix, table, new_prefix in (("transformer_blocks.", FLUX2_DOUBLE, "double_blocks."),
                                      ("single_transformer_blocks.", FLUX2_SINGLE, "single_blocks.")):
        if name.startswith(prefix):
            index, inner = name.removeprefix(prefix).split(".", 1)
            module, param = inner.rsplit(".", 1)
            param = "scale" if module.rsplit(".", 1)[-1] in NORMS else param
            return f"{new_prefix}{index}.{table[module]}.{param}"
    for new, old in FLUX2_TOP:
        if name.startswith(new + "."):
            return old + name[len(new):]
    return name


def to_original(shapes: dict[str, tuple[int, ...]], layout: str) -> dict[str, tuple[int, ...]]:
    """{diffusers name: shape} -> {original name: shape}; fused q/k/v stack their rows."""
    rename = {"wan": wan_name, "flux2": flux2_name}[layout]
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        original = rename(name)
        if original in out:  # q, k, v of one fused projection
            out[original] = (out[original][0] + shape[0], *shape[1:])
        else:
            out[original] = tuple(shape)
    return out


def header_only_gguf(path, shapes: dict[str, tuple[int, ...]], quant):
    """A GGUF file of these tensors (original names, outermost dim first) whose data is a hole: matrices whose rows
    hold whole blocks in `quant` (a gguf.GGMLQuantizationType), the rest F32 (biases, norms) or F16 (convolutions),
    as the community quantizations store them. Only headers are read by `dmap plan`."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "model")
    block, type_size = gguf.GGML_QUANT_SIZES[quant]
    total = 0
    for name, shape in shapes.items():
        if len(shape) == 2 and shape[-1] % block == 0:
            nbytes = shape[0] * shape[1] // block * type_size
            writer.add_tensor_info(name, (shape[0], shape[1] // block * type_size), np.dtype(np.uint8), nbytes,
                                   raw_dtype=quant)
        else:
            kind = np.float32 if len(shape) < 2 else np.float16
            nbytes = int(np.prod(shape)) * np.dtype(kind).itemsize
            writer.add_tensor_info(name, shape, np.dtype(kind), nbytes)
        total += gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    start = gguf.GGUFWriter.ggml_pad(path.stat().st_size, writer.data_alignment)
    with open(path, "r+b") as handle:
        handle.truncate(start + total)
    return path


FLUX1_TOP = [  # diffusers -> BFL FLUX.1, outside the blocks
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("context_embedder", "txt_in"), ("x_embedder", "img_in"), ("proj_out", "final_layer.linear"),
]
FLUX1_DOUBLE = {
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
}
FLUX1_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2", "attn.norm_q": "norm.query_norm",
                "attn.norm_k": "norm.key_norm"}
FLUX1_FUSED = {  # fused original projection -> its parts in row order
    "double": {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")},
    "single": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")},
}


def flux1_original(state: dict) -> dict:
    """A diffusers FLUX.1 transformer state dict in BFL's layout (tensors): fused q/k/v (and, in single blocks, the
    MLP input) concatenated along rows, the final modulation's halves swapped back (diffusers stores scale, shift)."""
    import torch

    out = {}
    for name in ("norm_out.linear.weight", "norm_out.linear.bias"):
        scale, shift = state[name].chunk(2, dim=0)
        out["final_layer.adaLN_modulation.1." + name.rsplit(".", 1)[1]] = torch.cat([shift, scale], dim=0)
    for new, old in FLUX1_TOP:
        for param in ("weight", "bias"):
            if f"{new}.{param}" in state:
                out[f"{old}.{param}"] = state[f"{new}.{param}"]
    blocks = {"double": ("transformer_blocks.", "double_blocks.", FLUX1_DOUBLE),
              "single": ("single_transformer_blocks.", "single_blocks.", FLUX1_SINGLE)}
    for kind, (prefix, original, table) in blocks.items():
        indices = sorted({int(n.removeprefix(prefix).split(".")[0]) for n in state if n.startswith(prefix)})
        for i in indices:
            here = f"{prefix}{i}."
            for module, target in table.items():
                for param in ("weight", "bias"):
                    if here + f"{module}.{param}" in state:
                        leaf = "scale" if target.endswith("_norm") else param
                        out[f"{original}{i}.{target}.{leaf}"] = state[here + f"{module}.{param}"]
            for target, parts in FLUX1_FUSED[kind].items():
                for param in ("weight", "bias"):
                    out[f"{original}{i}.{target}.{param}"] = torch.cat([state[here + f"{p}.{param}"] for p in parts])
    return out


def q4_k_codes(rows: int, cols: int, seed: int, scale: float = 0.002, minimum: float = 0.001):
    """Q4_K blocks (144 bytes per 256 weights): f16 scale and min, 12 bytes of 6-bit sub-scales, 128 of codes, the
    codes random (gguf's writer cannot quantize K-quants; any reader dequantizes these alike)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(minimum).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def write_gguf(path, original: dict, arch: str, quant_of, q4_k_scales: tuple[float, float] = (0.002, 0.001)):
    """A GGUF file of `original` ({name: tensor}, in the order given): `quant_of(array)` says "Q4_K" (random codes,
    `q4_k_codes`), "Q8_0" (gguf's own quantizer) or None (F32) for each tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for position, (name, tensor) in enumerate(original.items()):
        array = tensor.float().numpy()
        kind = quant_of(array)
        if kind == "Q4_K":
            writer.add_tensor(name, q4_k_codes(*array.shape, position, *q4_k_scales),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif kind == "Q8_0":
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_0_rows(array) -> str | None:
    """Q8_0 for every matrix whose rows hold whole Q8_0 blocks (32 weights)."""
    return "Q8_0" if array.ndim == 2 and array.shape[1] % 32 == 0 else None

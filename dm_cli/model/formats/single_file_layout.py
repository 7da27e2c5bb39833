"""Single-file checkpoints in an original layout (`flux1-dev.safetensors`, a ComfyUI `model.diffusion_model.` file,
a full SD checkpoint with its VAE and text encoders): what model it is, which diffusers config it maps to, and
which parts the file holds, from the safetensors header alone (keys, shapes, dtypes), never a tensor byte.

What model a file is follows diffusers' own single-file loader (`infer_diffusers_model_type` in
`diffusers/loaders/single_file_utils.py`, 0.42.1), rewritten here on (key -> shape) so that inspect neither
imports torch nor reads tensor data: the same key names (`CHECKPOINT_KEY_NAMES`), the same branches in the same
order, the same shape checks, and the same answer; where diffusers raises (a shape check on a missing key or a
1-D tensor, a branch that assigns nothing), the file is "not recognized". Two differences, both said in the
output: diffusers answers "v1" for any file it does not know, which dmap calls recognized only when the file
holds the SD 1.x key; and the one answer diffusers takes from tensor values (Z-Image ControlNet 2.0 or 2.1) is
left open. tests/model/test_single_file.py checks that diffusers' function gives the same answer on every test file
and that the key names and default repos here are diffusers' own.

dmap then maps the answer to its bundled presets (dm_cli/presets) and checks the file's shapes against the
preset's config (hidden size, block counts, channels): a FLUX.2 file is [dev] or [klein] 4B by its shapes, and a
file whose shapes fit no bundled config says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dm_cli.errors import DmapError
from dm_cli.model.sources import PRESETS, resolve_source

# diffusers.loaders.single_file_utils.CHECKPOINT_KEY_NAMES, 0.42.1 (a test checks they are equal)
CHECKPOINT_KEY_NAMES = {
    "v1": "model.diffusion_model.output_blocks.11.0.skip_connection.weight",
    "v2": "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight",
    "xl_base": "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias",
    "xl_refiner": "conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias",
    "upscale": "model.diffusion_model.input_blocks.10.0.skip_connection.bias",
    "controlnet": ["control_model.time_embed.0.weight", "controlnet_cond_embedding.conv_in.weight"],
    "controlnet_xl": "add_embedding.linear_1.weight",
    "controlnet_xl_large": "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.weight",
    "controlnet_xl_mid": "down_blocks.1.attentions.0.norm.weight",
    "playground-v2-5": "edm_mean",
    "inpainting": "model.diffusion_model.input_blocks.0.0.weight",
    "clip": "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
    "clip_sdxl": "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight",
    "clip_sd3": "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
    "open_clip": "cond_stage_model.model.token_embedding.weight",
    "open_clip_sdxl": "conditioner.embedders.1.model.positional_embedding",
    "open_clip_sdxl_refiner": "conditioner.embedders.0.model.text_projection",
    "open_clip_sd3": "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight",
    "stable_cascade_stage_b": "down_blocks.1.0.channelwise.0.weight",
    "stable_cascade_stage_c": "clip_txt_mapper.weight",
    "sd3": ["joint_blocks.0.context_block.adaLN_modulation.1.bias",
            "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"],
    "sd35_large": ["joint_blocks.37.x_block.mlp.fc1.weight", "model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight"],
    "animatediff": "down_blocks.0.motion_modules.0.temporal_transformer.transformer_blocks.0.attention_blocks.0.pos_encoder.pe",
    "animatediff_v2": "mid_block.motion_modules.0.temporal_transformer.norm.bias",
    "animatediff_sdxl_beta": "up_blocks.2.motion_modules.0.temporal_transformer.norm.weight",
    "animatediff_scribble": "controlnet_cond_embedding.conv_in.weight",
    "animatediff_rgb": "controlnet_cond_embedding.weight",
    "auraflow": ["double_layers.0.attn.w2q.weight", "double_layers.0.attn.w1q.weight", "cond_seq_linear.weight",
                 "t_embedder.mlp.0.weight"],
    "flux": ["double_blocks.0.img_attn.norm.key_norm.scale",
             "model.diffusion_model.double_blocks.0.img_attn.norm.key_norm.scale"],
    "ltx-video": ["model.diffusion_model.patchify_proj.weight", "model.diffusion_model.transformer_blocks.27.scale_shift_table",
                  "patchify_proj.weight", "transformer_blocks.27.scale_shift_table", "vae.decoder.last_scale_shift_table",
                  "vae.decoder.up_blocks.9.res_blocks.0.conv1.conv.weight"],
    "autoencoder-dc": "decoder.stages.1.op_list.0.main.conv.conv.bias",
    "autoencoder-dc-sana": "encoder.project_in.conv.bias",
    "mochi-1-preview": ["model.diffusion_model.blocks.0.attn.qkv_x.weight", "blocks.0.attn.qkv_x.weight"],
    "hunyuan-video": "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",
    "instruct-pix2pix": "model.diffusion_model.input_blocks.0.0.weight",
    "lumina2": ["model.diffusion_model.cap_embedder.0.weight", "cap_embedder.0.weight"],
    "z-image-turbo": ["model.diffusion_model.layers.0.adaLN_modulation.0.weight", "layers.0.adaLN_modulation.0.weight"],
    "z-image-turbo-controlnet": "control_all_x_embedder.2-1.weight",
    "z-image-turbo-controlnet-2.x": "control_layers.14.adaLN_modulation.0.weight",
    "minimax-h3": "token_refiner.blocks.0.attn.qkv_proj.weight",
    "sana": ["blocks.0.cross_attn.q_linear.weight", "blocks.0.cross_attn.q_linear.bias",
             "blocks.0.cross_attn.kv_linear.weight", "blocks.0.cross_attn.kv_linear.bias"],
    "wan": ["model.diffusion_model.head.modulation", "head.modulation"],
    "wan_vae": "decoder.middle.0.residual.0.gamma",
    "wan_vace": "vace_blocks.0.after_proj.bias",
    "wan_animate": "motion_encoder.dec.direction.weight",
    "hidream": "double_stream_blocks.0.block.adaLN_modulation.1.bias",
    "cosmos-1.0": ["net.x_embedder.proj.1.weight", "net.blocks.block1.blocks.0.block.attn.to_q.0.weight",
                   "net.extra_pos_embedder.pos_emb_h"],
    "cosmos-2.0": ["net.x_embedder.proj.1.weight", "net.blocks.0.self_attn.q_proj.weight", "net.pos_embedder.dim_spatial_range"],
    "flux2": ["model.diffusion_model.single_stream_modulation.lin.weight", "single_stream_modulation.lin.weight"],
    "flux3": ["model.diffusion_model.early_stream_modulations.image.lin.weight", "early_stream_modulations.image.lin.weight"],
    "flux3-distilled": ["model.diffusion_model.ref_time_in.in_layer.weight", "ref_time_in.in_layer.weight"],
    "chroma": ["model.diffusion_model.distilled_guidance_layer.in_proj.bias", "distilled_guidance_layer.in_proj.bias"],
    "ltx2": ["model.diffusion_model.av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight",
             "vae.per_channel_statistics.mean-of-means", "audio_vae.per_channel_statistics.mean-of-means"],
    "qwen-image-2.1": ["model.diffusion_model.txt_in.text_norm.weight", "txt_in.text_norm.weight"],
    "krea2": ["model.diffusion_model.txtfusion.projector.weight", "txtfusion.projector.weight"],
}
K = CHECKPOINT_KEY_NAMES
COMFY_PREFIX = "model.diffusion_model."  # diffusers' LDM_UNET_KEY, and ComfyUI's prefix for every denoiser
Z_IMAGE_2X = "z-image-turbo-controlnet-2.x"  # 2.0 or 2.1: diffusers tells them apart by tensor values

# model type -> (name, pipeline component, diffusers class, diffusers' default repo: DIFFUSERS_DEFAULT_PIPELINE_PATHS)
_UNET, _TR, _CN = "UNet2DConditionModel", "transformer", "controlnet"
MODEL_TYPES: dict[str, tuple[str, str, str, str | None]] = {
    "v1": ("Stable Diffusion 1.x", "unet", _UNET, "stable-diffusion-v1-5/stable-diffusion-v1-5"),
    "v2": ("Stable Diffusion 2.x", "unet", _UNET, "stabilityai/stable-diffusion-2-1"),
    "inpainting": ("Stable Diffusion 1.5 Inpainting", "unet", _UNET, "stable-diffusion-v1-5/stable-diffusion-inpainting"),
    "inpainting_v2": ("Stable Diffusion 2 Inpainting", "unet", _UNET, "stabilityai/stable-diffusion-2-inpainting"),
    "xl_base": ("SDXL base", "unet", _UNET, "stabilityai/stable-diffusion-xl-base-1.0"),
    "xl_refiner": ("SDXL refiner", "unet", _UNET, "stabilityai/stable-diffusion-xl-refiner-1.0"),
    "xl_inpaint": ("SDXL Inpainting", "unet", _UNET, "diffusers/stable-diffusion-xl-1.0-inpainting-0.1"),
    "playground-v2-5": ("Playground v2.5", "unet", _UNET, "playgroundai/playground-v2.5-1024px-aesthetic"),
    "upscale": ("Stable Diffusion x4 upscaler", "unet", _UNET, "stabilityai/stable-diffusion-x4-upscaler"),
    "instruct-pix2pix": ("InstructPix2Pix", "unet", _UNET, "timbrooks/instruct-pix2pix"),
    "controlnet": ("ControlNet (SD 1.5)", _CN, "ControlNetModel", "lllyasviel/control_v11p_sd15_canny"),
    "controlnet_xl_large": ("ControlNet SDXL (large)", _CN, "ControlNetModel", "diffusers/controlnet-canny-sdxl-1.0"),
    "controlnet_xl_mid": ("ControlNet SDXL (mid)", _CN, "ControlNetModel", "diffusers/controlnet-canny-sdxl-1.0-mid"),
    "controlnet_xl_small": ("ControlNet SDXL (small)", _CN, "ControlNetModel", "diffusers/controlnet-canny-sdxl-1.0-small"),
    "stable_cascade_stage_b": ("Stable Cascade stage B", "decoder", "StableCascadeUNet", "stabilityai/stable-cascade/decoder"),
    "stable_cascade_stage_b_lite": ("Stable Cascade stage B lite", "decoder", "StableCascadeUNet",
                                    "stabilityai/stable-cascade/decoder_lite"),
    "stable_cascade_stage_c": ("Stable Cascade stage C", "prior", "StableCascadeUNet", "stabilityai/stable-cascade-prior/prior"),
    "stable_cascade_stage_c_lite": ("Stable Cascade stage C lite", "prior", "StableCascadeUNet",
                                    "stabilityai/stable-cascade-prior/prior_lite"),
    "sd3": ("Stable Diffusion 3 Medium", _TR, "SD3Transformer2DModel", "stabilityai/stable-diffusion-3-medium-diffusers"),
    "sd35_medium": ("Stable Diffusion 3.5 Medium", _TR, "SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-medium"),
    "sd35_large": ("Stable Diffusion 3.5 Large", _TR, "SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-large"),
    "animatediff_v1": ("AnimateDiff v1", "motion_adapter", "MotionAdapter", "guoyww/animatediff-motion-adapter-v1-5"),
    "animatediff_v2": ("AnimateDiff v2", "motion_adapter", "MotionAdapter", "guoyww/animatediff-motion-adapter-v1-5-2"),
    "animatediff_v3": ("AnimateDiff v3", "motion_adapter", "MotionAdapter", "guoyww/animatediff-motion-adapter-v1-5-3"),
    "animatediff_sdxl_beta": ("AnimateDiff SDXL beta", "motion_adapter", "MotionAdapter",
                              "guoyww/animatediff-motion-adapter-sdxl-beta"),
    "animatediff_scribble": ("SparseCtrl scribble", _CN, "SparseControlNetModel", "guoyww/animatediff-sparsectrl-scribble"),
    "animatediff_rgb": ("SparseCtrl RGB", _CN, "SparseControlNetModel", "guoyww/animatediff-sparsectrl-rgb"),
    "auraflow": ("AuraFlow", _TR, "AuraFlowTransformer2DModel", "fal/AuraFlow-v0.3"),
    "flux-dev": ("FLUX.1 [dev]", _TR, "FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev"),
    "flux-fill": ("FLUX.1 Fill [dev]", _TR, "FluxTransformer2DModel", "black-forest-labs/FLUX.1-Fill-dev"),
    "flux-depth": ("FLUX.1 Depth [dev]", _TR, "FluxTransformer2DModel", "black-forest-labs/FLUX.1-Depth-dev"),
    "flux-schnell": ("FLUX.1 [schnell]", _TR, "FluxTransformer2DModel", "black-forest-labs/FLUX.1-schnell"),
    "flux-2-dev": ("FLUX.2", _TR, "Flux2Transformer2DModel", "black-forest-labs/FLUX.2-dev"),
    "flux-3-image": ("FLUX.3 image [klein] base", _TR, "Flux3Transformer2DModel", "black-forest-labs/flux-3-image-klein-base"),
    "flux-3-image-distilled": ("FLUX.3 image [klein]", _TR, "Flux3Transformer2DModel", "black-forest-labs/flux-3-image-klein"),
    "chroma": ("Chroma", _TR, "ChromaTransformer2DModel", "lodestones/Chroma1-HD"),
    "ltx-video": ("LTX-Video 0.9.0", _TR, "LTXVideoTransformer3DModel", "diffusers/LTX-Video-0.9.0"),
    "ltx-video-0.9.1": ("LTX-Video 0.9.1", _TR, "LTXVideoTransformer3DModel", "diffusers/LTX-Video-0.9.1"),
    "ltx-video-0.9.5": ("LTX-Video 0.9.5", _TR, "LTXVideoTransformer3DModel", "Lightricks/LTX-Video-0.9.5"),
    "ltx-video-0.9.7": ("LTX-Video 0.9.7", _TR, "LTXVideoTransformer3DModel", "Lightricks/LTX-Video-0.9.7-dev"),
    "autoencoder-dc-f128c512": ("DC-AE f128c512", "vae", "AutoencoderDC", "mit-han-lab/dc-ae-f128c512-mix-1.0-diffusers"),
    "autoencoder-dc-f64c128": ("DC-AE f64c128", "vae", "AutoencoderDC", "mit-han-lab/dc-ae-f64c128-mix-1.0-diffusers"),
    "autoencoder-dc-f32c32": ("DC-AE f32c32", "vae", "AutoencoderDC", "mit-han-lab/dc-ae-f32c32-mix-1.0-diffusers"),
    "autoencoder-dc-f32c32-sana": ("DC-AE f32c32 (Sana)", "vae", "AutoencoderDC", "mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers"),
    "mochi-1-preview": ("Mochi 1 preview", _TR, "MochiTransformer3DModel", "genmo/mochi-1-preview"),
    "hunyuan-video": ("HunyuanVideo", _TR, "HunyuanVideoTransformer3DModel", "hunyuanvideo-community/HunyuanVideo"),
    "lumina2": ("Lumina Image 2.0", _TR, "Lumina2Transformer2DModel", "Alpha-VLLM/Lumina-Image-2.0"),
    "sana": ("Sana", _TR, "SanaTransformer2DModel", "Efficient-Large-Model/Sana_1600M_1024px_diffusers"),
    "wan-t2v-1.3B": ("Wan 2.1 T2V 1.3B", _TR, "WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    "wan-t2v-14B": ("Wan 14B text-to-video (Wan 2.1 T2V 14B, or one Wan 2.2 T2V A14B expert)", _TR,
                    "WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    "wan-i2v-14B": ("Wan 2.1 I2V 14B", _TR, "WanTransformer3DModel", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
    "wan-animate-14B": ("Wan 2.2 Animate 14B", _TR, "WanAnimateTransformer3DModel", "Wan-AI/Wan2.2-Animate-14B-Diffusers"),
    "wan-vace-1.3B": ("Wan 2.1 VACE 1.3B", _TR, "WanVACETransformer3DModel", "Wan-AI/Wan2.1-VACE-1.3B-diffusers"),
    "wan-vace-14B": ("Wan 2.1 VACE 14B", _TR, "WanVACETransformer3DModel", "Wan-AI/Wan2.1-VACE-14B-diffusers"),
    "hidream": ("HiDream-I1", _TR, "HiDreamImageTransformer2DModel", "HiDream-ai/HiDream-I1-Dev"),
    "cosmos-1.0-t2w-7B": ("Cosmos 1.0 Text2World 7B", _TR, "CosmosTransformer3DModel", "nvidia/Cosmos-1.0-Diffusion-7B-Text2World"),
    "cosmos-1.0-t2w-14B": ("Cosmos 1.0 Text2World 14B", _TR, "CosmosTransformer3DModel",
                           "nvidia/Cosmos-1.0-Diffusion-14B-Text2World"),
    "cosmos-1.0-v2w-7B": ("Cosmos 1.0 Video2World 7B", _TR, "CosmosTransformer3DModel",
                          "nvidia/Cosmos-1.0-Diffusion-7B-Video2World"),
    "cosmos-1.0-v2w-14B": ("Cosmos 1.0 Video2World 14B", _TR, "CosmosTransformer3DModel",
                           "nvidia/Cosmos-1.0-Diffusion-14B-Video2World"),
    "cosmos-2.0-t2i-2B": ("Cosmos Predict2 Text2Image 2B", _TR, "CosmosTransformer3DModel", "nvidia/Cosmos-Predict2-2B-Text2Image"),
    "cosmos-2.0-t2i-14B": ("Cosmos Predict2 Text2Image 14B", _TR, "CosmosTransformer3DModel",
                           "nvidia/Cosmos-Predict2-14B-Text2Image"),
    "cosmos-2.0-v2w-2B": ("Cosmos Predict2 Video2World 2B", _TR, "CosmosTransformer3DModel", "nvidia/Cosmos-Predict2-2B-Video2World"),
    "cosmos-2.0-v2w-14B": ("Cosmos Predict2 Video2World 14B", _TR, "CosmosTransformer3DModel",
                           "nvidia/Cosmos-Predict2-14B-Video2World"),
    "z-image-turbo": ("Z-Image Turbo", _TR, "ZImageTransformer2DModel", "Tongyi-MAI/Z-Image-Turbo"),
    "z-image-turbo-controlnet": ("Z-Image Turbo ControlNet Union", _CN, "ZImageControlNetModel",
                                 "hlky/Z-Image-Turbo-Fun-Controlnet-Union"),
    "z-image-turbo-controlnet-2.0": ("Z-Image Turbo ControlNet Union 2.0", _CN, "ZImageControlNetModel",
                                     "hlky/Z-Image-Turbo-Fun-Controlnet-Union-2.0"),
    "z-image-turbo-controlnet-2.1": ("Z-Image Turbo ControlNet Union 2.1", _CN, "ZImageControlNetModel",
                                     "hlky/Z-Image-Turbo-Fun-Controlnet-Union-2.1"),
    Z_IMAGE_2X: ("Z-Image Turbo ControlNet Union 2.0 or 2.1 (told apart by tensor values, which dmap does not read)", _CN,
                 "ZImageControlNetModel", None),
    "ltx2-dev": ("LTX-2", _TR, "LTX2VideoTransformer3DModel", "Lightricks/LTX-2"),
    "qwen-image-2.1": ("Qwen-Image 2.1", _TR, "QwenImage21Transformer2DModel", "Qwen/Qwen-Image-2.1"),
    "krea2": ("Krea 2", _TR, "Krea2Transformer2DModel", "krea/Krea-2-Raw"),
    "minimax-h3": ("MiniMax H3", _TR, "MiniMaxH3Transformer3DModel", "MiniMaxAI/MiniMax-H3"),
}
WAN_VAE = ("Wan 2.1 VAE (the VAE of Wan 2.1 and Wan 2.2 A14B)", "vae", "AutoencoderKLWan")

# dmap's mapping: model type -> the bundled presets whose config it may have, tried in order (shapes decide)
PRESET_CANDIDATES = {
    "flux-dev": ("flux",), "flux-schnell": ("flux-schnell",), "flux-2-dev": ("flux2", "flux2-klein"),
    "sd3": ("sd3",), "xl_base": ("sdxl",), "v1": ("sd15",), "wan-t2v-14B": ("wan2.2",), "z-image-turbo": ("z-image",),
}
_ORIGINAL_LAYOUT = {"flux": "BFL", "sd3": "Stability MMDiT", "xl_": "LDM", "v1": "LDM", "v2": "LDM", "inpainting": "LDM",
                    "wan": "Wan", "z-image": "Z-Image", "chroma": "BFL"}
_LDM_TYPES = ("v1", "v2", "inpainting", "inpainting_v2", "xl_base", "xl_refiner", "xl_inpaint", "playground-v2-5",
              "upscale", "instruct-pix2pix")


class _NoAnswer(Exception):
    """A branch of diffusers' function that assigns no model type (an UnboundLocalError there)."""


def _any(c: Mapping, name: str) -> bool:
    return any(key in c for key in K[name])


def _sd_types(c: Mapping) -> str | None:
    """diffusers' branches from inpainting to sd35_large, in order."""
    if K["inpainting"] in c and c[K["inpainting"]][1] == 9:
        if K["v2"] in c and c[K["v2"]][-1] == 1024:
            return "inpainting_v2"
        return "xl_inpaint" if K["xl_base"] in c else "inpainting"
    if K["v2"] in c and c[K["v2"]][-1] == 1024:
        return "v2"
    for name in ("playground-v2-5", "xl_base", "xl_refiner", "upscale"):
        if K[name] in c:
            return name
    if _any(c, "controlnet"):
        if K["controlnet_xl"] in c:
            if K["controlnet_xl_large"] in c:
                return "controlnet_xl_large"
            return "controlnet_xl_mid" if K["controlnet_xl_mid"] in c else "controlnet_xl_small"
        return "controlnet"
    stage_c, stage_b = K["stable_cascade_stage_c"], K["stable_cascade_stage_b"]
    for key, dim, size, name in ((stage_c, 0, 1536, "stable_cascade_stage_c_lite"), (stage_c, 0, 2048, "stable_cascade_stage_c"),
                                 (stage_b, -1, 576, "stable_cascade_stage_b_lite"), (stage_b, -1, 640, "stable_cascade_stage_b")):
        if key in c and c[key][dim] == size:
            return name
    if _any(c, "sd3") and any(c[key][-1] == 9216 if key in c else False for key in K["sd3"]):
        key = "model.diffusion_model.pos_embed" if "model.diffusion_model.pos_embed" in c else "pos_embed"
        if c[key][1] == 36864:
            return "sd3"
        if c[key][1] == 147456:
            return "sd35_medium"
        raise _NoAnswer
    return "sd35_large" if _any(c, "sd35_large") else None


def _dit_types(c: Mapping) -> str | None:
    """diffusers' branches from animatediff to autoencoder-dc, in order."""
    if K["animatediff"] in c:
        for name in ("animatediff_scribble", "animatediff_rgb", "animatediff_v2"):
            if K[name] in c:
                return name
        if c[K["animatediff_sdxl_beta"]][-1] == 320:
            return "animatediff_sdxl_beta"
        return "animatediff_v1" if c[K["animatediff"]][1] == 24 else "animatediff_v3"
    if _any(c, "flux2"):
        return "flux-2-dev"
    if _any(c, "flux3"):
        return "flux-3-image-distilled" if _any(c, "flux3-distilled") else "flux-3-image"
    if _any(c, "chroma"):
        return "chroma"
    if _any(c, "flux"):
        if not any(g in c for g in ("guidance_in.in_layer.bias", "model.diffusion_model.guidance_in.in_layer.bias")):
            return "flux-schnell"
        key = "model.diffusion_model.img_in.weight" if "model.diffusion_model.img_in.weight" in c else "img_in.weight"
        return {384: "flux-fill", 128: "flux-depth"}.get(c[key][1], "flux-dev")
    if _any(c, "ltx-video"):
        if any(key.endswith("transformer_blocks.47.scale_shift_table") for key in c):
            return "ltx-video-0.9.7"
        if "vae.encoder.conv_in.conv.bias" in c and c["vae.encoder.conv_out.conv.weight"][1] == 2048:
            return "ltx-video-0.9.5"
        if "vae.decoder.last_time_embedder.timestep_embedder.linear_1.weight" in c:
            return "ltx-video-0.9.1"
        return "ltx-video"
    if K["autoencoder-dc"] in c:
        encoder, decoder = "encoder.project_in.conv.conv.bias", "decoder.project_in.main.conv.weight"
        if K["autoencoder-dc-sana"] in c:
            return "autoencoder-dc-f32c32-sana"
        if c[encoder][-1] == 64 and c[decoder][1] == 32:
            return "autoencoder-dc-f32c32"
        if c[encoder][-1] == 64 and c[decoder][1] == 128:
            return "autoencoder-dc-f64c128"
        return "autoencoder-dc-f128c512"
    return None


def _wan_type(c: Mapping) -> str:
    prefix = COMFY_PREFIX if f"{COMFY_PREFIX}patch_embedding.weight" in c else ""
    target = f"{prefix}patch_embedding.weight"
    if f"{prefix}{K['wan_vace']}" in c:
        size = c[target][0]
        if size in (1536, 5120):
            return "wan-vace-1.3B" if size == 1536 else "wan-vace-14B"
        raise _NoAnswer
    if f"{prefix}{K['wan_animate']}" in c:
        return "wan-animate-14B"
    if c[target][0] == 1536:
        return "wan-t2v-1.3B"
    return "wan-t2v-14B" if c[target][0] == 5120 and c[target][1] == 16 else "wan-i2v-14B"


def _cosmos_type(c: Mapping, version: str, small: int) -> str:
    shape = c[K[f"cosmos-{version}"][0]]
    kinds = {"1.0": ("t2w", "v2w"), "2.0": ("t2i", "v2w")}[version]
    if shape[1] not in (68, 72):
        raise _NoAnswer  # diffusers raises ValueError("Unexpected x_embedder shape")
    kind = kinds[0] if shape[1] == 68 else kinds[1]
    size = {"1.0": ("7B", "14B"), "2.0": ("2B", "14B")}[version][0 if shape[0] == small else 1]
    return f"cosmos-{version}-{kind}-{size}"


def _other_types(c: Mapping) -> str:
    """diffusers' branches from mochi to the end, and its fallback, "v1"."""
    if _any(c, "mochi-1-preview"):
        return "mochi-1-preview"
    if K["hunyuan-video"] in c:
        return "hunyuan-video"
    if all(key in c for key in K["auraflow"]):
        return "auraflow"
    if K["instruct-pix2pix"] in c and c[K["instruct-pix2pix"]][1] == 8:
        return "instruct-pix2pix"
    for name in ("z-image-turbo", "lumina2", "sana"):
        if _any(c, name):
            return name
    if _any(c, "wan"):
        return _wan_type(c)
    for name in ("qwen-image-2.1", "krea2"):
        if _any(c, name):
            return name
    if K["wan_vae"] in c:
        return "wan-t2v-14B"  # diffusers: every Wan model uses the same VAE, so the 14B repo's config
    if K["hidream"] in c:
        return "hidream"
    if all(key in c for key in K["cosmos-1.0"]):
        return _cosmos_type(c, "1.0", 4096)
    if all(key in c for key in K["cosmos-2.0"]):
        return _cosmos_type(c, "2.0", 2048)
    if K[Z_IMAGE_2X] in c:
        return Z_IMAGE_2X if "control_noise_refiner.0.before_proj.weight" in c else "z-image-turbo-controlnet-2.0"
    if K["z-image-turbo-controlnet"] in c:
        return "z-image-turbo-controlnet"
    if _any(c, "ltx2"):
        return "ltx2-dev"
    return "minimax-h3" if K["minimax-h3"] in c else "v1"


def infer_model_type(shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """diffusers' `infer_diffusers_model_type` on (tensor name -> shape): its answer ("v1" for anything it does not
    know), or None where diffusers raises (a shape check on a missing key or a tensor without that dimension)."""
    try:
        return _sd_types(shapes) or _dit_types(shapes) or _other_types(shapes)
    except (KeyError, IndexError, TypeError, _NoAnswer):
        return None


# --- what the file is, for inspect ---------------------------------------------------------------

# key prefix -> part (first match wins); "<denoiser>" is the model's unet/transformer; "<t5>" T5-XXL's component
_PART_PREFIXES = (
    (COMFY_PREFIX, "<denoiser>"), ("first_stage_model.", "vae"), ("vae.", "vae"),
    ("cond_stage_model.", "text_encoder"), ("conditioner.embedders.0.transformer.", "text_encoder"),
    ("conditioner.embedders.0.model.", "text_encoder_2"), ("conditioner.embedders.1.model.", "text_encoder_2"),
    ("text_encoders.clip_l.", "text_encoder"), ("text_encoders.clip_g.", "text_encoder_2"), ("text_encoders.t5xxl.", "<t5>"),
    ("model_ema.", "other"),
)
_INDEX = re.compile(r"([0-9]{1,6})\.")


@dataclass
class Part:
    name: str  # the diffusers pipeline component it is (unet, transformer, vae, text_encoder, ...) or "other"
    prefix: str  # the key prefixes it was found by, ", "-separated ("" for a bare, prefix-free denoiser)
    tensors: int = 0
    params: int = 0
    bytes: int = 0
    dtypes: dict | None = None  # dtype -> bytes

    def to_json(self, config: dict | None) -> dict:
        dtype = max(self.dtypes, key=self.dtypes.get) if self.dtypes else None
        return {"name": self.name, "prefix": self.prefix, "tensors": self.tensors, "params": self.params,
                "bytes": self.bytes, "dtype": dtype, "config": config}


def _parts(tensors: Mapping, model_type: str, denoiser: str, prefixed: bool) -> list[Part]:
    t5 = "text_encoder_3" if model_type.startswith(("sd3", "sd35")) else "text_encoder_2"
    parts: dict[str, Part] = {}
    for name, entry in tensors.items():
        prefix, part = next(((p, n) for p, n in _PART_PREFIXES if name.startswith(p)),
                            ("", "other" if prefixed else "<denoiser>"))
        part = {"<denoiser>": denoiser, "<t5>": t5}.get(part, part)
        prefix = "" if part == "other" else prefix  # the keys no part claims
        row = parts.setdefault(part, Part(part, prefix, dtypes={}))
        if prefix not in row.prefix.split(", "):
            row.prefix = ", ".join(filter(None, (row.prefix, prefix)))
        row.tensors += 1
        row.params += entry.numel
        row.bytes += entry.nbytes
        row.dtypes[entry.dtype] = row.dtypes.get(entry.dtype, 0) + entry.nbytes
    order = [denoiser, "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "other"]
    return sorted(parts.values(), key=lambda p: (order.index(p.name) if p.name in order else len(order), p.prefix))


def _count(shapes: Mapping, stem: str) -> int:
    """Blocks under `stem.N.` (diffusers: the highest index + 1); indices of over 6 digits are not counted."""
    found = [int(m.group(1)) for key in shapes if key.startswith(stem + ".")
             and (m := _INDEX.match(key, len(stem) + 1)) is not None]
    return max(found) + 1 if found else 0


def _dim(shapes: Mapping, key: str, index: int):
    shape = shapes.get(key)
    return shape[index] if shape is not None and len(shape) > abs(index) - (index < 0) else None


def _heads(config: dict) -> int | None:
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    return heads * dim if isinstance(heads, int) and isinstance(dim, int) else None


def config_checks(model_type: str, part: str, shapes: Mapping, config: dict) -> list[tuple[str, object, object]]:
    """(what, in the file, in the config) for the shapes that tell this model's sizes apart (prefix stripped)."""
    c = config
    if part == "vae":  # the Wan VAE: post_quant_conv is z_dim x z_dim
        return [("latent channels (z_dim)", _dim(shapes, "conv2.weight", 0), c.get("z_dim"))]
    if model_type.startswith("flux"):
        return [("hidden size", _dim(shapes, "img_in.weight", 0), _heads(c)),
                ("in_channels", _dim(shapes, "img_in.weight", 1), c.get("in_channels")),
                ("double blocks", _count(shapes, "double_blocks"), c.get("num_layers")),
                ("single blocks", _count(shapes, "single_blocks"), c.get("num_single_layers"))]
    if model_type == "sd3":
        return [("hidden size", _dim(shapes, "x_embedder.proj.weight", 0), _heads(c)),
                ("joint blocks", _count(shapes, "joint_blocks"), c.get("num_layers"))]
    if model_type.startswith("wan"):
        return [("hidden size", _dim(shapes, "patch_embedding.weight", 0), _heads(c)),
                ("in_channels", _dim(shapes, "patch_embedding.weight", 1), c.get("in_channels")),
                ("blocks", _count(shapes, "blocks"), c.get("num_layers"))]
    if model_type == "z-image-turbo":
        return [("hidden size", _dim(shapes, "x_embedder.weight", 0), c.get("dim")),
                ("layers", _count(shapes, "layers"), c.get("n_layers"))]
    if model_type in _LDM_TYPES:
        to_k = next((key for key in shapes if key.endswith(".attn2.to_k.weight")), None)
        channels = c.get("block_out_channels") or [None]
        return [("first block channels", _dim(shapes, "input_blocks.0.0.weight", 0), channels[0]),
                ("in_channels", _dim(shapes, "input_blocks.0.0.weight", 1), c.get("in_channels")),
                ("cross-attention dim", _dim(shapes, to_k, 1) if to_k else None, c.get("cross_attention_dim"))]
    return []


_PRESET_NAMES = {"flux2": "FLUX.2 [dev]", "flux2-klein": "FLUX.2 [klein] 4B"}  # a model type several presets share


def _layout(model_type: str, prefixed: bool) -> str:
    family = "LDM" if model_type in _LDM_TYPES else next(
        (name for stem, name in _ORIGINAL_LAYOUT.items() if model_type.startswith(stem)), None)
    layout = f"original ({family})" if family else "original"
    return layout + (", ComfyUI prefix model.diffusion_model." if prefixed and family != "LDM" else "")


def _match_preset(model_type: str, component: str, shapes: Mapping) -> tuple[str | None, object, list[dict]]:
    """The first candidate preset whose `component` config fits the file's shapes: (preset, its Source, every
    preset tried with its checks); (None, None, tried) when none fits or dmap bundles none."""
    tried: list[dict] = []
    for preset in PRESET_CANDIDATES.get(model_type, ()):
        if preset not in PRESETS:
            continue
        try:
            source = resolve_source(preset)
        except DmapError:
            continue
        comp = next((c for c in source.components if c.name == component), None)
        if comp is None or comp.config is None:
            continue
        checks = [{"what": what, "file": found, "config": wanted}
                  for what, found, wanted in config_checks(model_type, component, shapes, comp.config)]
        fits = all(row["file"] == row["config"] for row in checks)
        tried.append({"preset": preset, "fits": fits, "checks": checks})
        if fits:
            return preset, source, tried
    return None, None, tried


def _notes(model_type: str, preset: str | None, source, component: str, tried: list[dict]) -> list[str]:
    notes = []
    if model_type == "flux-dev" and "flux-kontext" in PRESETS:
        notes.append("FLUX.1 Kontext [dev] has the same keys and shapes as FLUX.1 [dev]: for a Kontext file, preset "
                     "flux-kontext's transformer config (the same config) and pipeline apply.")
    if source is not None:
        own = source.component(component)
        same = [c.name for c in source.components if c.name != component and c.cls == own.cls and c.config == own.config]
        if same:
            notes.append(f"preset {preset}'s {', '.join(same)} has the same config as its {component}.")
    for row in tried:
        if not row["fits"]:
            differ = "; ".join(f"{c['what']} {c['file'] if c['file'] is not None else 'missing'} in the file, "
                               f"{c['config']} in the config" for c in row["checks"] if c["file"] != c["config"])
            notes.append(f"not preset {row['preset']}'s {component} config: {differ}.")
    return notes


def recognize(tensors: Mapping) -> dict | None:
    """The `single_file` section of `inspect --json` for a safetensors file's tensors (name -> TensorEntry), or
    None when diffusers' single-file loader does not know the layout (the file stays a bag of tensors)."""
    shapes = {name: tuple(entry.shape) for name, entry in tensors.items()}
    model_type = infer_model_type(shapes)
    if model_type is None or (model_type == "v1" and K["v1"] not in shapes):
        return None  # "v1" is also diffusers' answer for anything it does not know
    name, component, cls, repo = MODEL_TYPES.get(model_type, (model_type, _TR, "?", None))
    if model_type == "wan-t2v-14B" and not _any(shapes, "wan"):
        name, component, cls = WAN_VAE
    prefixed = any(key.startswith(COMFY_PREFIX) for key in shapes)
    prefix = COMFY_PREFIX if prefixed else ""
    own = {key[len(prefix):]: shape for key, shape in shapes.items() if key.startswith(prefix)}
    preset, source, tried = _match_preset(model_type, component, own)
    name = _PRESET_NAMES.get(preset, name)
    layout = _layout(model_type, prefixed)
    where = (f"config from preset {preset}" if preset else
             "no bundled config" + (f" (diffusers' default: {repo})" if repo else ""))
    bundled = {c.name for c in source.components} if source is not None else set()
    parts = [part.to_json({"preset": preset, "component": part.name} if part.name in bundled else None)
             for part in _parts(tensors, model_type, component, prefixed)]
    return {
        "model_type": model_type, "model": name, "component": component, "diffusers_class": cls, "layout": layout,
        "prefix": prefix, "default_repo": repo, "preset": preset,
        "summary": f"{name} {component}, {layout} layout → diffusers {cls}, {where}",
        "config_checks": next((row["checks"] for row in tried if row["preset"] == preset), []),
        "parts": parts, "notes": _notes(model_type, preset, source, component, tried),
    }


def match_file(shapes: Mapping[str, tuple[int, ...]]):
    """(model name, pipeline component, the bundled preset's Source or None) for a single file's (name -> shape),
    as `recognize` names them, or None when diffusers' single-file loader does not know the layout."""
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    model_type = infer_model_type(shapes)
    if model_type is None or (model_type == "v1" and K["v1"] not in shapes):
        return None
    name, component, _cls, _repo = MODEL_TYPES.get(model_type, (model_type, _TR, "?", None))
    if model_type == "wan-t2v-14B" and not _any(shapes, "wan"):
        name, component, _cls = WAN_VAE
    prefix = COMFY_PREFIX if any(key.startswith(COMFY_PREFIX) for key in shapes) else ""
    own = {key[len(prefix):]: shape for key, shape in shapes.items() if key.startswith(prefix)}
    preset, source, _tried = _match_preset(model_type, component, own)
    return _PRESET_NAMES.get(preset, name), component, source

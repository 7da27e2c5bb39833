"""What CUDA kernels allocate beside their outputs: the rules the meta trace applies for a plan's GPUs.

The meta trace counts the storages ops create, which is what a CPU run holds (the CPU profiler agrees with it). A GPU
runs other kernels, and some allocate more than their output for as long as they run:

- **Attention** (`F.scaled_dot_product_attention`): PyTorch's dispatcher (aten/src/ATen/native/transformers/cuda/
  sdp_utils.cpp, `select_sdp_backend`) tries cuDNN (first on sm90/sm100 with cuDNN newer than 9.15), flash, memory
  efficient, then math. Flash needs fp16/bf16, head dims of at most 256, equal for q, k and v, and no mask; cuDNN
  needs head dims of at most 128 (256 on sm90 with a recent cuDNN), multiples of 8; the memory-efficient kernel
  takes any head dim aligned to 8 (half) or 4 (float32), masks included, on sm50 to sm121; math takes anything.
  Flash and cuDNN write a float32 log-sum-exp per query row beside the output (flash pads a head dim that is not a
  multiple of 8, copying q, k, v and its output); the memory-efficient kernel, for
  head dims over 128 in half precision (its kernel iterates over the value dim), a float32 output accumulator of the
  output's shape; math (PyTorch 2.5 and newer, which upcast half precision to float32 unless
  `allow_fp16_bf16_reduction_math_sdp`) float32 copies of q, k and v, the score matrix and its softmax.
  Flash runs a kernel built for one of eight head dims (flash_attn/static_switch.h, `HEADDIM_SWITCH`: 32, 64, 96,
  128, 160, 192, 224, 256), the smallest that holds the call's: its tiles multiply over that width, so a head dim of
  40 (SD 1.5's first blocks) costs the matmul work of 64 (`kernel_head_dim`).
- **Convolutions** (cuDNN): tensor-core kernels run on NHWC data, and "the cuDNN library may use padding, folding,
  and NCHW-to-NHWC transformations to call the Tensor Core operations" (cuDNN Developer Guide, Legacy API, Data and
  Filter Formats): for an NCHW (PyTorch's default layout) convolution in half precision its workspace holds NHWC
  copies of the input, the filter and the output.
- **The caching allocator** (c10/cuda/CUDACachingAllocator.cpp, `round_size`) hands out blocks in multiples of 512
  bytes: `torch.cuda.max_memory_allocated` counts those blocks. What it reserves beyond them (segments of 2 MiB, or
  20 MiB for requests of 1 to 10 MiB, and their fragmentation: `max_memory_reserved`) is not modelled.

These rules hold for every GPU of the profile table (compute capability 8.0 and newer); older GPUs (sm75: no bf16
in the fused kernels) would fall to math for bf16 and are not planned for. Pure: shapes in, bytes out.
"""

from __future__ import annotations

from dataclasses import dataclass

ALLOCATOR_BLOCK = 512  # bytes: the caching allocator's rounding of every block (kMinBlockSize)
HALF_DTYPES = ("float16", "bfloat16")
FLASH_MAX_HEAD_DIM = 256
CUDNN_MAX_HEAD_DIM = 128  # 256 on sm90/sm100 with cuDNN > 9.22 and a recent cudnn-frontend
EFFICIENT_SINGLE_PASS_HEAD_DIM = 128  # the memory-efficient kernel keeps the output in registers up to this head dim
FLASH_KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # the head dims flash's kernels are built for

# Compute capability of the GPUs the profile table names (NVIDIA's CUDA GPUs list).
COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "h100-sxm": (9, 0), "h100-pcie": (9, 0), "h200-sxm": (9, 0), "h200-nvl": (9, 0),
    "a100-40gb": (8, 0), "a100-80gb": (8, 0), "a10g": (8, 6), "l4": (8, 9), "l40s": (8, 9), "l20": (8, 9),
    "rtx-3090": (8, 6), "rtx-4090": (8, 9), "rtx-5090": (12, 0),
}


def allocated(nbytes: int) -> int:
    """The block the caching allocator hands out for `nbytes` (what max_memory_allocated counts)."""
    return 0 if nbytes <= 0 else -(-nbytes // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


@dataclass(frozen=True)
class AttentionCall:
    """One scaled-dot-product attention call, as the dispatcher sees it."""

    batch_heads: int  # batch x query heads
    query_len: int
    key_len: int
    head_dim: int  # of q and k
    value_dim: int
    dtype: str
    has_mask: bool = False
    is_causal: bool = False


def attention_backend(call: AttentionCall, capability: tuple[int, int] = (8, 0), prefer_cudnn: bool = False) -> str:
    """The kernel `select_sdp_backend` picks for `call` on a GPU of `capability`: "cudnn", "flash", "efficient" or
    "math". `prefer_cudnn`: cuDNN first (sm90/sm100 with cuDNN newer than 9.15, PyTorch's default there)."""
    half = call.dtype in HALF_DTYPES
    same = call.head_dim == call.value_dim
    if prefer_cudnn and half and capability >= (8, 0) and not call.has_mask \
            and max(call.head_dim, call.value_dim) <= CUDNN_MAX_HEAD_DIM and call.head_dim % 8 == 0 \
            and call.value_dim % 8 == 0 and call.key_len > 1:
        return "cudnn"
    if half and capability >= (8, 0) and same and call.head_dim <= FLASH_MAX_HEAD_DIM and not call.has_mask \
            and not (call.is_causal and call.query_len != call.key_len):
        return "flash"
    alignment = 8 if half and capability >= (8, 0) else 4
    if capability >= (5, 0) and (half or call.dtype == "float32") and call.head_dim % alignment == 0 \
            and call.value_dim % alignment == 0 and (call.dtype != "bfloat16" or capability >= (8, 0)):
        return "efficient"
    return "math"


def kernel_head_dim(call: AttentionCall, backend: str) -> int:
    """The head dim `backend`'s kernel computes over for `call`: flash's next built width, the call's own else."""
    if backend == "flash":
        return next((width for width in FLASH_KERNEL_HEAD_DIMS if width >= call.head_dim), call.head_dim)
    return call.head_dim


def attention_transient(call: AttentionCall, backend: str) -> int:
    """Bytes the kernel holds beside its output while it runs (freed when the call returns)."""
    rows = call.batch_heads * call.query_len
    if backend in ("flash", "cudnn"):
        padding = 0
        if backend == "flash" and call.head_dim % 8:  # flash pads q, k, v and its output to a multiple of 8
            width, element = -(-call.head_dim // 8) * 8, 2
            padding = 2 * allocated(rows * width * element) + 2 * allocated(
                call.batch_heads * call.key_len * width * element)
        return allocated(rows * 4) + padding  # float32 log-sum-exp (cuDNN's softmax stats) per query row
    if backend == "efficient":
        needs_accumulator = call.dtype in HALF_DTYPES and call.value_dim > EFFICIENT_SINGLE_PASS_HEAD_DIM
        return allocated(rows * call.value_dim * 4) if needs_accumulator else 0
    # math: float32 q (scaled), k, v; the scores and their softmax (both alive while softmax runs); a float32 output
    upcast = 4 if call.dtype in HALF_DTYPES else 0  # float32 inputs are not copied
    q = rows * call.head_dim
    kv = call.batch_heads * call.key_len * (call.head_dim + call.value_dim)
    scores = rows * call.key_len * 4
    return allocated(q * 4) + allocated(kv * upcast) + 2 * allocated(scores) + allocated(rows * call.value_dim * 4)


def convolution_transient(input_bytes: int, weight_bytes: int, output_bytes: int, dtype: str, dims: int,
                          channels_last: bool = False) -> int:
    """cuDNN's workspace for one convolution: NHWC copies of an NCHW input, filter and output for the tensor-core
    kernels of half precision (2-D and 3-D convolutions); nothing for float32 or data already channels-last."""
    if dtype not in HALF_DTYPES or dims < 4 or channels_last:
        return 0
    return allocated(input_bytes) + allocated(weight_bytes) + allocated(output_bytes)

"""What a GPU's kernels sustain, against the datasheet peaks of the profile table: the rates a table profile
(`dmap plan --profile table:NAME`) predicts eager steps with.

A datasheet gives the tensor cores' peak at the boost clock and the memory's peak; the kernels PyTorch runs in eager
mode reach less, by rules published with measurements:

- **Matmuls** (cuBLAS): on an H100 SXM, half-precision GEMMs of 2048³, 4096³ and 8192³ ran at 541, 726 and 750
  TFLOP/s, 55-76% of the 989 peak (waynehacking8/blackwell-tensorcore-kernels, results/bench_sm90a.csv, CUDA-event
  timed): a small matmul does not fill the GPU, and a large one runs power-limited below the boost clock. On Ampere
  and Ada GPUs cuBLAS's half-precision GEMM reaches about 92% of the peak at large sizes (an L20's 105-115 of 119.5
  TFLOP/s: DefTruth/CUDA-Learn-Notes, hgemm). Other GPUs follow the H100's curve scaled: a GPU of a fraction of the
  H100's peak fills with a matmul that fraction the size, at its architecture's large-GEMM efficiency.
- **Attention**: PyTorch's flash kernel is FlashAttention-2, which reaches "only 35% utilization on the H100"
  (FlashAttention-3, Shah et al. 2024: it uses none of Hopper's asynchronous tensor-core instructions) and 50-73% of
  the peak on an A100 in the forward pass (FlashAttention-2, Dao 2023; dmap takes the middle, 60%, for Ampere, Ada
  and consumer Blackwell, whose kernels are Ampere's).
- **Elementwise ops and weights** stream at what a STREAM triad sustains: 3,082 of an H100 80GB HBM3's 3,350 GB/s
  (92%), the fraction dmap applies to every GPU's datasheet bandwidth.

Eager PyTorch launches each op from the host while the GPU runs earlier ones: a step takes the longer of the two
(step_time.py). Pure.
"""

from __future__ import annotations

H100_PEAK_TFLOPS = 989.0
# (FLOPs of one matmul, TFLOP/s) measured for cuBLAS half precision on an H100 SXM (see the module's doc)
H100_GEMM_CURVE = ((2.0 * 2048 ** 3, 540.87), (2.0 * 4096 ** 3, 726.40), (2.0 * 8192 ** 3, 749.89))
LARGE_GEMM_EFFICIENCY = {"hopper": 749.89 / H100_PEAK_TFLOPS, "ampere": 110.0 / 119.5, "ada": 110.0 / 119.5,
                         "blackwell": 110.0 / 119.5}
FLASH_EFFICIENCY = {"hopper": 0.35, "ampere": 0.60, "ada": 0.60, "blackwell": 0.60}
STREAM_EFFICIENCY = 3081.5 / 3350.0
# float32 matmuls run on the CUDA cores: PyTorch leaves TF32 off for matmuls (torch.backends.cuda.matmul.allow_tf32
# is False by default since 1.12). Non-tensor FP32 TFLOP/s from the same datasheets and whitepapers as GPU_TABLE.
FP32_TFLOPS = {"h100-sxm": 67.0, "h100-pcie": 51.0, "h200-sxm": 67.0, "h200-nvl": 60.0, "a100-40gb": 19.5,
               "a100-80gb": 19.5, "l40s": 91.6, "l4": 30.3, "l20": 59.8, "a10g": 31.2, "rtx-3090": 35.6,
               "rtx-4090": 82.6, "rtx-5090": 104.8}
RATE_SOURCES = ("cuBLAS GEMMs on an H100 SXM (blackwell-tensorcore-kernels bench_sm90a.csv) and an L20 "
                "(CUDA-Learn-Notes hgemm); FlashAttention-2's share of the peak (FlashAttention-2 and -3 papers); "
                "a STREAM triad on an H100 80GB HBM3")


def architecture(capability: tuple[int, int]) -> str:
    """The architecture of a compute capability, as the rates above know them."""
    major, minor = capability
    if major >= 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    return "ada" if (major, minor) >= (8, 9) else "ampere"


def matmul_curve(peak_tflops: float, capability: tuple[int, int]) -> list[list[float]]:
    """[[FLOPs of one matmul, TFLOP/s], ...] for a GPU of `peak_tflops` (dense half precision)."""
    arch = architecture(capability)
    scale = LARGE_GEMM_EFFICIENCY[arch] / LARGE_GEMM_EFFICIENCY["hopper"]
    size = peak_tflops / H100_PEAK_TFLOPS
    return [[flops * size, min(peak_tflops, rate / H100_PEAK_TFLOPS * scale * peak_tflops)]
            for flops, rate in H100_GEMM_CURVE]


def attention_tflops(peak_tflops: float, capability: tuple[int, int]) -> float:
    """FlashAttention-2's sustained TFLOP/s on a GPU of `peak_tflops`."""
    return peak_tflops * FLASH_EFFICIENCY[architecture(capability)]


def stream_gbps(memory_gbps: float) -> float:
    """What elementwise kernels sustain of a datasheet bandwidth."""
    return memory_gbps * STREAM_EFFICIENCY

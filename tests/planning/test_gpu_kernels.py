"""Activations as CUDA's kernels hold them (issue 53, planning/trace/gpu_kernels.py): the attention kernel PyTorch's
dispatcher picks and what it holds beside its output, cuDNN's NHWC copies, the allocator's blocks; a GPU plan
counts them, names what sets each GPU's peak, and records the kernels in its JSON."""

import json
import tempfile

import pytest
from conftest import run_dmap

from dm_cli.planning.time.gpu_rates import architecture, attention_tflops, matmul_curve
from dm_cli.planning.trace.gpu_kernels import (
    AttentionCall,
    allocated,
    attention_backend,
    attention_transient,
    convolution_transient,
    kernel_head_dim,
)

FLUX_BLOCK = AttentionCall(24, 4608, 4608, 128, 128, "bfloat16")  # a FLUX.1 block at 1024x1024
FLUX_VAE = AttentionCall(1, 16384, 16384, 512, 512, "bfloat16")  # its VAE's mid-block: one head of 512


def test_the_dispatcher_picks_flash_for_a_transformer_and_memory_efficient_for_a_vae():
    assert attention_backend(FLUX_BLOCK) == "flash"
    assert attention_backend(FLUX_VAE) == "efficient"  # flash takes head dims up to 256
    assert attention_backend(AttentionCall(2, 77, 77, 64, 64, "float16", has_mask=True)) == "efficient"
    assert attention_backend(AttentionCall(2, 64, 64, 64, 64, "float32")) == "efficient"  # flash: half only
    assert attention_backend(AttentionCall(2, 64, 64, 1, 1, "float32")) == "math"  # a head dim not aligned to 4
    assert attention_backend(FLUX_BLOCK, (9, 0), prefer_cudnn=True) == "cudnn"
    assert attention_backend(FLUX_VAE, (9, 0), prefer_cudnn=True) == "efficient"  # cuDNN: head dims up to 128


def test_what_each_attention_kernel_holds_beside_its_output():
    assert attention_transient(FLUX_BLOCK, "flash") == 24 * 4608 * 4  # a float32 log-sum-exp per query row
    padded = AttentionCall(2, 64, 64, 1, 1, "float16")  # flash pads a head dim of 1 to 8: q, k, v and the output
    assert attention_transient(padded, "flash") == allocated(2 * 64 * 4) + 4 * allocated(2 * 64 * 8 * 2)
    assert attention_transient(FLUX_VAE, "efficient") == 16384 * 512 * 4  # its float32 output accumulator
    assert attention_transient(AttentionCall(8, 4096, 4096, 64, 64, "float16"), "efficient") == 0
    math = attention_transient(FLUX_VAE, "math")  # float32 scores and their softmax: 2 x 1 GiB, and the copies
    assert math >= 2 * 16384 * 16384 * 4


def test_flash_computes_at_the_head_dim_its_kernel_is_built_for():
    """flash_attn/static_switch.h's HEADDIM_SWITCH: 32, 64, 96, ..., 256; other kernels compute the call's own."""
    sd15 = AttentionCall(16, 4096, 4096, 40, 40, "float16")  # SD 1.5's first blocks: 320 channels over 8 heads
    assert kernel_head_dim(sd15, "flash") == 64 and kernel_head_dim(sd15, "efficient") == 40
    assert [kernel_head_dim(AttentionCall(1, 8, 8, d, d, "float16"), "flash") for d in (8, 64, 80, 128, 160, 200)] \
        == [32, 64, 96, 128, 160, 224]


def test_cudnn_holds_nhwc_copies_of_a_half_precision_convolution_only():
    assert convolution_transient(512, 64, 256, "bfloat16", 4) == 512 + 512 + 512  # each in 512-byte blocks
    assert convolution_transient(10**6, 10**4, 10**6, "float16", 5) == allocated(10**6) * 2 + allocated(10**4)
    assert convolution_transient(10**6, 10**4, 10**6, "float32", 4) == 0
    assert convolution_transient(10**6, 10**4, 10**6, "bfloat16", 4, channels_last=True) == 0
    assert convolution_transient(10**6, 10**4, 10**6, "bfloat16", 3) == 0  # a 1-D convolution: no rule
    assert allocated(1) == 512 and allocated(513) == 1024 and allocated(0) == 0


def test_sustained_rates_follow_the_published_kernels():
    """cuBLAS's measured curve on the H100, scaled for another GPU; FlashAttention-2's share by architecture."""
    h100 = matmul_curve(989.0, (9, 0))
    assert [round(rate) for _, rate in h100] == [541, 726, 750]
    a100 = matmul_curve(312.0, (8, 0))
    assert a100[-1][1] == pytest.approx(312.0 * 110 / 119.5) and a100[0][0] < h100[0][0]
    assert architecture((8, 9)) == "ada" and architecture((12, 0)) == "blackwell"
    assert attention_tflops(989.0, (9, 0)) == pytest.approx(0.35 * 989.0)


@pytest.fixture()
def cuda_rules(monkeypatch):
    monkeypatch.delenv("DMAP_KERNELS")


def plan_json(*args) -> dict:
    code, out, err = run_dmap("plan", *args, "--no-check", "--json")
    assert code == 0, err
    return json.loads(out)


def test_a_gpu_plan_counts_what_the_kernels_hold_and_says_what_sets_the_peak(cuda_rules):
    """tiny-sd15 at 64x64 in fp16: its VAE's convolutions hold NHWC copies, its UNet's flash attention pads a head
    dim of 1 to 8 (copies of q, k, v and the output); the CPU's rules (DMAP_KERNELS=cpu) count neither."""
    args = ("tiny-sd15", "-m", "0=8GB", "--height", "64", "--width", "64", "--dtype", "fp16")
    gpu = plan_json(*args)
    code, out, err = run_dmap("plan", *args, "--no-check", "--json", env={"DMAP_KERNELS": "cpu"})
    assert code == 0, err
    cpu = json.loads(out)
    for name in ("unet", "vae"):
        assert gpu["components"][name]["activation_peak_bytes"] > cpu["components"][name]["activation_peak_bytes"]
    assert gpu["kernels"]["unet"]["attention"].get("flash", 0) > 0 and "kernels" not in cpu
    decode = next(s for s in gpu["stages"] if s["name"] == "decode")
    assert decode["peak_set_by"]["component"] == "vae" and decode["attention"]
    code, text, err = run_dmap("plan", *args, "--no-check", env={"COLUMNS": "200"})
    assert "GPU 0's peak" in text and "counted as CUDA's kernels hold them at 64x64" in text


def test_a_plan_file_with_its_kernels_reads_back(cuda_rules, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run_dmap("plan", "tiny-flux", "-m", "0=8GB", "--no-check", "-o", str(path))
    assert code == 0, err
    from dm_cli.planning.plan_file import load_plan

    plan = load_plan(path)
    assert plan.kernels and plan.to_json()["kernels"] == json.loads(path.read_text())["kernels"]


def test_an_unknown_kernels_word_is_one_sentence():
    code, _, err = run_dmap("plan", "tiny-flux", "-m", "0=8GB", env={"DMAP_KERNELS": "tpu"})
    assert code == 2 and "DMAP_KERNELS" in err and "Traceback" not in err


def test_the_whole_call_is_predicted_at_the_steps_a_run_runs():
    """`pipeline_s` (encode, every step, decode) follows the run's steps as the per-image figure does."""
    from dm_cli.run.request import prediction_at

    predicted = {"steps": 28, "step_s": 0.2, "image_s": 5.6, "queue_s": 5.6, "encode_s": 0.1, "decode_s": 0.3,
                 "pipeline_s": 6.0, "queue": 1, "images_per_call": 1}
    assert prediction_at(predicted, steps=8)["pipeline_s"] == pytest.approx(0.1 + 8 * 0.2 + 0.3)


def test_a_cpu_plan_without_a_profile_keeps_its_steps_for_the_run():
    """No seconds (no profile of this CPU), but the steps `dmap run -d` runs, and one sentence saying why."""
    code, out, err = run_dmap("plan", "tiny-flux", "--steps", "8", "--no-check", "--json",
                              env={"DMAP_CACHE_DIR": tempfile.mkdtemp()})
    assert code == 0, err
    data = json.loads(out)
    assert data["predicted_time"] == {"steps": 8}
    assert any(w.startswith("No predicted time: dmap has no profile of this CPU") for w in data["warnings"])


def test_upcast_traffic_follows_each_formats_kernels():
    """fp8 layerwise casting upcasts every layer each call; bitsandbytes' NF4 GEMV on a single row reads the packed
    weight and writes no copy; torchao's int8 also scales each output."""
    from types import SimpleNamespace

    from dm_cli.model.skeleton import TensorInfo
    from dm_cli.planning.time.plan_prediction import cast_bytes

    tensors = [TensorInfo("mod.weight", (64, 32), "bfloat16", "param", low_precision=("fp8", "int8", "nf4")),
               TensorInfo("mlp.weight", (64, 32), "bfloat16", "param", low_precision=("fp8", "int8", "nf4"))]
    outputs = {"mod": 64 * 2, "mlp": 10 * 64 * 2}  # one row through `mod`, ten through `mlp`

    def moved(fmt):
        prep = SimpleNamespace(skeleton=SimpleNamespace(tensors=tensors), weights=fmt, dtype="bfloat16",
                               facts=SimpleNamespace(module_outputs=outputs))
        return cast_bytes(prep)

    copy = 64 * 32 * 2  # a layer's bf16 copy, written and read again
    assert moved("fp8") == 2 * 2 * copy
    assert moved("nf4") == 2 * copy  # `mod` runs on one row: no copy
    assert moved("int8") == 2 * 2 * copy + 2 * sum(outputs.values())
    assert moved(None) == 0

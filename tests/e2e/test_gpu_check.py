"""scripts/gpu_check.py: its CPU form runs what the GPU call runs (calibrate, predictions against the measured step,
a FLUX-shaped folder written, dmap against diffusers' own call), so that the few minutes of a lent GPU are not
spent on the script's own bugs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DMAP_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)


@pytest.mark.heavy
@pytest.mark.slow
def test_the_cpu_form_predicts_measures_and_matches_diffusers_pixels(tmp_path):
    done = _run("--device", "cpu", "--small", "--sections", "predict,flux", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "| demo-256 | " in out and "calibrated: 1 cases" in out
    assert "| dmap run (API) | " in out and "| diffusers FluxPipeline | " in out
    assert "| predicted (calibrated) | " in out
    assert "largest pixel difference 0;" in out
    assert (tmp_path / "flux-small" / "transformer" / "config.json").is_file()
    assert not (tmp_path / "flux-small.partial").exists()


def test_a_cpu_refuses_the_memory_section_in_one_sentence(tmp_path):
    done = _run("--device", "cpu", "--sections", "memory", tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("The memory section measures CUDA memory: leave it out on a CPU "
                                   "(--sections predict,flux).")


def test_an_unknown_section_is_refused(tmp_path):
    done = _run("--sections", "speed", tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "Unknown section 'speed': use memory, predict, flux, nf4, kernels, fast."


@pytest.mark.parametrize(("name", "row"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-pcie"),
    ("NVIDIA H200", "h200-sxm"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA L20", "l20"), ("NVIDIA L4", "l4"), ("NVIDIA A10G", "a10g"), ("Tesla T4", None),
])
def test_a_gpus_name_finds_its_row_of_the_bundled_table(name, row):
    from dm_cli.planning.time.profiles import table_profile

    assert gpu_check.table_row(name) == row
    if row:
        table_profile(row)  # a row the table has


@pytest.mark.heavy
@pytest.mark.slow
def test_the_kernels_section_measures_each_rule_beside_the_table_rows_model(capsys):
    """On this CPU at tiny sizes, in-process, with the H100's row as the model: every table prints its model column
    and the SD3 twin's call is timed beside a plan's predicted step."""
    import argparse

    import torch
    from gpu_check_kernels import kernels_check

    kernels_check(argparse.Namespace(device="cpu", small=True), torch, "h100-sxm")
    out = capsys.readouterr().out
    assert "model: 3 us + bytes at 3082 GB/s" in out
    assert "| 40 | " in out and "| 346 |" in out  # FlashAttention-2's 35% of the H100's 989 TFLOP/s
    assert "| SD3 qkv (8192x1536x1536) | " in out and "| - |" not in out
    assert "s a call measured, " in out and "s predicted (table:h100-sxm)" in out


@pytest.mark.heavy
@pytest.mark.slow
def test_the_fast_sections_cpu_form_runs_both_sides_and_compares_pixels(tmp_path):
    """dmap eager, compiled and offloaded against diffusers' compile_repeated_blocks and group offloading (dynamo's
    eager backend, no streams on a CPU): the same pixels wherever the computation is the same."""
    done = _run("--device", "cpu", "--small", "--sections", "fast", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for row in ("| dmap eager | ", "| dmap compiled | ", "| dmap offloaded | ", "| diffusers compile | ",
                "| diffusers group_offload | "):
        assert row in out
    assert "largest pixel difference: compiled against eager 0, offloaded against eager 0" in out

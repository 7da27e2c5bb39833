"""Issue 23 (first contact, round 2), items 5, 6, 8 and 9: what a first user met before the real answer.

5: a plan for GPUs this machine lacks was shown in full, after importing torch, before "add --simulate".
6: the first inspect/plan of qwen-image printed two [transformers] RoPE warnings.
8: a cpu-only plan that does not fit suggested "cpu=... offload" (the cpu was already the only device), and
   an absurd call (each count within bounds, their product not) was traced for seconds before being refused.
9: `shard -q` printed the whole table; `--seed -1` was silently wrapped by torch (the same image as 2**64 - 2).
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, run_dmap, run_dmap_process
from safetensors.numpy import save_file

SIMULATE_HINT = "add --simulate"


def _refuse_tracing(monkeypatch):
    import dm_cli.planning.trace.trace

    def refuse(*args, **kwargs):
        raise AssertionError("a trace ran: the absurd size should have been refused before")

    monkeypatch.setattr(dm_cli.planning.trace.trace, "trace_component", refuse)
    monkeypatch.setattr(dm_cli.planning.trace.trace, "_run", refuse)


# --- 5. a plan for GPUs this machine lacks: refused before it is shown, and without torch ---------------


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    """tiny-flux with random weights and a plan file that places it on cuda:0."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("absent-gpu")
    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "pipe", seed=0)
    plan = root / "plan.json"
    code, out, err = run_dmap("plan", folder, "-q", "-m", "cuda:0=1GB", "--overhead", "0=0", "--height", "64",
                              "--width", "64", "-o", plan)
    assert code == 0, err
    devices = {d for c in json.loads(plan.read_text())["components"].values() for d in c["device_map"].values()}
    assert devices == {0}, devices
    return folder, plan


def test_5_a_plan_for_absent_gpus_is_refused_before_it_is_shown(gpu_plan, tmp_path):
    folder, plan = gpu_plan
    code, out, err = run_dmap("run", folder, "-p", "a fox", "-d", plan, "-o", tmp_path / "x.png",
                              env={"CUDA_VISIBLE_DEVICES": ""})
    assert code == 2 and SIMULATE_HINT in err and err.count("\n") == 1, err
    assert out == "", out  # nothing of the plan
    assert not (tmp_path / "x.png").exists()


def test_5_without_a_gpu_driver_torch_is_not_imported(gpu_plan, tmp_path):
    """The count of visible GPUs is known without torch (~9 s to import) when CUDA_VISIBLE_DEVICES hides them all
    (and, on Linux, when no GPU driver is loaded)."""
    folder, plan = gpu_plan
    script = ("import sys\nfrom dm_cli.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n"
              "    code = done.code\nprint('TORCH', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", script, "run", str(folder), "-p", "a fox", "-d", str(plan),
                           "-o", str(tmp_path / "x.png")], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 2 and SIMULATE_HINT in proc.stderr, proc.stderr
    assert "TORCH False" in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout


def test_5_the_device_count_without_torch():
    import os

    from dm_cli.run.request import cuda_devices_without_torch

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for hidden in ("", " ", "-1", "-1,0"):
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
            assert cuda_devices_without_torch() == 0, hidden
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# --- 6. no [transformers] RoPE advice on the first inspect / plan of qwen-image ---------------------------


@pytest.mark.parametrize("command", [["inspect", "qwen-image", "--no-cache"],
                                     pytest.param(["plan", "qwen-image", "-m", "0=80GB", "--height", "256", "--width",
                                                   "256", "--no-check", "-q", "--no-cache"], marks=pytest.mark.heavy)])
def test_6_qwen_image_prints_no_transformers_rope_warning(command, tmp_path):
    code, out, err = run_dmap_process(*command, env={"DMAP_CACHE_DIR": str(tmp_path / "cache")})
    assert code == 0, err
    assert "[transformers]" not in err and "rope" not in err.lower(), err


def test_6_other_transformers_warnings_still_pass():
    """Only the two RoPE-standardisation messages are dropped, from their own loggers."""
    import logging

    from dm_cli.model.models import quiet_rope_config_warnings

    quiet_rope_config_warnings()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("transformers.modeling_rope_utils")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        logger.warning("Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'mrope_section'}")
        logger.warning("Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'typo_factor'}")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'typo_factor'}"]


# --- 8. suggestions that mean something; absurd sizes refused before tracing ------------------------------


def test_8_cpu_only_does_not_fit_asks_for_more_cpu_not_an_offload():
    code, out, err = run_dmap("plan", "tiny-flux", "-q", "-m", "cpu=1MB", "--height", "64", "--width", "64")
    assert code == 3, err
    assert "offload" not in err and "more on cpu (cpu=" in err, err
    assert err.count("\n") == 1, err


def test_8_gpus_without_a_cpu_still_get_the_offload_suggestion():
    code, out, err = run_dmap("plan", "tiny-flux", "-q", "-m", "0=1MB", "--overhead", "0=0", "--height", "64",
                              "--width", "64")
    assert code == 3 and "fits with cpu=" in err and "offload" in err, err


def test_8_more_cpu_than_this_machine_has_is_said(monkeypatch):
    import dm_cli.planning.refine.advice

    monkeypatch.setattr(dm_cli.planning.refine.advice, "total_ram", lambda: 1000)
    code, out, err = run_dmap("plan", "tiny-flux", "-q", "-m", "cpu=1MB", "--height", "64", "--width", "64")
    assert code == 3 and "more than this machine's 1.00 KB of RAM" in err, err


@pytest.mark.parametrize("args", [
    ["--height", "16384", "--width", "16384", "--batch-size", "64"],
    ["--height", "16384", "--width", "16384", "--num-images", "17"],
    ["--height", "100000", "--width", "100000"],
])
def test_8_absurd_sizes_are_refused_before_any_trace(monkeypatch, args):
    _refuse_tracing(monkeypatch)
    code, out, err = run_dmap("plan", "tiny-flux", "-q", "-m", "cpu=16GB", *args)
    assert code == 2 and err.count("\n") == 1, err
    assert "pixels in one call" in err or "at most 16384" in err, err


def test_8_absurd_video_is_refused_before_any_trace(monkeypatch):
    _refuse_tracing(monkeypatch)
    code, out, err = run_dmap("plan", "tiny-wan", "-q", "-m", "cpu=16GB", "--frames", "4097", "--height", "1280",
                              "--width", "1280")
    assert code == 2 and "pixels in one call" in err and err.count("\n") == 1, err


def test_8_absurd_run_is_refused_before_anything_loads(monkeypatch, tmp_path):
    import dm_cli.run.sessions.single

    def refuse(*args, **kwargs):
        raise AssertionError("the run started: the absurd size should have been refused before")

    monkeypatch.setattr(dm_cli.run.sessions.single, "run", refuse)
    code, out, err = run_dmap("run", "-p", "x", "--height", "16384", "--width", "16384", "--num-images", "17",
                              "-o", tmp_path / "x.png")
    assert code == 2 and "pixels in one call" in err, err


def test_8_the_pixel_bound_leaves_real_sizes_alone():
    from dm_cli.inputs import InputSpec

    InputSpec(16384, 16384)  # the largest image
    InputSpec(720, 1280, num_frames=4097)  # Wan at 720p, the most frames
    InputSpec(1024, 1024, batch_size=1024)


# --- 9. shard -q prints where the output went; --seed -1 is refused ------------------------------------


def test_9_shard_quiet_prints_one_line(tmp_path):
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    code, out, err = run_dmap("shard", tmp_path / "m.safetensors", "-q", "-o", tmp_path / "out")
    assert code == 0, err
    assert out == f"Wrote 1 weight file(s) into {tmp_path / 'out'}.\n", out
    assert err == "", err
    code, out, err = run_dmap("shard", tmp_path / "m.safetensors", "-q", "--dry-run", "-o", tmp_path / "dry")
    assert code == 0 and out.count("\n") == 1 and "dry run" in out and "┃" not in out, out


@pytest.mark.parametrize("seed", ["-1", str(-(2**63))])
def test_9_negative_seeds_are_refused(monkeypatch, tmp_path, seed):
    import dm_cli.run.sessions.single

    def refuse(*args, **kwargs):
        raise AssertionError("the run started: the seed should have been refused before")

    monkeypatch.setattr(dm_cli.run.sessions.single, "run", refuse)
    code, out, err = run_dmap("run", "-p", "x", "--seed", seed, "-o", tmp_path / "x.png")
    assert code == 2 and f"--seed {seed} is out of range" in err and f"from 0 to {2**64 - 1}" in err, err


def test_9_the_largest_seed_is_still_accepted():
    from dm_cli.run.entry_checks import check_seed

    assert check_seed(2**64 - 1, "--seed") == 2**64 - 1
    assert check_seed(0, "--seed") == 0

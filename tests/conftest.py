import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The tests' folders mirror the package's (cli/, planning/, run/, ...): a test may import another folder's helpers
# by module name (`from test_lora import ...`), whichever file this worker collected first.
sys.path.extend(str(folder) for folder in sorted(Path(__file__).parent.iterdir())
                if folder.is_dir() and folder.name not in {"golden", "__pycache__"})

# One torch (OpenMP) thread per test process, and so per rank and server the tests start (they inherit it): CI runs
# two workers on two cores, and two threads each leave OpenMP spinning for cores the other worker holds (a tiny FLUX
# run measured 0.6-0.9 s with one thread against 2.4-11.6 s with two, the same bytes). Set before torch is imported;
# an OMP_NUM_THREADS already given is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The property tests (hypothesis) draw the same examples on every run, so a submission's CI cannot fail on
# a draw it never saw; DMAP_TEST_RANDOM=1 explores new ones (do that when changing shard, headers or planner).
from hypothesis import settings  # noqa: E402

settings.register_profile("dmap-fixed", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dmap-random", deadline=None, print_blob=True)
settings.load_profile("dmap-random" if os.environ.get("DMAP_TEST_RANDOM") else "dmap-fixed")
PRESETS = REPO / "dm_cli" / "presets"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Each test run gets its own skeleton cache; tests never touch the user's. The xdist workers of one run share
    it (their basetemps' common parent), so a full-size model's meta trace at a shape is made once per run, not once
    per worker: entries are written to a temporary file and renamed, and the demo is generated under a lock. Set as
    DMAP_TEST_CACHE, which the fixtures that start servers and ranks read too."""
    if not os.environ.get("DMAP_TEST_CACHE"):
        base = tmp_path_factory.getbasetemp()
        shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        os.environ["DMAP_TEST_CACHE"] = str(shared / "dmap-cache")
    os.environ["DMAP_KERNELS"] = "cpu"  # module fixtures plan before the function-level one below sets it


@pytest.fixture(autouse=True)
def _isolated_cache(_session_cache, monkeypatch):
    """Every test reads and writes the run's cache (above), offline; plans count activations as the CPU that runs
    their simulated GPUs holds them (DMAP_KERNELS=cpu), except where a test asks for CUDA's rules."""
    monkeypatch.setenv("DMAP_CACHE_DIR", os.environ["DMAP_TEST_CACHE"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DMAP_KERNELS", "cpu")


def run_dmap(*args, env=None, cwd=None):
    """Run the CLI in this process (`dm_cli.cli.main`, the console entry point): exit code, stdout, stderr.

    In-process keeps the suite fast (a subprocess pays ~3-8 s of imports per call); tests about the
    process itself (imports, signals, kills) use `run_dmap_process`.
    """
    import contextlib
    import io

    from dm_cli.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue(), err.getvalue()


def wan_transformer_inputs(config):
    """A tiny Wan transformer's call, seeded: latents of 3 frames at 8x8, timestep 500, 8 text tokens."""
    import torch  # lazy: collecting the suite imports no torch here

    generator = torch.Generator().manual_seed(0)
    return (torch.randn(1, config.in_channels, 3, 8, 8, generator=generator), torch.tensor([500]),
            torch.randn(1, 8, config.text_dim, generator=generator))


def run_dmap_process(*args, env=None, cwd=None):
    """Run the real CLI in a subprocess: exit code, stdout, stderr."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "dm_cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


def load_json(path):
    return json.loads(Path(path).read_text())



# CI runs two xdist workers taking one file at a time (--dist loadfile, .ci/run): the heaviest files go first, so
# that no worker is left running a long file alone at the end (longest first). Ordered by their time in a full run
# (--durations); a file not listed runs after these, each file's own tests in their order.
HEAVIEST_FIRST = (
    "test_pipeline_run.py", "test_flux1_single_file.py", "test_gpu_check.py", "test_nf4_run.py",
    "test_pipeline_weights.py", "test_pipeline_signals.py", "test_parallel_run.py", "test_gpu_record.py",
    "test_docs_commands.py", "test_context_shapes.py", "test_queue_run.py", "test_parallel_features.py",
    "test_first_contact_checks.py", "test_compile.py", "test_inline_plan.py", "test_serve.py", "test_nf4.py",
    "test_lora.py", "test_plan_source.py", "test_serve_ranks.py", "test_first_contact_3.py",
    "test_serve_connections.py", "test_queue_ranks_features.py", "test_wan_i2v.py", "test_flux2.py",
    "test_request_adapters.py", "test_qwen_edit.py", "test_serve_cache.py", "test_readme.py",
    "test_single_file_run.py", "test_run.py", "test_weight_formats.py", "test_input_requests.py", "test_trace.py",
    "test_plan_execute.py", "test_flux2_refs.py", "test_serve_process_values.py", "test_flux_edit.py",
    "test_tiled_decode.py", "test_step_cache.py", "test_wan.py", "test_qwenimage.py", "test_interrupt_large.py",
)


def pytest_collection_modifyitems(config, items):
    order = {name: rank for rank, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep their order

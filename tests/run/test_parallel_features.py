"""Features with ranks sharing each step (`--parallel cfg|context`) under torchrun on CPU (gloo): a step cache
(`--cache`), a LoRA, fp8 or int8 weights give the latents, pixels and skip counts of one process running the same
features on the same plan.

One torchrun launch (2 ranks, one torch thread each) runs every case through `dm_cli.load(..., parallel=...)`: this
file is also the workers' script (`__main__` below). Rank 0 writes the images, the final latents and the run's
step-cache counts; the test runs the same cases here in one process on one thread. Under context parallel each rank
holds a shard of the sequence (fbc's skip decision is reduced over the shards); under CFG-parallel with separate
calls (Qwen-Image's true CFG) each rank runs one branch, its own cache context as in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT, NEGATIVE, SEED, STEPS = "a red fox in the snow", "blurry", 7, 8
FLUX = {"height": 32, "width": 32, "mode": "resident"}
QWEN = {"height": 32, "width": 32, "mode": "staged", "true_cfg_scale": 4.0, "negative_prompt": NEGATIVE}
LORA = "{lora}:0.7"  # the preset's LoRA (the `folders` fixture writes one per preset)
# name -> (preset, parallel, base load options, the feature's load options); fbc's threshold set so that the tiny
# models skip some steps; fp8 computes in float32 and int8 in bfloat16, as tests/model/test_weight_formats.py runs them
CASES = {
    "context-taylorseer": ("tiny-flux", "context", FLUX, {"cache": "taylorseer"}),
    "context-magcache": ("tiny-flux", "context", FLUX, {"cache": "magcache"}),
    "context-fbc": ("tiny-flux", "context", FLUX, {"cache": "fbc:threshold=0.3"}),
    "cfg-taylorseer": ("tiny-qwenimage", "cfg", QWEN, {"cache": "taylorseer"}),
    "cfg-fbc": ("tiny-qwenimage", "cfg", QWEN, {"cache": "fbc:threshold=0.3"}),
    "context-lora": ("tiny-flux", "context", FLUX, {"lora": [LORA]}),
    "context-fp8": ("tiny-flux", "context", {**FLUX, "dtype": "float32"}, {"weights": "fp8"}),
    "cfg-lora": ("tiny-qwenimage", "cfg", QWEN, {"lora": [LORA]}),
    "cfg-fp8": ("tiny-qwenimage", "cfg", {**QWEN, "dtype": "float32"}, {"weights": "fp8"}),
    "cfg-int8": ("tiny-qwenimage", "cfg", {**QWEN, "dtype": "bfloat16"}, {"weights": "int8"}),
}
CACHED = [case for case, (*_, feature) in CASES.items() if "cache" in feature]


def _options(folders: dict, case: str, with_feature: bool = True) -> dict:
    """dm_cli.load's options of a case (without its feature: the plain run it must differ from)."""
    preset, _, base, feature = CASES[case]
    feature = {key: [v.format(lora=folders[f"{preset}-lora"]) for v in value] if key == "lora" else value
               for key, value in feature.items()}
    return {**base, **(feature if with_feature else {})}


def _generate(folder: str, parallel: str, options: dict) -> dict:
    """Images, final latents and step-cache counts of one case."""
    import dm_cli

    with dm_cli.load(folder, parallel=parallel, **options) as session:
        out = list(session.generate(PROMPT, seed=SEED, steps=STEPS))
        counts = session.step_cache_counts()
    return {"images": [np.asarray(image) for image in out[0].images],
            "latents": out[0].latents.float().numpy(), "counts": counts,
            "fused": out[0].metadata.get("lora_fused")}


def _worker(spec: str, out: str) -> None:
    """A torchrun rank: every case of `spec` (JSON: case -> [folder, load options]), one thread, rank 0's results under `out`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case, (folder, options) in json.loads(spec).items():
        result = _generate(folder, CASES[case][1], options)
        if dist.get_rank() == 0:
            np.save(Path(out, f"{case}-images.npy"), np.stack(result["images"]))
            np.save(Path(out, f"{case}-latents.npy"), result["latents"])
            Path(out, f"{case}-counts.json").write_text(json.dumps([result["counts"], result["fused"]]))
    Path(out, f"fbc-decision-rank{dist.get_rank()}.json").write_text(json.dumps(_fbc_decision(dist.get_rank())))
    dist.destroy_process_group()


def _fbc_decision(rank: int) -> bool:
    """diffusers' own fbc head hook with agree_across on, fed shards whose own change ratios fall on either side
    of the threshold (rank 0: 0.2, rank 1: 0.9; the whole call's: (0.8 + 3.6) / 8 = 0.55 > 0.5): what it decides."""
    import torch
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
    from diffusers.hooks.hooks import CacheContext, HookRegistry, StateManager

    from dm_cli.run.hooks.step_cache import agree_across

    block = torch.nn.Linear(1, 1)
    state = StateManager(FBCSharedBlockState)
    state.set_context(CacheContext(name="cond"))
    state.get_state().head_block_residual = torch.ones(4)
    HookRegistry.check_if_exists_or_initialize(block).hooks["fbc_leader_block_hook"] = FBCHeadBlockHook(state, 0.5)
    assert agree_across(block, None) == 1  # None: the default group, both ranks
    hook = block._diffusers_hook.get_hook("fbc_leader_block_hook")
    return hook._should_compute_remaining_blocks(torch.ones(4) * (1.2 if rank == 0 else 1.9))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """preset -> its random-weight folder; "PRESET-lora" -> a LoRA of its transformer (tests/run/test_lora.py's)."""
    import diffusers
    from test_lora import make_lora

    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("features")
    classes = {"tiny-flux": (diffusers.FluxTransformer2DModel, diffusers.FluxPipeline),
               "tiny-qwenimage": (diffusers.QwenImageTransformer2DModel, diffusers.QwenImagePipeline)}
    out = {}
    for preset, (model_cls, pipeline_cls) in classes.items():
        folder = write_random_pipeline(PRESETS_DIR / preset, root / preset, seed=0)
        out[preset] = str(folder)
        out[f"{preset}-lora"] = str(make_lora(model_cls, folder / "transformer", root / f"{preset}-lora.safetensors",
                                              pipeline_cls, seed=1))
    return out


@pytest.fixture(scope="module")
def one_thread():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: CPU reductions (and so the last bit) depend on the thread count
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def launched(folders, tmp_path_factory, one_thread) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    spec = json.dumps({case: [folders[preset], _options(folders, case)] for case, (preset, *_) in CASES.items()})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, spec, str(out)], capture_output=True, text=True, env=env, cwd=out, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def plain_runs(folders, one_thread):
    """One process's run without the feature, made once per (preset, options): several cases share their plain run
    (the four FLUX ones in bfloat16, the three Qwen-Image ones), the same inputs giving the same latents."""
    runs = {}

    def plain(case: str) -> dict:
        preset = CASES[case][0]
        key = (preset, json.dumps(_options(folders, case, with_feature=False), sort_keys=True))
        if key not in runs:
            runs[key] = _generate(folders[preset], "none", _options(folders, case, with_feature=False))
        return runs[key]

    return plain


@pytest.mark.parametrize("case", list(CASES))
def test_a_feature_on_ranks_sharing_a_step_equals_one_process(launched, folders, plain_runs, case):
    """A step cache, a LoRA, fp8 or int8 weights under cfg or context: one process's latents and pixels, and with a
    cache its counts (the same calls, as many computed: the same skip decisions)."""
    preset = CASES[case][0]
    alone = _generate(folders[preset], "none", _options(folders, case))
    plain = plain_runs(case)
    assert not np.array_equal(alone["latents"], plain["latents"])  # the feature changes the result
    counts, fused = json.loads(Path(launched, f"{case}-counts.json").read_text())
    assert counts == alone["counts"] and fused == alone["fused"]
    if "lora" in case:  # the plan fuses it (the transformer whole on one device, float weights) on every rank
        assert fused == "transformer"
    if case in CACHED:
        assert next(iter(counts["counts"].values()))["skipped"] > 0, counts
    latents = np.load(launched / f"{case}-latents.npy")
    if case.startswith("cfg"):  # each rank runs one whole branch: bit for bit
        assert np.array_equal(latents, alone["latents"])
    else:  # Ulysses' all-to-all adds its own rounding: as context parallel without a cache (tests/run/test_parallel_run.py)
        assert np.abs(latents - alone["latents"]).max() < 1e-5
    assert np.array_equal(np.load(launched / f"{case}-images.npy"), np.stack(alone["images"]))


def test_fbc_ranks_holding_parts_of_a_call_decide_on_the_whole_call(launched):
    """Each shard alone would decide otherwise (rank 0 skip, rank 1 compute); reduced, both compute, as one process
    holding the whole call would (a rank skipping alone would leave the other waiting in its all-to-all)."""
    decisions = [json.loads(Path(launched, f"fbc-decision-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert decisions == [True, True]


def test_a_plan_for_context_ranks_with_a_cache_counts_the_whole_cache_on_every_rank(folders):
    """Under cfg/context each rank keeps the hooks of the whole denoiser: the one process's cache bytes, per rank
    (the pipeline's per-slice figure: test_step_cache.py::test_a_pipeline_plan_counts_each_slices_cache_on_its_rank)."""
    from conftest import run_dmap

    code, out, err = run_dmap("plan", folders["tiny-flux"], "--world-size", 2, "--parallel", "context", "--cache",
                              "taylorseer", "--height", 32, "--width", 32, "--max-memory", "0=1GB,1=1GB", "--json")
    assert code == 0, err
    cache = json.loads(out)["step_cache"]["components"]["transformer"]
    assert cache["total_bytes"] > 0
    assert {int(rank): held for rank, held in cache["ranks"].items()} == {0: cache["total_bytes"],
                                                                        1: cache["total_bytes"]}


if __name__ == "__main__":  # a torchrun rank of the `launched` fixture
    _worker(sys.argv[1], sys.argv[2])

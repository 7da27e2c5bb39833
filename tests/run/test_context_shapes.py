"""Context parallel (`--parallel context`, diffusers' Ulysses) against one process, at several shapes and rank counts.

test_parallel_run.py pins one shape (32x32, 2 ranks). Whether the ranks' image equals one process's to the bit
depends on the CPU's kernels: each rank's attention runs on its share of the heads over the whole sequence, and the
projections around it on its share of the tokens, where one process runs them whole. A matrix product of other
shapes may take another kernel, or split its reduction elsewhere, and a float32 sum's last bit moves; an AMD EPYC
moved one pixel by one level (issue 57). So the contract, stated in docs/commands.md, is a tolerance: every pixel
within 1 level of one process's, at most 1% of them off (at the same thread count, on the same machine), at every
shape and rank count tried here: 32x32, 64x48 and 128x128 on 2 ranks (tiny FLUX.1: 2 heads), 48x32 and 96x64 on 3
(tiny Qwen-Image: 3 heads). This file is also the ranks' script (`__main__` below): one torchrun launch per rank
count, each rank on one thread, rank 0 writing the images; the test runs the same cases here on one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT, SEED, STEPS = "a red fox in the snow", 7, 2
# name -> (preset, height, width, ranks)
CASES = {  # a non-square size and the largest on 2 ranks, and 3 ranks (CI's time: 32x32 and 96x64 were dropped)
    "flux-64x48": ("tiny-flux", 64, 48, 2),
    "flux-128x128": ("tiny-flux", 128, 128, 2),
    # Ulysses 3 needs image tokens (the tiny pipeline's (h / 8) x (w / 8)) a multiple of 3: 48x32 has 24
    # and its text tokens (--max-sequence-length) too
    "qwen-48x32": ("tiny-qwenimage", 48, 32, 3),
}
MAX_LEVELS, MAX_SHARE = 1, 0.01  # the stated tolerance (docs/commands.md, "Exactness")


def _generate(folder: str, case: str, parallel: str) -> np.ndarray:
    import dm_cli

    preset, height, width, _ = CASES[case]
    text = {"max_sequence_length": 24} if preset == "tiny-qwenimage" else {}
    with dm_cli.load(folder, parallel=parallel, height=height, width=width, mode="resident", **text) as session:
        out = list(session.generate(PROMPT, seed=SEED, steps=STEPS))
    images = [np.asarray(image) for item in out for image in item.images]  # rank 0 gets the images
    return np.stack(images) if images else np.zeros(0)


def _worker(spec: str, out: str) -> None:
    """A torchrun rank: every case of `spec` (JSON: case -> folder), one thread; rank 0 saves the images."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case, folder in json.loads(spec).items():
        images = _generate(folder, case, "context")
        if dist.get_rank() == 0:
            np.save(Path(out, f"{case}.npy"), images)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("context-shapes")
    presets = {preset for preset, *_ in CASES.values()}
    return {preset: str(write_random_pipeline(PRESETS_DIR / preset, root / preset, seed=0)) for preset in presets}


@pytest.fixture(scope="module")
def launched(folders, tmp_path_factory):
    """One torchrun launch per rank count: the folder holding each case's images."""
    out = tmp_path_factory.mktemp("context-ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for ranks in sorted({case[3] for case in CASES.values()}):
        spec = {name: folders[case[0]] for name, case in CASES.items() if case[3] == ranks}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(ranks), __file__, json.dumps(spec), str(out)], capture_output=True, text=True,
                              env=env, cwd=out, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def one_thread():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a CPU reduction's last bit depends on the thread count
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_is_one_process_within_the_stated_tolerance(case, launched, folders, one_thread):
    preset, height, width, ranks = CASES[case]
    alone = _generate(folders[preset], case, "none")
    shared = np.load(launched / f"{case}.npy")
    assert shared.shape == alone.shape == (1, height, width, 3)
    difference = np.abs(shared.astype(int) - alone.astype(int))
    off = float(np.mean(difference > 0))
    print(f"{case} on {ranks} ranks: largest difference {difference.max()} level(s), {off:.4%} of values off")
    assert difference.max() <= MAX_LEVELS and off <= MAX_SHARE, (difference.max(), off)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker(sys.argv[1], sys.argv[2])

"""`dmap run --parallel` under torchrun on CPU (gloo): CFG-parallel and context parallel equal to one rank.

One torchrun launch (2 ranks, one torch thread each) runs every case through `dm_cli.load(..., parallel=...)`:
this file is also the workers' script (`__main__` below). Each rank records what its denoiser saw (the batch of
every call, how many calls, whether diffusers' context parallel was on), rank 0 writes the images; the test
compares them with the same cases run here in one process on one thread. A second launch goes through the CLI
(`dmap run --parallel cfg`, and `-d PLAN.json` following a plan's `parallel`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT, NEGATIVE, SEED = "a red fox in the snow", "blurry", 7
# name -> (preset, parallel, load options, generate options); Wan: 4 steps, the expert switch after step 2
CASES = {
    "qwen-cfg": ("tiny-qwenimage", "cfg", {"height": 32, "width": 32, "mode": "staged", "true_cfg_scale": 4.0,
                                           "negative_prompt": NEGATIVE}, {"steps": 2}),
    "sdxl-cfg": ("tiny-sdxl", "cfg", {"height": 64, "width": 64, "mode": "resident"}, {"steps": 2}),
    "wan-cfg": ("tiny-wan", "cfg", {"height": 32, "width": 32, "num_frames": 9, "mode": "staged"}, {"steps": 4}),
    "flux-context": ("tiny-flux", "context", {"height": 32, "width": 32, "mode": "resident"}, {"steps": 2}),
    "wan-context": ("tiny-wan", "context", {"height": 32, "width": 32, "num_frames": 9, "mode": "resident"},
                    {"steps": 4}),
    # 4 ranks: 2 CFG branches x Ulysses 2 within each (tiny Qwen-Image's 3 heads take no Ulysses 2)
    "wan-cfg+context": ("tiny-wan", "cfg+context", {"height": 32, "width": 32, "num_frames": 9, "mode": "resident"},
                        {"steps": 4}),
}
DENOISERS = {"tiny-qwenimage": "QwenImageTransformer2DModel", "tiny-sdxl": "UNet2DConditionModel",
             "tiny-wan": "WanTransformer3DModel", "tiny-flux": "FluxTransformer2DModel"}


@contextlib.contextmanager
def _recorded_calls():
    """Every denoiser class's forward records (batch, whether context parallel is on) of each real call (not the
    planner's meta trace) while inside."""
    import diffusers

    log: list = []
    classes = {name: getattr(diffusers, name) for name in set(DENOISERS.values())}
    real = {name: cls.forward for name, cls in classes.items()}
    for name, cls in classes.items():
        def forward(self, *args, _real=real[name], **kwargs):
            main = kwargs.get("hidden_states", kwargs.get("sample", args[0] if args else None))
            if main.device.type != "meta":  # not the planner's trace
                log.append([int(main.shape[0]), getattr(self, "_parallel_config", None) is not None])
            return _real(self, *args, **kwargs)

        cls.forward = forward
    try:
        yield log
    finally:
        for name, cls in classes.items():
            cls.forward = real[name]


@contextlib.contextmanager
def _halves_in_turn():
    """UNet2DConditionModel runs a doubled batch as two batches of 1, one after the other, in this process:
    what two CFG ranks compute, without the ranks."""
    import diffusers
    import torch

    from dm_cli.run.ranks.parallel import _half

    cls = diffusers.UNet2DConditionModel
    real = cls.forward

    def forward(self, sample, *args, **kwargs):
        parts = [real(self, _half(sample, 2, b), *[_half(a, 2, b) for a in args],
                      **{k: _half(v, 2, b) for k, v in kwargs.items()}) for b in (0, 1)]
        return (torch.cat([p[0] for p in parts]),)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = real


def _generate(folder: str, case: str, parallel: str, halves: bool = False) -> tuple[list, list]:
    """(images as arrays, the denoiser calls) of one case."""
    import dm_cli

    _, _, load_options, options = CASES[case]
    with _recorded_calls() as calls, _halves_in_turn() if halves else contextlib.nullcontext(), \
            dm_cli.load(folder, parallel=parallel, **load_options) as session:
        out = list(session.generate(PROMPT, seed=SEED, **options))
    return [np.asarray(image) for image in out[0].images], calls


def _worker(spec: str, out: str) -> None:
    """A torchrun rank: every case of `spec` (JSON: case -> folder), one thread, results under `out`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # joined first: the sessions share it (and leave it to us)
    rank = dist.get_rank()
    for case, folder in json.loads(spec).items():
        images, calls = _generate(folder, case, CASES[case][1])
        Path(out, f"{case}-rank{rank}.json").write_text(json.dumps({"calls": calls, "images": len(images)}))
        if rank == 0:
            np.save(Path(out, f"{case}.npy"), np.stack(images))
    dist.destroy_process_group()


def _torchrun(args: list, tmp_path: Path, timeout: int = 600, ranks: int = 2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                           *map(str, args)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


class _Folders(dict):
    """preset -> its random-weight folder (fixed seed), written when first asked for."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, preset: str) -> str:
        from dm_cli.model.demo import write_random_pipeline
        from dm_cli.model.sources import PRESETS_DIR

        self[preset] = str(write_random_pipeline(PRESETS_DIR / preset, self.root / preset, seed=0))
        return self[preset]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="module")
def one_thread():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: CPU reductions (and so the last bit) depend on the thread count
    yield
    torch.set_num_threads(threads)


def _launch(folders, tmp_path_factory, cases, ranks: int = 2) -> Path:
    """`cases` on `ranks` ranks (one torchrun launch): the folder with each case's images and per-rank calls."""
    out = tmp_path_factory.mktemp("ranks")
    _torchrun([__file__, json.dumps({case: folders[CASES[case][0]] for case in cases}), out], out, ranks=ranks)
    return out


QUICK, WAN = ["qwen-cfg", "sdxl-cfg", "flux-context"], ["wan-cfg", "wan-context"]


def _wan_selected(request) -> bool:
    """Whether this run runs a Wan case of the launch (slow: `scripts/test` leaves them out, CI runs them)."""
    return any(getattr(item, "module", None) is request.module and any(f"[{case}]" in item.name for case in WAN)
               for item in request.session.items)


@pytest.fixture(scope="module")
def launched(folders, tmp_path_factory, one_thread, request):
    """Qwen-Image (two calls), SDXL (a doubled batch) and FLUX (context): the quick launch; with Wan 2.2 (both
    experts, CFG-parallel and context parallel) when its slow cases run too: one launch for all, not a second one
    (each launch starts two ranks that import torch and diffusers)."""
    return _launch(folders, tmp_path_factory, QUICK + (WAN if _wan_selected(request) else []))


@pytest.fixture(scope="module")
def one_process(folders, one_thread):
    """A case run here in one process (parallel none), made once per (preset, options): "wan-context" and
    "wan-cfg+context" are the same run alone."""
    runs = {}

    def run(case: str) -> tuple[list, list]:
        key = (CASES[case][0], json.dumps(CASES[case][2:], sort_keys=True))
        if key not in runs:
            runs[key] = _generate(folders[CASES[case][0]], case, "none")
        return runs[key]

    return run


def _rank_calls(out: Path, case: str, ranks: int = 2) -> list[list]:
    return [json.loads(Path(out, f"{case}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("case", ["qwen-cfg", "sdxl-cfg", pytest.param("wan-cfg", marks=pytest.mark.slow)])
def test_cfg_parallel_on_two_ranks_equals_one_rank(launched, folders, one_process, case):
    preset = CASES[case][0]
    alone, single_calls = one_process(case)
    ranks = _rank_calls(launched, case)
    assert ranks[0]["images"] == len(alone) and ranks[1]["images"] == 0  # rank 0 decodes, the other gets nothing
    shared = np.load(launched / f"{case}.npy")
    assert shared.shape == np.stack(alone).shape
    difference = np.abs(shared.astype(int) - np.stack(alone)).max()
    if preset == "tiny-sdxl":  # a doubled batch: one call per step, each rank runs a batch of 1 where alone runs 2
        assert {b for b, _ in single_calls} == {2}
        assert all([b for b, _ in r["calls"]] == [1] * len(single_calls) for r in ranks)
        # A batch of 1 takes other CPU kernels than a batch of 2 (the first op to differ is the UNet's
        # time_embedding.linear_2, a matrix-vector product where the batch of 2 is a matrix product: ~6e-8, then
        # ~7e-7 on the UNet's output), which moves some pixels by 1 level. The same halves run one after the other
        # in one process give the 2-rank image exactly: the exchange itself changes nothing.
        assert difference <= 1 and np.mean(shared != np.stack(alone)) < 0.01
        halves, _ = _generate(folders[preset], case, "none", halves=True)
        assert np.array_equal(shared, np.stack(halves))
        return
    assert difference == 0, f"largest difference {difference}"
    # two separate calls per step alone; each rank runs one of them
    assert len(single_calls) == 2 * CASES[case][3]["steps"]
    assert all(len(r["calls"]) == len(single_calls) // 2 for r in ranks)


@pytest.mark.parametrize("case", ["flux-context", pytest.param("wan-context", marks=pytest.mark.slow)])
def test_context_parallel_ulysses_2_equals_one_rank(launched, one_process, case):
    alone, single_calls = one_process(case)
    ranks = _rank_calls(launched, case)
    assert all(len(r["calls"]) == len(single_calls) and all(cp for _, cp in r["calls"]) for r in ranks)
    assert not any(cp for _, cp in single_calls)
    shared = np.load(launched / f"{case}.npy")
    assert np.array_equal(shared, np.stack(alone)), f"largest difference {np.abs(shared.astype(int) - alone).max()}"


@pytest.mark.heavy
@pytest.mark.slow
def test_cfg_and_context_together_on_four_ranks_equal_one_rank(folders, one_process, tmp_path_factory, one_thread):
    """Wan 2.2 (two calls per step, through the expert switch) on 2 x 2 ranks: each CFG pair of ranks runs one
    branch with Ulysses 2 inside it."""
    case = "wan-cfg+context"
    launched = _launch(folders, tmp_path_factory, [case], ranks=4)
    alone, single_calls = one_process(case)
    ranks = _rank_calls(launched, case, ranks=4)
    assert [r["images"] for r in ranks] == [len(alone), 0, 0, 0]  # rank 0 decodes and writes
    # alone: two calls per step; each rank joins one branch's call per step, with context parallel on
    assert len(single_calls) == 2 * CASES[case][3]["steps"] and not any(cp for _, cp in single_calls)
    assert all(len(r["calls"]) == len(single_calls) // 2 and all(cp for _, cp in r["calls"]) for r in ranks), ranks
    shared = np.load(launched / f"{case}.npy")
    difference = np.abs(shared.astype(int) - np.stack(alone)).max()
    assert difference == 0, f"largest difference {difference}"


@pytest.mark.slow
def test_cli_follows_a_plans_parallel_on_two_ranks(folders, tmp_path, one_thread):
    """`dmap plan --world-size 2 --parallel cfg -o PLAN.json`, then `dmap run -d PLAN.json` under torchrun on a
    machine without GPUs (each rank's CPU stands for its GPU of the plan, as a pipeline's do: no --simulate needed):
    CFG-parallel as the plan records, rank 0 alone reports and writes."""
    from conftest import run_dmap
    from PIL import Image

    folder = folders["tiny-qwenimage"]
    common = ["--negative-prompt", NEGATIVE, "--true-cfg-scale", 4, "--height", 32, "--width", 32]
    run = ["--prompt", PROMPT, "--seed", SEED, "--steps", 2, "--mode", "staged", *common]
    code, _, err = run_dmap("run", folder, *run, "--output", tmp_path / "alone.png", "--quiet")
    assert code == 0, err
    code, _, err = run_dmap("plan", folder, *common, "--max-memory", "0=1GB,1=1GB,cpu=4GB", "--world-size", 2,
                            "--parallel", "cfg", "--output", tmp_path / "plan.json")
    assert code == 0, err
    assert json.loads((tmp_path / "plan.json").read_text())["parallel"]["layout"] == "cfg"
    stdout = _torchrun(["-m", "dm_cli", "run", folder, *run, "--output", "plan.png", "-d", "plan.json", "--json"],
                       tmp_path)
    result = json.loads(stdout)  # rank 0 alone reports
    assert result["images"] == ["plan.png"]
    assert any("CFG-parallel (2 branches) over 2 torchrun ranks" in n for n in result["notices"]), result["notices"]
    assert np.array_equal(np.array(Image.open(tmp_path / "plan.png")), np.array(Image.open(tmp_path / "alone.png")))


# --- refusals (one process, no launch) ---------------------------------------------------------------


def test_parallel_refusals_are_one_sentence(folders, tmp_path):
    from conftest import run_dmap

    common = ["--steps", 1, "--height", 64, "--width", 64, "--output", tmp_path / "x.png"]
    code, _, err = run_dmap("run", folders["tiny-sdxl"], "--prompt", PROMPT, "--parallel", "cfg", *common)
    assert code == 2 and "--parallel cfg shares each step among torchrun ranks and this is one process" in err, err
    (tmp_path / "q.txt").write_text("a\nb\n")
    code, _, err = run_dmap("run", folders["tiny-sdxl"], "--prompts", tmp_path / "q.txt", "--parallel", "cfg")
    assert code == 2 and "with --prompts the ranks already share the queue" in err and "Traceback" not in err, err
    code, _, err = run_dmap("run", folders["tiny-sdxl"], "--prompt", PROMPT, "--parallel", "sideways", *common)
    assert code == 2 and "--parallel must be none, cfg, context, cfg+context, pipeline or auto, not 'sideways'" in err, err


@pytest.mark.parametrize("preset,choice,message", [
    ("tiny-flux", "cfg", "is guidance-distilled"),
    ("tiny-sdxl", "context", "UNet2DConditionModel has no _cp_plan"),
    ("tiny-qwenimage", "cfg", r"runs its second \(true CFG\) call only with --negative-prompt"),
])
def test_layouts_a_pipeline_cannot_run_are_refused_before_loading(folders, preset, choice, message):
    from dm_cli.errors import UsageError
    from dm_cli.run.distributed import Ranks
    from dm_cli.run.settle.layout import step_sharing

    run = _settled(folders[preset])
    with pytest.raises(UsageError, match=message):
        step_sharing(choice, None, *run, Ranks(0, 2))
    if preset == "tiny-qwenimage":  # no negative prompt, and 3 heads: neither layout runs on 2 ranks
        with pytest.raises(UsageError, match="auto finds no layout for 2 ranks: .* does not divide .* 3 attention heads"):
            step_sharing("auto", None, *run, Ranks(1, 2))
        return
    auto, notices = step_sharing("auto", None, *run, Ranks(1, 2))
    assert "Each denoising step is shared" in notices[0]
    assert auto.layout == {"tiny-flux": "context", "tiny-sdxl": "cfg"}[preset]


def test_a_plans_parallel_is_followed_only_with_its_world_size(folders):
    from types import SimpleNamespace

    from dm_cli.errors import UsageError
    from dm_cli.run.distributed import Ranks
    from dm_cli.run.settle.layout import step_sharing

    run = _settled(folders["tiny-sdxl"])
    plan = SimpleNamespace(parallel=SimpleNamespace(layout="cfg", world_size=2, title="CFG-parallel (2 branches)"))
    sharing, notices = step_sharing(None, plan, *run, Ranks())
    assert sharing is None and "launch with torchrun --nproc-per-node 2 to share" in notices[-1]
    with pytest.raises(UsageError, match="torchrun started 4: launch with --nproc-per-node 2"):
        step_sharing(None, plan, *run, Ranks(0, 4))
    sharing, _ = step_sharing(None, plan, *run, Ranks(1, 2))
    assert (sharing.layout, sharing.cfg, sharing.branch, sharing.is_main) == ("cfg", 2, 1, False)
    assert step_sharing("none", plan, *run, Ranks(1, 2)) == (None, ())


def _settled(folder: str):
    """What step_sharing reads of a run (source, family, settled generation), without loading anything."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.settle.checks import prepare, settle_generation

    request = RunRequest.of(folder, PROMPT, height=64, width=64)
    source, family, _, defaults, _ = prepare(request)
    return source, family, settle_generation(request.generation, source, family, defaults)


if __name__ == "__main__":  # a torchrun rank of the `launched` fixture
    _worker(sys.argv[1], sys.argv[2])

"""`--parallel pipeline` under torchrun on CPU (gloo; each rank's CPU stands for GPU r of the plan): a queue on 2 ranks
and one prompt on 3 give the same bytes as one process running the same plan, a deleted output is redone alone, and
a killed rank stops the others with one sentence, nothing half-written, and the same command resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_dmap
from pipeline_launch import PROMPTS, dmap_inline, json_results, launch_env, pipeline_plan, same_files, torchrun
from test_queue_run import _rank_pid  # the torchrun worker with RANK=r, read from /proc


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """tiny-flux (1 double + 1 single block) and a twin with 2 + 2 blocks, random weights (fixed seed)."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    root = tmp_path_factory.mktemp("pipeline")
    two = write_random_pipeline(PRESETS_DIR / "tiny-flux", root / "tiny-flux", seed=0)
    configs = root / "configs"
    shutil.copytree(PRESETS_DIR / "tiny-flux", configs)
    config = json.loads((configs / "transformer" / "config.json").read_text())
    (configs / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 2, "num_single_layers": 2}))
    four = write_random_pipeline(configs, root / "tiny-flux-4", seed=0)
    (root / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n")
    (root / "four.txt").write_text("\n".join(PROMPTS) + "\n")
    return root, two, four


@pytest.fixture(scope="module")
def two_plan(models) -> Path:
    """tiny-flux's 2-rank pipeline plan (the queue's and the killed rank's)."""
    root, model, _ = models
    return pipeline_plan(root, model, 2, "two.json")


@pytest.fixture(scope="module")
def four_single(models, two_plan) -> Path:
    """One process running the 2-rank plan (its GPUs simulated on the CPU) on the 4 prompts, 3 steps: the reference
    of both the queue's 3 prompts (a queue item's bytes do not depend on the items after it) and the killed rank's 4."""
    root, model, _ = models
    dmap_inline("run", model, "-d", two_plan, "--simulate", "--prompts", root / "four.txt", "--output",
                root / "four-single", "--steps", 3, cwd=root)
    return root / "four-single"


def test_a_queue_on_two_ranks_is_one_process_byte_for_byte_and_resumes(models, two_plan, four_single):
    root, model, _ = models
    plan = two_plan
    output = torchrun(2, "run", model, "-d", plan, "--prompts", root / "prompts.txt", "--output", root / "piped",
                       "--steps", 3, cwd=root)
    assert "cut into 2 slices" in output
    # one process running the same plan (its GPUs simulated on the CPU): the same bytes, metadata included
    names = [f"{i:05d}.png" for i in range(3)]
    same_files(root / "piped", four_single, names)
    records = [json.loads(line) for line in (root / "piped" / "manifest.jsonl").read_text().splitlines()]
    assert [r["item"] for r in records] == [0, 1, 2] and {r["rank"] for r in records} == {0}
    assert not list((root / "piped").glob("manifest-rank1*"))  # rank 1 wrote nothing: rank 0 holds every record

    (root / "piped" / names[1]).unlink()
    stamps = {n: (root / "piped" / n).stat().st_mtime_ns for n in (names[0], names[2])}
    torchrun(2, "run", model, "-d", plan, "--prompts", root / "prompts.txt", "--output", root / "piped",
             "--steps", 3, cwd=root)
    assert all((root / "piped" / n).stat().st_mtime_ns == stamp for n, stamp in stamps.items())
    same_files(root / "piped", four_single, names)
    records = [json.loads(line) for line in (root / "piped" / "manifest.jsonl").read_text().splitlines()]
    assert [r["item"] for r in records] == [0, 1, 2] and all(r["seconds"] is not None for r in records)


def test_one_prompt_on_three_ranks_planned_inline_is_the_plan_files_bytes(models):
    root, _, model = models
    plan = pipeline_plan(root, model, 3, "three.json")
    slices = json.loads(plan.read_text())["parallel"]["slices"]
    assert sorted(slices) == ["0", "1", "2"] and all(slices.values())  # 3 non-empty slices of the 4 blocks
    assert sum(len(part) for part in slices.values()) == 4
    torchrun(3, "run", model, "--parallel", "pipeline", "--max-memory", "0=1GB,1=1GB,2=1GB", "--height", 64,
             "--width", 64, "--prompt", PROMPTS[0], "--steps", 2, "--output", root / "inline.png", cwd=root)
    dmap_inline("run", model, "-d", plan, "--simulate", "--prompt", PROMPTS[0], "--steps", 2, "--output",
                root / "single.png", cwd=root)
    assert (root / "inline.png").read_bytes() == (root / "single.png").read_bytes()


def test_pipeline_refusals_are_one_sentence(models):
    root, model, _ = models
    code, _, err = run_dmap("run", model, "--parallel", "pipeline", "--prompt", "x", "--output", root / "x.png",
                            cwd=root)
    assert code == 2 and "this is one process" in err and "Traceback" not in err
    plain = root / "plain.json"
    dmap_inline("plan", model, "--max-memory", "0=1GB,1=1GB", "--height", 64, "--width", 64, "-o", plain, cwd=root)
    output = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "dm_cli", "run", str(model), "-d", str(plain), "--parallel", "pipeline", "--prompt",
                             "x", "--output", str(root / "x.png")], capture_output=True, text=True, env=launch_env(),
                            cwd=root, timeout=600)
    assert output.returncode != 0
    assert "dmap plan --world-size 2 --parallel pipeline" in output.stdout + output.stderr


@pytest.mark.heavy
def test_cfg_branches_travel_as_micro_batches_with_one_process_bytes(tmp_path):
    """Qwen-Image's true CFG (two calls per step): each step's cond and uncond calls go through the slices as two
    micro-batches, for one prompt and for a queue, and the images are one process's bytes."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    model = write_random_pipeline(PRESETS_DIR / "tiny-qwenimage", tmp_path / "tiny-qwenimage", seed=0)
    cfg = ["--negative-prompt", "blurry, dark"]
    plan = pipeline_plan(tmp_path, model, 2, "qwen.json", *cfg)
    (tmp_path / "queue.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    output = torchrun(2, "run", model, "-d", plan, "--prompts", tmp_path / "queue.txt", *cfg, "--output",
                      tmp_path / "piped", "--steps", 4, "--json", cwd=tmp_path)
    notices = [n for result in json_results(output) for n in result.get("notices", [])]
    assert any("two CFG calls (cond, uncond) ran as two micro-batches" in n for n in notices), notices
    dmap_inline("run", model, "-d", plan, "--simulate", "--prompts", tmp_path / "queue.txt", *cfg, "--output",
                tmp_path / "single", "--steps", 4, cwd=tmp_path)
    same_files(tmp_path / "piped", tmp_path / "single", ["00000.png", "00001.png"])
    output = torchrun(2, "run", model, "-d", plan, "--prompt", PROMPTS[0], *cfg, "--seed", 5, "--steps", 3,
                      "--output", tmp_path / "one.png", "--json", cwd=tmp_path)
    assert any("micro-batches" in n for result in json_results(output) for n in result.get("notices", []))
    dmap_inline("run", model, "-d", plan, "--simulate", "--prompt", PROMPTS[0], *cfg, "--seed", 5, "--steps", 3,
                "--output", tmp_path / "one-single.png", cwd=tmp_path)
    assert (tmp_path / "one.png").read_bytes() == (tmp_path / "one-single.png").read_bytes()


@pytest.mark.heavy
@pytest.mark.slow
def test_a_killed_rank_stops_the_others_and_the_same_command_resumes(models, two_plan, four_single):
    root, model, _ = models
    plan = two_plan
    out = root / "killed"
    args = ("run", model, "-d", plan, "--prompts", root / "four.txt", "--output", out, "--steps", 3, "--chunk-size", 2)
    proc = torchrun(2, *args, cwd=root, wait=False, DMAP_DIST_TIMEOUT="30")
    deadline = time.time() + 600
    victim = None
    while victim is None:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        victim = _rank_pid(proc.pid, 1) or time.sleep(0.05)
    while not (out / "00001.png").exists():  # the first chunk written: the second one is in flight
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - killed < 60, output[-4000:]
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name or p.name.startswith(".")], sorted(out.iterdir())
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*.png")}
    assert {"00000.png", "00001.png"} <= set(done) and len(done) < 4, sorted(done)

    torchrun(2, *args, cwd=root)
    assert all((out / name).stat().st_mtime_ns == stamp for name, stamp in done.items())
    same_files(out, four_single, [f"{i:05d}.png" for i in range(4)])
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of the killed launch is left running


@pytest.mark.parametrize("cache", ["fbc:threshold=0.3",
                                   pytest.param("magcache:threshold=0.5", marks=[pytest.mark.slow, pytest.mark.heavy]),
                                   pytest.param("taylorseer", marks=[pytest.mark.slow, pytest.mark.heavy])])
def test_a_queue_with_a_step_cache_on_two_ranks_is_one_process_byte_for_byte(models, cache):
    """Each slice's hook state on its rank, one state per prompt in flight (3 prompts, 2 in flight): fbc's and
    magcache's decision made on rank 0 travels with the activations, so both ranks skip the calls one process
    skips, and the images are one process's bytes running the same plan with the same cache."""
    root, _, model = models
    name = cache.partition(":")[0]
    plan = pipeline_plan(root, model, 2, f"{name}.json", "--cache", cache)
    output = torchrun(2, "run", model, "-d", plan, "--prompts", root / "prompts.txt", "--output", root / f"{name}-piped",
                      "--steps", 8, "--json", cwd=root)
    counts = [result["step_cache"]["counts"]["transformer"] for result in json_results(output) if "step_cache" in result]
    single = json.loads(dmap_inline("run", model, "-d", plan, "--simulate", "--prompts", root / "prompts.txt",
                                    "--output", root / f"{name}-single", "--steps", 8, "--json", cwd=root))
    assert len(counts) == 2 and all(c == single["step_cache"]["counts"]["transformer"] for c in counts), counts
    assert counts[0]["skipped"] > 0 and counts[0]["calls"] == 3 * 8
    same_files(root / f"{name}-piped", root / f"{name}-single", [f"{i:05d}.png" for i in range(3)])

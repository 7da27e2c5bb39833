"""`dmap run --prompts` and the Python API on the demo pipeline: stage-major loads, same pixels, resume, torchrun.

The references are 6 single-prompt `dmap run` calls; the queue must write the same pixels whatever
the chunking, the world size or the number of (simulated) nodes.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red fox", "a blue whale", "a green tree", "a yellow sun", "a black cat", "a white dog"]
SIZE, STEPS, SEED = 64, 2, 3
RUN_ARGS = ["--height", str(SIZE), "--width", str(SIZE), "--steps", str(STEPS), "--seed", str(SEED), "--mode", "staged"]
COMPONENTS = {"text_encoder", "text_encoder_2", "transformer", "vae"}


def _cache_dir(tmp_path_factory) -> str:
    return os.environ.get("DMAP_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dmap-cache")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Item i of the queue run alone: `dmap run --prompt P_i --seed SEED+i` (staged, like the queue)."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    folder = tmp_path_factory.mktemp("single")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DMAP_CACHE_DIR", _cache_dir(tmp_path_factory))
        patch.setenv("HF_HUB_OFFLINE", "1")
        for i, prompt in enumerate(PROMPTS):
            run(RunRequest.of(source=None, prompt=prompt, seed=SEED + i, steps=STEPS, height=SIZE, width=SIZE,
                           mode="staged", output=str(folder / f"{i}.png")))
    return [_pixels(folder / f"{i}.png") for i in range(len(PROMPTS))]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _pixels(path):
    from PIL import Image

    with Image.open(path) as image:
        return np.array(image)


def _cli(*args):
    """The real CLI entry point, in-process: (exit code, stdout, stderr) via capsys by the caller."""
    from dm_cli.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as done:
        return done.code or 0
    return 0


def _manifest(folder):
    return [json.loads(line) for line in (Path(folder) / "manifest.jsonl").read_text().splitlines()]


def _assert_queue_output(folder, references):
    for i, expected in enumerate(references):
        assert np.array_equal(_pixels(Path(folder) / f"{i:05d}.png"), expected), f"item {i} differs from its single run"
    records = _manifest(folder)
    assert [r["item"] for r in records] == list(range(len(PROMPTS)))
    assert [(r["prompt"], r["seed"], r["file"]) for r in records] == [
        (p, SEED + i, f"{i:05d}.png") for i, p in enumerate(PROMPTS)]
    assert all(len(r["plan_digest"]) == 16 for r in records)  # inline plans differ run to run (free RAM)
    assert not list(Path(folder).glob("manifest-rank*")) and not list(Path(folder).glob(".*.tmp"))
    return records


@pytest.fixture
def count_loads(monkeypatch):
    import dm_cli.run.loops.stages as stages

    counts = Counter()
    real = stages.load_component

    def counting(comp, *args, **kwargs):
        counts[comp.name] += 1
        return real(comp, *args, **kwargs)

    monkeypatch.setattr(stages, "load_component", counting)
    return counts


def test_staged_queue_loads_each_component_once_per_chunk_same_pixels_and_resumes(
        references, prompts_file, tmp_path, count_loads, capsys):
    out = tmp_path / "out"
    assert _cli("run", "--prompts", prompts_file, "--output", out, *RUN_ARGS) == 0, capsys.readouterr().err
    assert dict(count_loads) == dict.fromkeys(COMPONENTS, 1)  # one chunk: every component loaded once
    stdout = capsys.readouterr().out
    assert "Chunk size: 6 item(s)" in stdout and "budget" in stdout
    assert re.search(r"Each stage loads its components once per chunk: encode \(text_encoder, text_encoder_2\) "
                     r"loaded once \((?:under )?[0-9.]+ s\)(, ran (?:under )?[0-9.]+ s)?; denoise \(transformer\) loaded once", stdout), stdout
    first = _assert_queue_output(out, references)
    assert all(r["rank"] == 0 and r["seconds"] > 0 and not r.get("resumed") for r in first)

    chunked = tmp_path / "chunked"
    count_loads.clear()
    assert _cli("run", "--prompts", prompts_file, "--output", chunked, "--chunk-size", 4, "--json", *RUN_ARGS) == 0
    assert dict(count_loads) == dict.fromkeys(COMPONENTS, 2)  # chunks of 4 and 2: twice each
    stages = {s["name"]: s for s in json.loads(capsys.readouterr().out)["stages"]}  # a list, as run's (version 2)
    assert {name: t["loads"] for name, t in stages.items()} == {"encode": 2, "denoise": 2, "decode": 2}
    assert all(t["load_s"] > 0 and t["run_s"] > 0 for t in stages.values())
    _assert_queue_output(chunked, references)

    # the same command again: everything is complete, nothing loads; a damaged file is redone alone
    count_loads.clear()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    damaged = out / "00004.png"
    damaged.write_bytes(damaged.read_bytes()[:100])
    capsys.readouterr()
    assert _cli("run", "--prompts", prompts_file, "--output", out, *RUN_ARGS) == 0
    stdout = capsys.readouterr().out
    assert "Skipping 5 item(s)" in stdout and "0-3, 5" in stdout and "Item 4: the existing file is unreadable" in stdout
    assert dict(count_loads) == dict.fromkeys(COMPONENTS, 1)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    assert {n for n in before if before[n] != after[n]} == {"00004.png"}
    records = _assert_queue_output(out, references)
    assert records[:4] == first[:4] and records[4]["seconds"] != first[4]["seconds"]  # skipped items keep their record


def test_resident_queue_loads_once_for_the_whole_queue(references, prompts_file, tmp_path, count_loads, capsys):
    out = tmp_path / "out"
    args = [a for a in RUN_ARGS if a not in ("--mode", "staged")]
    assert _cli("run", "--prompts", prompts_file, "--output", out, "--mode", "resident", "--json", *args) == 0
    assert dict(count_loads) == dict.fromkeys(COMPONENTS, 1)
    stages = {s["name"]: s for s in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["load"]["loads"] == 1 and all(stages[s]["loads"] == 0 for s in ("encode", "denoise", "decode"))
    _assert_queue_output(out, references)


def test_queue_takes_weights_like_a_single_run(tmp_path, capsys):
    """--weights fp8 with --prompts plans fp8 storage (it was silently dropped) and matches single fp8 runs."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.single import run

    queue = tmp_path / "two.txt"
    queue.write_text("\n".join(PROMPTS[:2]) + "\n")
    out = tmp_path / "fp8"
    assert _cli("run", "--prompts", queue, "--output", out, "--weights", "fp8", "--json", *RUN_ARGS) == 0
    assert json.loads(capsys.readouterr().out)["generated"] == [0, 1]
    for i, prompt in enumerate(PROMPTS[:2]):
        single = run(RunRequest.of(source=None, prompt=prompt, seed=SEED + i, steps=STEPS, height=SIZE, width=SIZE,
                                mode="staged", weights="fp8", output=str(tmp_path / f"single-{i}.png")))
        assert single.plan.weights.get("transformer") == "fp8"
        assert np.array_equal(_pixels(out / f"{i:05d}.png"), _pixels(tmp_path / f"single-{i}.png"))
    import dm_cli

    with dm_cli.load(None, None, mode="staged", height=SIZE, width=SIZE, weights="fp8") as pipe:
        assert pipe.plan.weights.get("transformer") == "fp8"


def test_jsonl_items_and_bad_queues(references, tmp_path, capsys):
    lines = [{"prompt": PROMPTS[1], "seed": SEED + 1, "output": "whale"}, {"prompt": PROMPTS[0], "seed": SEED}]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "out"
    assert _cli("run", "--prompts", path, "--output", out, *RUN_ARGS) == 0
    assert np.array_equal(_pixels(out / "whale.png"), references[1])
    assert np.array_equal(_pixels(out / "00001.png"), references[0])
    assert [r["file"] for r in _manifest(out)] == ["whale.png", "00001.png"]
    capsys.readouterr()
    path.write_text('{"prompt": "a", "seed": "x"}')
    assert _cli("run", "--prompts", path, "--output", out, *RUN_ARGS) == 2
    err = capsys.readouterr().err
    assert "line 1: 'seed' must be an integer" in err and "Traceback" not in err
    assert _cli("run", "--prompts", path, "--prompt", "a fox") == 2
    assert "Both --prompt and --prompts given" in capsys.readouterr().err
    path = tmp_path / "q.txt"  # --true-cfg-scale reaches the family (the demo is FLUX: refused by it)
    path.write_text(PROMPTS[0] + "\n")
    assert _cli("run", "--prompts", path, "--output", out, "--true-cfg-scale", "2", *RUN_ARGS) == 2
    assert "--true-cfg-scale is for true-CFG pipelines such as Qwen-Image" in capsys.readouterr().err
    assert _cli("run", "--prompts", path, "--output", out, "--track-activations", *RUN_ARGS) == 2
    assert "are for one prompt, not --prompts" in capsys.readouterr().err


def test_readme_api_example_runs(references, tmp_path, monkeypatch):
    """The README's Python API example, as written there, on the demo pipeline."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"### Python API.*?```python\n(.*?)```", text, re.S)
    assert block, "README has no Python API example"
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert written, "the example wrote no image"


def test_api_generate_is_stage_major_and_reusable(references, count_loads):
    import dm_cli

    plan = dm_cli.plan(None, height=SIZE, width=SIZE, mode="staged")
    assert plan.mode == "staged" and plan.source == "demo"
    with dm_cli.load(None, plan) as pipe:
        outs = list(pipe.generate(PROMPTS[:3], seed=SEED, steps=STEPS))
        assert dict(count_loads) == dict.fromkeys(COMPONENTS, 1)
        more = list(pipe.generate(PROMPTS[3:], seed=SEED + 3, steps=STEPS, chunk_size=2))
    assert dict(count_loads) == dict.fromkeys(COMPONENTS, 3)
    for i, out in enumerate(outs + more):
        assert np.array_equal(np.array(out.image), references[i])
        assert out.metadata["seed"] == str(SEED + i) and out.metadata["prompt"] == PROMPTS[i]
    assert sorted(dm_cli.__all__) == ["__version__", "dispatch", "load", "plan"]
    import dm_cli.api
    import dm_cli.planning.make  # importing every module leaves the API names the API's functions

    assert (dm_cli.plan, dm_cli.load, dm_cli.dispatch) == (dm_cli.api.plan, dm_cli.api.load, dm_cli.api.dispatch)


def test_api_dispatch_places_an_existing_pipeline(references, tmp_path):
    import diffusers

    import dm_cli
    from dm_cli.errors import UsageError
    from dm_cli.model.demo import ensure_demo

    folder = ensure_demo()
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    plan = dm_cli.plan(str(folder), height=SIZE, width=SIZE, mode="resident")
    assert dm_cli.dispatch(pipe, plan) is pipe
    image = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(SEED), num_inference_steps=STEPS, height=SIZE,
                 width=SIZE, guidance_scale=3.5, max_sequence_length=64).images[0]
    assert np.array_equal(np.array(image), references[0])
    gpu_plan = dm_cli.plan(str(folder), height=SIZE, width=SIZE, max_memory="0=1GB,cpu=1GB", overhead="0=0")
    with pytest.raises(UsageError, match="GPU 0 but this machine has 0"):
        dm_cli.dispatch(pipe, gpu_plan)
    pipe.vae = None
    with pytest.raises(UsageError, match="no such model component"):
        dm_cli.dispatch(pipe, plan)


# --- torchrun (subprocesses: few and small) ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(*launch, prompts, out, extra=(), wait=True):
    command = [sys.executable, "-m", "torch.distributed.run", *map(str, launch), "-m", "dm_cli", "run",
               "--prompts", str(prompts), "--output", str(out), *RUN_ARGS, *map(str, extra)]
    # as many torch threads as the references had: CPU reductions (and so the last bit) depend on it
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    if not wait:
        return proc
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The worker process torchrun started with RANK=rank (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.heavy
def test_torchrun_killed_rank_then_a_rerun_on_two_nodes_completes_only_the_missing(references, prompts_file,
                                                                                    tmp_path):
    """2 ranks on CPU (gloo): rank 1 is killed after its first image; the same queue, launched again as two torchrun
    invocations with --nnodes 2 (c10d rendezvous on 127.0.0.1, one rank each), finishes the rest: rank 1, now the
    second node's, makes rank 1's missing items and rank 0 merges both ranks' records (one launch for what were two
    tests, the rerun and a two-node queue: the items' ranks are the same for both launches)."""
    out = tmp_path / "out"
    proc = _torchrun("--standalone", "--nproc-per-node", 2, prompts=prompts_file, out=out, extra=("--chunk-size", 1),
                     wait=False)
    deadline = time.time() + 600
    # rank 1's process is found before it can finish anything, so the kill follows its first record by one poll
    # however loaded the machine is (finding it after the record let a slow /proc scan see items 3 and 5 done)
    victim = None
    while victim is None:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        victim = _rank_pid(proc.pid, 1) or time.sleep(0.05)
    rank_1_manifest = out / "manifest-rank1.jsonl"
    # rank 1's first item, image and record both (the PNG is renamed into place just before the record is
    # appended: a kill between the two leaves a complete PNG whose record the rerun marks resumed)
    while not (rank_1_manifest.exists() and '"item": 1' in rank_1_manifest.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, output
    done_before = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*.png")}
    assert "00001.png" in done_before and not {"00003.png", "00005.png"} <= set(done_before), sorted(done_before)
    assert not (out / "manifest.jsonl").exists()  # rank 0 never got to merge

    port = _free_port()
    common = ("--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "dmap-test")
    nodes = [_torchrun(*common, "--node-rank", rank, prompts=prompts_file, out=out, wait=False) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*.png")}
    assert all(after[name] == stamp for name, stamp in done_before.items())  # nothing complete was redone
    assert len(after) == 6
    records = _assert_queue_output(out, references)
    assert [r["rank"] for r in records] == [0, 1, 0, 1, 0, 1]  # three items each: sorted, [0, 0, 0, 1, 1, 1]
    assert records[1]["seconds"] is not None  # item 1's record survived the kill (rank 1's manifest)

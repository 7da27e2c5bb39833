"""One settled run (dm_cli.run.settle.settle): each check of a run runs once, the plan file is read once, and the Session
acts on a frozen SettledRun that records the stage loop chosen."""

import dataclasses
import shutil

import pytest
from conftest import run_dmap

SIZE = ("--height", "64", "--width", "64")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    """tiny-flux with random weights, written once; each test copies it into its own folder as ./flux."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    return write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path_factory.mktemp("settle") / "flux", seed=0)


@pytest.fixture
def work(pipe, tmp_path):
    shutil.copytree(pipe, tmp_path / "flux")
    return tmp_path


def _counted(monkeypatch, module, name: str) -> list:
    """Count the calls of `module.name` (looked up at call time by the code that uses it)."""
    import importlib

    target = importlib.import_module(module)
    original, calls = getattr(target, name), []

    def counting(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, counting)
    return calls


@pytest.mark.parametrize("prompts", [False, True], ids=["one prompt", "queue"])
def test_a_plan_file_is_read_once_and_its_devices_checked_once(work, monkeypatch, prompts):
    code, _, err = run_dmap("plan", "./flux", *SIZE, "-o", "p.json", cwd=work)
    assert code == 0, err
    (work / "queue.txt").write_text("a fox\n")
    reads = _counted(monkeypatch, "dm_cli.planning.plan_file", "load_plan")
    device_checks = _counted(monkeypatch, "dm_cli.run.settle.checks", "check_devices_present")
    asked = ("--prompts", "queue.txt", "-o", "out") if prompts else ("-p", "a fox", "-o", "a.png")
    code, _, err = run_dmap("run", "./flux", "-d", "p.json", *asked, "--steps", "1", cwd=work)
    assert code == 0, err
    assert [str(path) for path in reads] == ["p.json"]
    assert len(device_checks) == 1


def test_the_session_acts_on_a_frozen_settled_run(work):
    from dm_cli.run.request import RunRequest
    from dm_cli.run.sessions.session import Session
    from dm_cli.run.settle.settle import Entry, Loop, settle

    request = RunRequest.of(str(work / "flux"), "a fox", height=64, width=64, mode="staged", output=None)
    settled = settle(request, entry=Entry.API)
    assert (settled.entry, settled.loop, settled.sharing, settled.planned_here) == (Entry.API, Loop.STAGED, None, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settled.plan = None
    with Session(settled) as session:
        assert session.plan is settled.plan and session.staged and session.defaults == settled.defaults
        assert [g.index for g in session.generate(["a fox"], steps=1)] == [0]


def test_a_queue_refuses_a_video_family_before_anything_loads(tmp_path, monkeypatch):
    """The queue's refusal of videos is one of settle's checks: the stage loop is never built."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    write_random_pipeline(PRESETS_DIR / "tiny-wan", tmp_path / "wan", seed=0)
    (tmp_path / "queue.txt").write_text("a fox\n")
    import dm_cli.run.loops.stages as stages

    built, original = [], stages.StageLoop.__init__

    def counting(self, *args, **kwargs):
        built.append(True)
        original(self, *args, **kwargs)

    monkeypatch.setattr(stages.StageLoop, "__init__", counting)
    code, _, err = run_dmap("run", "./wan", "--prompts", "queue.txt", "-o", "out", "--steps", "1", cwd=tmp_path)
    assert code == 2 and "--prompts writes images" in err and "makes videos" in err, err
    assert built == []


@pytest.mark.parametrize("plan_file", [False, True], ids=["inline plan", "plan file"])
def test_a_pipelines_refusal_runs_once_for_a_plan_made_here_as_for_a_plan_file(work, monkeypatch, plan_file):
    """--parallel pipeline under 2 ranks: pipeline_refusal runs once, in settle, whether the plan is made there
    (then after it is made: it reads its denoiser's class) or given."""
    from dm_cli.run.request import RunRequest
    from dm_cli.run.settle.settle import settle

    budget = ("--max-memory", "0=1GB,1=1GB")
    if plan_file:
        code, _, err = run_dmap("plan", "./flux", *SIZE, *budget, "--world-size", "2", "--parallel", "pipeline", "-o",
                                "p.json", cwd=work)
        assert code == 0, err
    monkeypatch.chdir(work)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(name, value)
    refusals = _counted(monkeypatch, "dm_cli.run.settle.layout", "pipeline_refusal")
    placement = {"device_map": "p.json"} if plan_file else {"max_memory": "0=1GB,1=1GB"}
    settled = settle(RunRequest.of("./flux", "a fox", height=64, width=64, steps=1, parallel="pipeline", **placement))
    assert settled.pipelined and len(refusals) == 1


def test_one_process_pipeline_is_refused_in_one_sentence_with_a_plan_made_here_or_given(work):
    """The refusal that needs no plan is the same sentence and exit code for both (the plan made here is not made)."""
    code, _, err = run_dmap("plan", "./flux", *SIZE, "--max-memory", "0=1GB,1=1GB", "-o", "p.json", cwd=work)
    assert code == 0, err
    refusals = []
    for placement in ((), ("-d", "p.json")):
        code, _, err = run_dmap("run", "./flux", *SIZE, *placement, "--parallel", "pipeline", "--simulate", "-p",
                                "a fox", "-o", "a.png", cwd=work)
        refusals.append((code, err))
    assert refusals[0] == refusals[1] and refusals[0][0] == 2 and "this is one process" in refusals[0][1], refusals

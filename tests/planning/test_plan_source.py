"""A plan file knows its model: `dmap run -d PLAN.json` (and `dmap serve -d`, `dm_cli.load(plan=...)`) without SOURCE
runs the plan's source; a source that is gone, has changed, or differs from the plan's is one sentence whose hints,
pasted, succeed; `dmap plan -o` ends with the command that runs the plan, and that command runs."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_dmap

SIZE = ("--height", "64", "--width", "64")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    """tiny-flux with random weights, written once; each test copies it into its own folder as ./flux."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    return write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path_factory.mktemp("plan-source") / "flux", seed=0)


@pytest.fixture
def work(pipe, tmp_path):
    shutil.copytree(pipe, tmp_path / "flux")
    return tmp_path


def _plan(work, *flags, output="p.json"):
    code, out, err = run_dmap("plan", "./flux", "-m", "0=4GB,1=4GB", *SIZE, *flags, "-o", output, cwd=work)
    assert code == 0, err
    return out


def _pasted(hint: str, work, *extra):
    """Run a printed `dmap ...` hint as a user pastes it (in-process)."""
    words = shlex.split(hint)
    assert words[0] == "dmap", hint
    return run_dmap(*words[1:], *extra, cwd=work)


def test_run_without_source_runs_the_plans_source_and_says_so_first(work):
    _plan(work)
    code, out, err = run_dmap("run", "-d", "p.json", "-p", "fox", "--steps", "2", "--simulate", "-o", "a.png", cwd=work)
    assert code == 0, err
    assert out.splitlines()[0] == "Running ./flux from p.json"
    code, out, err = run_dmap("run", "./flux", "-d", "p.json", "-p", "fox", "--steps", "2", "--simulate", "-o", "b.png",
                              cwd=work)
    assert code == 0, err
    assert "Running" not in out.splitlines()[0]  # SOURCE given: nothing to say
    assert (work / "a.png").read_bytes() == (work / "b.png").read_bytes()


def test_a_relative_source_is_found_beside_the_plan_file(work):
    _plan(work)
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    code, out, err = run_dmap("run", "-d", work / "p.json", "-p", "fox", "--steps", "1", "--simulate", "-o", "c.png",
                              cwd=elsewhere)
    assert code == 0, err
    assert (elsewhere / "c.png").is_file()


def test_a_source_that_is_gone_is_one_sentence_naming_both(work):
    _plan(work)
    shutil.rmtree(work / "flux")
    code, out, err = run_dmap("run", "-d", "p.json", "-p", "fox", "--simulate", cwd=work)
    assert code == 2
    assert "p.json was made for ./flux, which does not exist" in err
    assert "Traceback" not in err and not (work / "dmap.png").exists()


def test_a_changed_source_says_so_and_its_plan_hint_pasted_succeeds(work):
    _plan(work)
    config = work / "flux" / "vae" / "config.json"
    data = json.loads(config.read_text())
    data["scaling_factor"] = 0.5  # the model changed: its plan may no longer hold
    config.write_text(json.dumps(data))
    run = ("run", "-d", "p.json", "-p", "fox", "--steps", "1", "--simulate", "-o", "d.png")
    code, out, err = run_dmap(*run, cwd=work)
    assert code == 2
    assert "it was made for ./flux when its configs had digest" in err and "it changed since" in err
    hint = err.split("Plan it again: ", 1)[1].strip()
    assert hint.endswith("-o p.json --overwrite"), hint
    code, out, perr = _pasted(hint, work, "-q")
    assert code == 0, perr
    code, out, err = run_dmap(*run, cwd=work)
    assert code == 0, err


def test_another_source_names_both_and_offers_two_commands_that_work(work):
    _plan(work, "--world-size", "2", "--parallel", "pipeline")
    code, out, err = run_dmap("run", "demo", "-d", "p.json", "-p", "fox", "--simulate", cwd=work)
    assert code == 2
    assert "it was made for ./flux (config digest" in err and "not demo (" in err
    assert "the same command with SOURCE ./flux (or none)" in err
    hint = err.split("run with that plan: ", 1)[1].strip()
    assert hint.startswith("dmap plan demo ") and "--world-size 2 --parallel pipeline" in hint
    assert hint.endswith("-o p-demo.json"), hint
    code, out, perr = _pasted(hint, work, "-q")
    assert code == 0, perr
    plan, again = (json.loads((work / name).read_text()) for name in ("p.json", "p-demo.json"))
    assert again["source"] == "demo"
    for key in ("devices", "inputs", "dtype", "strategy", "mode"):  # the flags this plan was made with
        assert again[key] == plan[key], key
    assert again["parallel"]["layout"] == "pipeline" and again["parallel"]["in_flight"] == plan["parallel"]["in_flight"]
    code, out, err = run_dmap("run", "demo", "-d", "p-demo.json", "-p", "fox", "--steps", "1", "--simulate",
                              "-o", "e.png", cwd=work)
    assert code == 0, err
    code, out, err = run_dmap("run", "./flux", "-d", "p.json", "-p", "fox", "--steps", "1", "--simulate", "-o", "f.png",
                              cwd=work)
    assert code == 0, err


def test_plan_command_rebuilds_every_recorded_flag(work):
    from dm_cli.planning.plan_command import plan_command
    from dm_cli.planning.plan_file import load_plan

    _plan(work, "--dtype", "bfloat16", "--num-images", "2", "--guidance-scale", "2.5", "--max-sequence-length", "32",
          "--overhead", "0=100MB,1=200MB", "--strategy", "sequential")
    plan = load_plan(work / "p.json")
    hint = plan_command(plan, "./flux", "q.json")
    code, out, err = _pasted(hint, work, "-q")
    assert code == 0, err
    first, second = (json.loads((work / name).read_text()) for name in ("p.json", "q.json"))
    assert first == second  # the same plan, byte for byte as JSON


def test_plan_ends_with_the_run_command_and_it_runs(work, monkeypatch):
    import dm_cli.run.request as request

    monkeypatch.setattr(request, "cuda_devices_without_torch", lambda: 0)  # this machine: no GPU
    out = _plan(work)
    hint = out.rstrip().splitlines()[-1]
    assert hint == 'Next: dmap run -d p.json -p "a prompt" --simulate -o p.png', hint
    code, out, err = _pasted(hint.removeprefix("Next: "), work, "--steps", "1")
    assert code == 0, err
    assert (work / "p.png").is_file()


def test_plan_next_for_ranks_is_the_torchrun_form(work, monkeypatch):
    import dm_cli.run.request as request

    monkeypatch.setattr(request, "cuda_devices_without_torch", lambda: None)  # GPUs may be here: no --simulate
    out = _plan(work, "--world-size", "2", "--parallel", "pipeline")
    assert out.rstrip().splitlines()[-1] == 'Next: torchrun --nproc-per-node 2 -m dm_cli run -d p.json -p "a prompt" -o p.png'


def test_load_and_serve_take_the_plans_source(work):
    import dm_cli
    from dm_cli.serve.server import ServeRequest, _served

    _plan(work)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        session = dm_cli.load(plan="p.json", simulate=True)
        try:
            assert session.source.spec == "./flux" and session.source_from_plan
            served = _served(ServeRequest(run=None), session)
            assert served.model == "./flux"
        finally:
            session.close()
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_the_torchrun_hint_runs_as_printed(work, monkeypatch):
    """The plan's own `Next:` line for 2 pipeline ranks, run as a user pastes it (the process itself: torchrun)."""
    out = _plan(work, "--world-size", "2", "--parallel", "pipeline")
    hint = out.rstrip().splitlines()[-1].removeprefix("Next: ")
    words = shlex.split(hint)
    assert words[:2] == ["torchrun", "--nproc-per-node"], hint
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run([torchrun, "--standalone", *words[1:], "--steps", "1", "-q"], cwd=work, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = words[words.index("-o") + 1] if "-o" in words else "dmap.png"  # the hint names it after the plan
    assert (work / output).is_file(), hint

"""First contact, round 3 (outside serve): every demo's `Next:` runs as printed, `dmap demo list`, advice that does
not go in a circle, a missing path called missing, pipeline ranks on a machine without GPUs, and 80 columns."""

import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_dmap

from dm_cli.model.demo import NEEDS_INPUT_IMAGE, VIDEO_PRESETS, tiny_presets

QUICK = ("tiny-flux-img2img", "tiny-sdxl")  # the reported one, and two demos in one folder (outputs must not clash)
# one preset of each other form the hint takes (Kontext's area, videos from text, from
# an image, LTX-2's); the rest share their form, and the tables they are made from are checked against the families
# (test_the_demo_tables_follow_the_families)
FORMS = ("tiny-flux-kontext", "tiny-wan", "tiny-wan-i2v", "tiny-ltx2", "tiny-flux2")


def test_the_demo_tables_follow_the_families():
    """An image-to-image or edit preset writes an example image and names it; a video preset writes a video."""
    import json

    from dm_cli.families import family_for
    from dm_cli.model.sources import PRESETS, PRESETS_DIR

    for preset in tiny_presets():
        index = json.loads((PRESETS_DIR / PRESETS[preset] / "model_index.json").read_text())
        family = family_for(index["_class_name"])
        assert (preset in NEEDS_INPUT_IMAGE) == (family.min_input_images > 0), preset
        assert (preset in VIDEO_PRESETS) == (family.default_num_frames is not None), preset


@pytest.mark.parametrize("preset", [pytest.param(p, marks=() if p in QUICK else pytest.mark.slow)
                                    for p in tiny_presets() if p in QUICK + FORMS])
def test_every_demo_next_command_runs_as_printed(preset, tmp_path):
    code, out, err = run_dmap("demo", preset, "-o", preset, cwd=tmp_path)
    assert code == 0, err
    hint = out.strip().splitlines()[-1]
    assert hint.startswith("Next: dmap run "), hint
    words = shlex.split(hint.removeprefix("Next: "))
    code, out, err = run_dmap(*words[1:], "-q", cwd=tmp_path)
    assert code == 0, f"{hint}\n{err}"
    written = tmp_path / words[words.index("-o") + 1]
    assert written.exists() and written.name.startswith(preset)


def test_demo_list_and_a_default_folder(tmp_path):
    code, out, err = run_dmap("demo", "list", cwd=tmp_path)
    assert code == 0, err
    assert out.split() == tiny_presets()
    code, out, err = run_dmap("demo", "tiny-sd15", cwd=tmp_path)  # no -o: the preset's name, here
    assert code == 0, err
    assert (tmp_path / "tiny-sd15" / "model_index.json").is_file()


def test_a_local_path_that_does_not_exist_is_called_missing(tmp_path):
    (tmp_path / "models").mkdir()
    code, out, err = run_dmap("plan", "models/flux", cwd=tmp_path)
    assert code == 2
    assert "No such path: models/flux (the folder models is here, but has no flux)" in err
    code, out, err = run_dmap("plan", "nothere/flux", cwd=tmp_path)  # no such folder either: maybe a repo id
    assert code != 0 and "No file or folder nothere/flux is here" in err
    code, out, err = run_dmap("plan", "wan2.2", "--component-file", "transformer_2=missing.gguf", cwd=tmp_path)
    assert code == 2
    assert "--component-file transformer_2=missing.gguf: no such file." in err


def test_pipeline_advice_for_a_queue_does_not_send_it_back_to_pipeline():
    """`--parallel pipeline` on SDXL said "use --parallel cfg"; `--parallel cfg --prompts` says "drop --parallel, or
    give --parallel pipeline": the first must offer what a queue can take."""
    from types import SimpleNamespace

    from dm_cli.inputs import Generation
    from dm_cli.run.settle.layout import pipeline_refusal

    family = SimpleNamespace(denoiser="unet", experts=(), title=lambda: "SDXL")
    plan = SimpleNamespace(components={"unet": SimpleNamespace(cls="UNet2DConditionModel")})
    problem = pipeline_refusal(family, Generation(), plan, 2)
    assert "for a queue drop --parallel" in problem
    family = SimpleNamespace(denoiser="transformer", experts=("transformer_2",), title=lambda: "Wan 2.2")
    plan = SimpleNamespace(components={"transformer": SimpleNamespace(cls="WanTransformer3DModel")})
    assert pipeline_refusal(family, Generation(), plan, 2) is None  # its experts cut into slices (issue 40)


def test_pipeline_ranks_without_gpus_plan_each_rank_cpu_as_its_gpu(monkeypatch):
    import dm_cli.run.request as request

    monkeypatch.setattr("dm_cli.planning.placement.budgets.available_ram", lambda: 8 * 10**9)
    assert request.cpu_rank_devices(2) == "0=4000000000B,1=4000000000B"


@pytest.mark.slow
def test_torchrun_pipeline_without_gpus_needs_no_max_memory(tmp_path):
    """`torchrun ... dmap run --parallel pipeline` on a machine without GPUs runs as `--parallel cfg` does, with no -m:
    each rank's CPU stands for GPU r (it said "--world-size 2 puts rank r on GPU r", an option run does not have)."""
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path / "flux", seed=0)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dm_cli", "run", str(folder),
                           "--parallel", "pipeline", "-p", "fox", "--steps", "1", "--height", "64", "--width", "64",
                           "-q", "-o", "fox.png"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "fox.png").is_file()


def test_plain_lines_wrap_at_spaces_and_hints_never(monkeypatch):
    from dm_cli.cli._output import say

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "40")
    stream = Terminal()
    say("Wrote tiny-flux (FluxPipeline, random weights from seed 0: its outputs are noise, not art)", stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) > 1 and all(len(line) <= 40 for line in lines)
    assert "outputs" in stream.getvalue().split()  # never cut in two


def test_demo_prints_its_next_command_whole_on_a_terminal(tmp_path, monkeypatch):
    import contextlib

    from dm_cli.cli import main

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.chdir(tmp_path)
    out = Terminal()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["demo", "tiny-sd15", "-o", "a-long-folder-name-for-the-demo"])
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("Next: dmap run a-long-folder-name-for-the-demo --prompt")  # one line, pasteable
    assert all(len(line) <= 40 for line in lines[:-1])


def test_a_cpu_row_measured_by_rss_says_so(tmp_path, monkeypatch):
    from test_render_golden import run_result

    from dm_cli.render.run import RunView, tracking_note

    result = run_result()
    result.stages[1] = replace(result.stages[1], tracked="process peak RSS",
                               measured_peak={**result.stages[1].measured_peak, "cpu": 5_000 * 10**6})
    monkeypatch.setenv("COLUMNS", "200")
    from rich.console import Console

    view = RunView()
    view.console = Console(file=io.StringIO(), width=200, markup=False, highlight=False)
    monkeypatch.chdir(tmp_path)
    view.summary(result)
    shown = view.console.file.getvalue()
    assert "217% (RSS)" in shown
    assert "not a planning error" in tracking_note(result)


def test_a_tiny_plan_does_not_predict_zero_seconds(tmp_path):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path / "flux", seed=0)
    code, out, err = run_dmap("plan", folder, "-m", "0=4GB,1=4GB", "--world-size", "2", "--parallel", "pipeline",
                              "--height", "64", "--width", "64", env={"COLUMNS": "120"})
    assert code == 0, err
    assert "predicted 0 s" not in out and " 0 s per step" not in out  # each layout's step in 4 significant figures
    assert re.search(r"split: 0\.00\d+ s per step", out)


def test_a_plan_made_under_torchrun_does_not_advise_launching_torchrun(tmp_path, monkeypatch):
    from dm_cli.model.demo import write_random_pipeline
    from dm_cli.model.sources import PRESETS_DIR
    from dm_cli.planning.modes import Layout
    from dm_cli.run.distributed import Ranks
    from dm_cli.run.request import RunRequest
    from dm_cli.run.settle.checks import make_run_plan, prepare, settle_generation
    from dm_cli.run.settle.layout import StepSharing

    folder = write_random_pipeline(PRESETS_DIR / "tiny-flux", tmp_path / "flux", seed=0)
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    request = RunRequest.of(str(folder), "fox", parallel="pipeline", height=64, width=64, max_memory="0=4GB,1=4GB")
    source, family, _, defaults, _ = prepare(request)
    generation = settle_generation(request.generation, source, family, defaults, False)
    plan = make_run_plan(source, request, generation, family, StepSharing(Layout.PIPELINE, 1, 1, Ranks.from_env()))
    assert plan.parallel.layout == "pipeline"
    assert not any("run it with torchrun" in warning for warning in plan.warnings), plan.warnings
    code, out, err = run_dmap("plan", folder, "-m", "0=4GB,1=4GB", "--world-size", "2", "--parallel", "pipeline",
                              "--height", "64", "--width", "64", "--json")
    assert code == 0 and "run it with torchrun" in out  # a plan file still says how to launch it

"""First contact (issue 23): a newcomer can get a runnable tiny pipeline, and the demo has a SOURCE name.

`dmap demo PRESET -o DIR` writes a tiny preset with random weights; `demo` is a SOURCE for inspect and
plan; `dmap run` of a weightless tiny preset says how to get weights.
"""

from __future__ import annotations

import json

from conftest import run_dmap


def test_demo_writes_a_tiny_preset_that_runs(tmp_path):
    code, out, err = run_dmap("demo", "tiny-sd15", "-o", tmp_path / "sd15", "--seed", "3")
    assert code == 0, err
    folder = tmp_path / "sd15"
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    assert str(folder) in out and "dmap run" in out  # where it is, and what to try next
    assert "MB" in out or "KB" in out  # how big
    code, _, err = run_dmap("run", folder, "--prompt", "a", "--steps", "1", "--height", "64", "--width", "64",
                            "-o", tmp_path / "img.png")
    assert code == 0, err
    assert (tmp_path / "img.png").stat().st_size > 0


def test_demo_refuses_a_full_size_preset(tmp_path):
    code, _, err = run_dmap("demo", "flux", "-o", tmp_path / "flux")
    assert code == 2
    assert "tiny" in err and "tiny-sd15" in err and "tiny-wan" in err, err  # says which ones it can write
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_demo_refuses_an_existing_output_without_overwrite(tmp_path):
    target = tmp_path / "x"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, _, err = run_dmap("demo", "tiny-sd15", "-o", target)
    assert code == 2
    assert "--overwrite" in err and "Traceback" not in err, err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_plan_and_inspect_take_demo_as_source():
    code, out, err = run_dmap("plan", "demo", "--max-memory", "0=1GB")
    assert code == 0, err
    assert out.startswith("demo") and "256x256" in out  # the demo, at the defaults `dmap run` gives it
    code, out, err = run_dmap("inspect", "demo", "--json")
    assert code == 0, err
    assert json.loads(out)["pipeline_class"] == "FluxPipeline"


def test_run_of_a_weightless_tiny_preset_says_how_to_get_weights(tmp_path):
    code, _, err = run_dmap("run", "tiny-wan", "--prompt", "a", "-o", tmp_path / "x.mp4")
    assert code == 2
    assert "dmap demo tiny-wan -o" in err, err
    assert "Traceback" not in err

"""First contact, round 4 (issue 57), the run side: the predicted time is the run's (its steps and prompts, a plan
file's steps run by `run -d`), one per-step figure per layout in a pipeline plan, hints that run as printed, a
typo'd path answered in dmap's own words, serve's start-up line, and the hidden-columns notes."""

import json
import re

from conftest import run_dmap

SIZE = ("--height", "64", "--width", "64")


def _predicted(out: str) -> str:
    """The prediction's lines, joined (Rich wraps them at the terminal's width)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Predicted denoise time"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("Device profile"))
    return " ".join(lines[start:end])


def test_a_run_predicts_its_own_steps(tmp_path):
    """`dmap run --steps 8` printed "at 28 steps (--steps)": the inline plan predicted at the family's default."""
    code, out, err = run_dmap("run", "-p", "fox", "--steps", "8", *SIZE, "-o", str(tmp_path / "a.png"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    line = _predicted(out)
    assert "8 steps" in line and "28 steps" not in line and "(--steps)" not in line, line
    assert "64x64" in line and "1 prompt" in line, line


def test_run_d_takes_the_plans_steps_and_prints_them(tmp_path):
    """`dmap plan --steps 8 -o p.json` then `dmap run -d p.json` ran the pipeline's default steps; the printed
    prediction is the same as the inline run's at those steps, and a --steps given to the run wins."""
    plan = tmp_path / "p.json"
    code, out, err = run_dmap("plan", "demo", "--steps", "8", *SIZE, "-o", str(plan), env={"COLUMNS": "200"})
    assert code == 0, err
    planned = json.loads(plan.read_text())["predicted_time"]
    assert planned["steps"] == 8
    code, out, err = run_dmap("run", "-d", str(plan), "-p", "fox", "-o", str(tmp_path / "b.png"), "--json")
    assert code == 0, err
    assert json.loads(out)["steps"] == 8
    code, out, err = run_dmap("run", "-d", str(plan), "-p", "fox", "-o", str(tmp_path / "c.png"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    from_file = _predicted(out)
    assert "8 steps" in from_file and ", 8 steps, guidance" in out
    code, out, err = run_dmap("run", "demo", "-p", "fox", "--steps", "8", *SIZE, "-o", str(tmp_path / "d.png"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    assert _predicted(out) == from_file  # inline plan and plan file: one prediction
    code, out, err = run_dmap("run", "-d", str(plan), "-p", "fox", "--steps", "3", "-o", str(tmp_path / "e.png"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    assert "3 steps" in _predicted(out) and ", 3 steps, guidance" in out


def test_prediction_at_the_runs_steps_and_queue():
    """The one function plan and run print a prediction through: step seconds times steps, over the images a
    call makes, times the queue; each layout's the same way; its own steps when none are given."""
    from dm_cli.run.request import prediction_at

    predicted = {"steps": 28, "queue": 1, "images_per_call": 2, "step_s": 0.5, "image_s": 7.0, "queue_s": 14.0,
                 "layouts": {"split": {"step_s": 0.5, "image_s": 7.0, "queue_s": 14.0},
                             "pipeline": {"step_s": 0.25, "image_s": 3.5, "queue_s": 7.0}}}
    assert prediction_at(predicted) == predicted
    at = prediction_at(predicted, 8, 3)
    assert (at["steps"], at["queue"], at["image_s"], at["queue_s"]) == (8, 3, 2.0, 12.0)
    assert at["layouts"]["pipeline"] == {"step_s": 0.25, "image_s": 1.0, "queue_s": 6.0}
    assert prediction_at({}, 8, 3) == {}


def test_a_queue_predicts_for_its_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\na lighthouse\na cat\n")
    code, out, err = run_dmap("run", "--prompts", str(prompts), *SIZE, "--steps", "2", "-o", str(tmp_path / "q"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    line = _predicted(out)
    assert "2 steps, 3 prompts" in line and "for its 3 prompts" in line, line


def test_a_pipeline_plan_prints_one_per_step_figure_per_layout(tmp_path):
    """A pipeline plan printed three different per-step figures (the time model's, rounded to 0.0001, its
    unrounded ones in the reason, and the predicted time's) and "50 TFLOP/s" unexplained where the docs say 100."""
    code, out, err = run_dmap("plan", "demo", "--world-size", "2", "--parallel", "pipeline", "-m", "0=660MB,1=660MB",
                              env={"COLUMNS": "200"})
    assert code == 0, err
    figures = set(re.findall(r"([0-9.e-]+ s|under 0\.1 ms) (?:per step|per image-step|s/step)", out))
    layouts = re.findall(r"^  (split|pipeline)(?: \(chosen\))?: ([0-9.e-]+ s|under 0\.1 ms) per", out, re.M)
    assert sorted(name for name, _ in layouts) == ["pipeline", "split"], out
    assert figures == {seconds for _, seconds in layouts}, out  # no other per-step figure anywhere
    assert "s/step" not in out
    assert "50 TFLOP/s per GPU at float32" in out and "100 at bfloat16" in out

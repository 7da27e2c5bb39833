"""First contact, round 4 (issue 57), the run side: the predicted time is the run's (its steps and prompts, a plan
file's steps run by `run -d`), one per-step figure per layout in a pipeline plan, hints that run as printed, a
typo'd path answered in dmap's own words, serve's start-up line, and the hidden-columns notes."""

import json
import re

import pytest
from conftest import run_dmap

SIZE = ("--height", "64", "--width", "64")


@pytest.fixture(autouse=True)
def _a_calibrated_cpu(monkeypatch):
    """This machine's CPU as calibrated (dmap predicts a CPU plan's time only with a CPU profile): dmap's default
    figures, named a CPU's."""
    from dataclasses import replace

    import dm_cli.planning.time.plan_prediction as prediction
    from dm_cli.planning.time.profiles import DEFAULT_PROFILE

    monkeypatch.setattr(prediction, "cached_profile", lambda *args, **kwargs: replace(DEFAULT_PROFILE, name="this-cpu",
                                                                                       kind="cpu"))


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
    for choice in ("context", "auto"):  # the reason of a layout that shares the steps, and auto's: no seconds either
        code, out, err = run_dmap("plan", "demo", "--world-size", "2", "--parallel", choice, "-m", "0=8GB,1=8GB",
                                  env={"COLUMNS": "200"})
        assert code == 0, err
        reason = next(line for line in out.splitlines() if line.startswith("Parallel: ") and "fits with" in line)
        assert not re.search(r"\d s\b|s/step", reason), reason


# --- item 5: every printed Next or hint runs as printed --------------------------------------------------------

LORA = (b"\xbe\0\0\0\0\0\0\0" + b'{"transformer.x_embedder.lora_A.weight":{"dtype":"F16","shape":[1,64],"data_offsets":'
        b'[0,128]},"transformer.x_embedder.lora_B.weight":{"dtype":"F16","shape":[256,1],"data_offsets":[128,640]}}'
        + b"0" * 640)  # the README's one-layer LoRA for the demo's transformer


def _pasted(line: str, cwd, *extra):
    """A printed `dmap ...` command run as a user pastes it (in-process)."""
    import shlex

    words = shlex.split(line)
    assert words[0] == "dmap", line
    return run_dmap(*words[1:], *extra, cwd=cwd)


def test_a_lora_plans_next_and_replan_hint_run_as_printed(tmp_path):
    """A plan made with --lora printed a Next without --lora (the run then refused the plan), writing dmap.png, which
    an earlier run had written; the hint of a run that does not match the plan said `dmap plan demo --output
    PLAN.json`, dropping the plan's flags (devices, size, LoRA)."""
    (tmp_path / "fox-lora.safetensors").write_bytes(LORA)
    (tmp_path / "dmap.png").write_bytes(b"an earlier run's")
    code, out, err = run_dmap("plan", "demo", "--lora", "fox-lora.safetensors:0.8", "-m", "cpu=4GB", *SIZE,
                              "--steps", "2", "-o", "lp.json", cwd=tmp_path, env={"COLUMNS": "80"})
    assert code == 0, err
    hint = out.rstrip().splitlines()[-1]
    assert hint == 'Next: dmap run -d lp.json -p "a prompt" --lora transformer=fox-lora.safetensors:0.8 -o lp.png', hint
    code, out, err = _pasted(hint.removeprefix("Next: "), tmp_path)
    assert code == 0, err
    assert (tmp_path / "lp.png").is_file()
    # a run that asks for another size and no LoRA: the hint plans it with the plan's other flags, beside the plan
    code, out, err = run_dmap("run", "-d", "lp.json", "-p", "fox", "--height", "32", "--width", "32", "-o", "x.png",
                              cwd=tmp_path)
    assert code == 2 and "--lora transformer=fox-lora.safetensors:0.8" in err, err
    command = re.search(r"with the plan's other flags: (dmap plan .*?), then run with -d (\S+) ", err)
    assert command and "--max-memory cpu=4GB" in command[1] and "--steps 2" in command[1], err
    assert "--height 32 --width 32" in command[1] and "--lora" not in command[1], err
    code, out, err = _pasted(command[1], tmp_path)
    assert code == 0, err
    code, out, err = run_dmap("run", "-d", command[2], "-p", "fox", "--height", "32", "--width", "32", "-o", "x.png",
                              cwd=tmp_path)
    assert code == 0, err
    assert ", 2 steps," in out


def test_a_pipeline_plan_run_under_its_ranks_does_not_ask_to_launch_torchrun(monkeypatch):
    """The pipeline-layout warning ("run it with torchrun ...") was printed by the plan and again by the run that
    torchrun launched as it says: a run under as many ranks leaves it out; one process still hears it."""
    from dm_cli.planning.make import launch_warning
    from dm_cli.planning.parallel.parallel_layout import ParallelLayout
    from dm_cli.planning.plan_file import Plan
    from dm_cli.run.settle.settle import _run_warnings

    layout = ParallelLayout(2, "pipeline", 1, 1, 1, {"0": 1, "1": 1})
    plan = Plan.__new__(Plan)
    plan.parallel, plan.warnings = layout, [launch_warning(layout), "another"]
    assert _run_warnings(plan) == [launch_warning(layout), "another"]
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert _run_warnings(plan) == ["another"]


def test_a_queues_notices_are_said_once_by_rank_0(monkeypatch):
    """Under torchrun every rank printed the run's notices (the demo's, the pipeline's cut): rank 0 says them."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from dm_cli.render.queue import QueueView

    said = {}
    for rank in (0, 1):
        for key, value in {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
            monkeypatch.setenv(key, str(value))
        view = QueueView()
        view.console = Console(file=io.StringIO(), width=200)
        view.start(SimpleNamespace(mine=1, skipped=[], notices=["The denoiser is cut into 2 slices."], items=2,
                                   world_size=2, mode="resident", plan_digest="x", output_dir="out", redone={},
                                   resume=True))
        said[rank] = view.console.file.getvalue()
    assert "cut into 2 slices" in said[0] and "cut into 2 slices" not in said[1]


# --- item 6: a typo'd path without HF_HUB_OFFLINE, no network: one sentence of dmap's ---------------------------


def test_a_typod_relative_path_online_without_network_is_one_sentence_of_dmaps(tmp_path, monkeypatch):
    """`dmap plan models/no-such-flux` on a machine without network printed the Hub client's text ("ConnectError:
    [Errno -2] ... Please check your internet connection and try again..")."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args, local_files_only=False, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub ... Please "
                                      "check your internet connection and try again.") from ConnectionError(
            "ConnectError: [Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    code, out, err = run_dmap("plan", "models/no-such-flux", cwd=tmp_path)
    assert code == 2, err
    message = err.strip()
    assert message.count("\n") == 0 and message.endswith("download the repo first."), message
    assert "models/no-such-flux" in message and "could not be reached" in message
    for internal in ("ConnectError", "Errno", "internet connection", "snapshot", ".."):
        assert internal not in message.replace(str(tmp_path), ""), message

    def not_found(*args, local_files_only=False, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # as the client raises it on a 404
        error.args = ("404 Client Error. Repository Not Found for url: https://huggingface.co/...",)
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    code, out, err = run_dmap("plan", "models/no-such-flux", cwd=tmp_path)
    assert code == 2 and "the Hub has no repo models/no-such-flux" in err and "404" not in err, err


# --- item 7: serve's start-up line; the hidden-columns notes ----------------------------------------------------


def _session(cache=None, simulate=False, frames=None):
    from types import SimpleNamespace

    from dm_cli.inputs import StepCache

    comp = SimpleNamespace(device_map={"transformer_blocks.0": 0, "proj_out": 1, "x": "cpu"})
    return SimpleNamespace(defaults=SimpleNamespace(width=512, height=256, num_frames=frames, steps=8),
                           plan=SimpleNamespace(mode="staged", components={"transformer": comp}),
                           simulate=simulate, sharing=None, plan_digest="0123456789abcdef",
                           generation=SimpleNamespace(cache=StepCache("taylorseer") if cache else None),
                           source=SimpleNamespace(spec="demo", pipeline_class="FluxPipeline"), notices=[],
                           source_from_plan=False)


def test_serves_start_up_line_names_what_it_serves_and_the_url_alone():
    """`dmap serve --cache taylorseer` did not say which step cache (nor compile) it serves with, nor its devices,
    and its URL came mid-line, where a narrow terminal wrapped it."""
    from types import SimpleNamespace

    from dm_cli.serve.server import startup_lines

    line, url = startup_lines(SimpleNamespace(model=None), _session(cache=True, simulate=True),
                              "http://127.0.0.1:8000")
    assert url == "http://127.0.0.1:8000"
    for said in ("512x256 images", "8 steps", "staged plan 0123456789abcdef", "GPU 0, GPU 1, cpu (simulated on this CPU)",
                 "step cache taylorseer", "eager (no compile)"):
        assert said in line, (said, line)
    assert "http" not in line
    line, _ = startup_lines(SimpleNamespace(model="fox"), _session(frames=9), "http://[::1]:8000")
    assert line.startswith("Serving fox (FluxPipeline): 512x256, 9 frames videos") and "step cache none" in line


def test_serves_cli_prints_the_url_on_a_line_of_its_own_at_any_width(monkeypatch):
    import dm_cli.cli.serve as cli_serve

    def fake_serve(request, on_status, on_ready):
        on_ready("http://127.0.0.1:43210", _session(cache=True))
        return 0

    monkeypatch.setattr(cli_serve, "serve_forever", fake_serve)
    code, out, err = run_dmap("serve", "--cache", "taylorseer", "--port", "0", env={"COLUMNS": "20"})
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Serving demo (FluxPipeline): ") and "step cache taylorseer" in lines[0]
    assert lines[1] == "http://127.0.0.1:43210"


def test_the_hidden_columns_note_names_tables_and_headers_a_user_sees(tmp_path):
    """"(hidden at 80 columns: memory (in the bar): capacity, free; components: hops; stages: ...; peaks: ...)" named
    tables by words printed nowhere: the note names each table by its title and says what shows the columns."""
    code, out, err = run_dmap("run", "-p", "fox", "--steps", "1", *SIZE, "-o", str(tmp_path / "a.png"),
                              env={"COLUMNS": "80"})
    assert code == 0, err
    start = out.index("(hidden at 80 columns:")
    note = " ".join(out[start:out.index(")", out.index("shows them", start))].split())
    titles = [line.strip() for line in out.splitlines()]
    labels = re.findall(r"(?:: |; )([A-Za-z_ ]+?)(?: \([^)]*\))?: ", note)
    assert len(labels) >= 3, note
    for label in re.findall(r"(?:: |; )([A-Za-z_ ]+?)(?: \([^)]*\))?: ", note):
        assert any(title.startswith(label) for title in titles), (label, note)
    assert "a wider terminal or --json shows them" in note
    for gone in ("memory (in the bar)", "components:", "stages:", "peaks:"):
        assert gone not in note, note


def test_a_plan_that_predicts_no_time_still_gives_run_d_its_steps(tmp_path, monkeypatch):
    """A plan whose `predicted_time` holds its steps but no seconds (no profile of its CPU) prints no prediction,
    and `run -d` still runs its steps."""
    import dm_cli.planning.time.plan_prediction as prediction

    monkeypatch.setattr(prediction, "cached_profile", lambda *args, **kwargs: None)
    plan = tmp_path / "p.json"
    code, out, err = run_dmap("plan", "demo", *SIZE, "-o", str(plan))
    assert code == 0, err
    data = json.loads(plan.read_text())
    data["predicted_time"] = {"steps": 3}
    plan.write_text(json.dumps(data))
    code, out, err = run_dmap("run", "-d", str(plan), "-p", "fox", "-o", str(tmp_path / "a.png"),
                              env={"COLUMNS": "200"})
    assert code == 0, err
    assert ", 3 steps, guidance" in out and "Predicted denoise time" not in out

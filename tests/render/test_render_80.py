"""What a person at 80 columns sees (issue 23 items 4, 9, 10): one memory picture per stage and device,
at most one note about hidden columns per command, words never cut, a device_map count that adds up to
the JSON's, the written image with its size, and the plan's next step."""

import json
import os
import re
from pathlib import Path

import pytest
from test_render_golden import GOLDEN, flux_plan, inspect_report, png_file, run_result

from dm_cli.planning.plan_file import Plan
from dm_cli.units import format_size

BAR_GLYPHS = "█▓▒▪·"


@pytest.fixture
def cols(monkeypatch, capsys, tmp_path):
    """Render at a width, plain text, in a fresh folder: returns draw(fn, width) -> stdout + stderr."""
    monkeypatch.chdir(tmp_path)
    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR", "JUPYTER_COLUMNS", "LINES"):
        monkeypatch.delenv(variable, raising=False)

    def draw(fn, width=80):
        monkeypatch.setenv("COLUMNS", str(width))
        capsys.readouterr()
        fn()
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert max(len(line) for line in text.splitlines()) <= width
        return captured.out

    return draw


def hidden_notes(text: str) -> list[str]:
    return [line for line in text.splitlines() if "(hidden at" in line]


def plan_json() -> dict:
    return json.loads((GOLDEN / "plan_flux_512.json").read_text())


def render(plan, **kwargs):
    from dm_cli.render.plan import render_plan

    return lambda: render_plan(plan, **kwargs)


@pytest.mark.parametrize("width", (80, 120))
def test_plan_shows_one_bar_per_stage_and_device_and_at_most_one_hidden_note(cols, width):
    plan = flux_plan()
    out = cols(render(plan, output="plan.json"), width)
    assert len(hidden_notes(out)) <= 1
    table_rows = [line for line in out.splitlines() if line.startswith("│") and any(g in line for g in BAR_GLYPHS)]
    expected = [(stage.name, key) for stage in plan.stages for key in stage.use]
    assert len(table_rows) == len(expected), out  # one bar per device of every stage
    for stage in plan.stages:
        assert re.search(rf"^│ {stage.name} ", out, re.M), stage.name  # the stage names are in the picture
    assert "bar: █ weights" in out


def test_a_run_prints_at_most_one_hidden_note_for_plan_and_summary(cols):
    from dm_cli.render.run import RunView

    def draw():
        result = run_result()
        png_file(Path("fox.png"), 512, 512, 1000)
        with RunView() as view:
            view.show_plan(result.plan)
            view.summary(result)

    out = cols(draw)
    assert len(hidden_notes(out)) <= 1
    assert "Next:" not in out  # a run is the next step: no advice to run it


LONG_CLASSES = ("Mistral3ForConditionalGeneration", "CombinedTimestepGuidanceTextProjEmbeddings",
                "FluxTransformer2DModel")


def test_no_class_name_is_split_across_lines(cols):
    from dm_cli.render.inspect import render_inspect

    report = inspect_report()
    report.components[0].cls = "Mistral3ForConditionalGeneration"
    report.components[0].name = "text_encoder"
    out = cols(lambda: render_inspect(report))
    for name in LONG_CLASSES:
        assert name in out, f"{name} is cut across lines:\n{out}"
    data = plan_json()
    data["components"]["text_encoder"]["class"] = "Mistral3ForConditionalGeneration"
    out = cols(render(Plan.from_json(data)))
    for name in ("Mistral3ForConditionalGeneration", "FluxTransformer2DModel"):
        assert name in out, f"{name} is cut across lines:\n{out}"
    assert not re.search(r"GPU\s+│", out)  # a device label is not cut either (`GPU` / `1, cpu`)


def test_a_text_column_is_never_narrower_than_its_longest_word(monkeypatch):
    from dm_cli.render import Col, console, fitted_table

    monkeypatch.setenv("COLUMNS", "60")
    out = console()
    rows = [["a" * 30, "word " * 12, "Mistral3ForConditionalGeneration"]]
    with out.capture() as capture:
        table, dropped = fitted_table(out, None, [Col("x"), Col("text"), Col("class", drop=1)], rows)
        out.print(table)
    text = capture.get()
    assert "a" * 30 in text and dropped == ["class"]  # the class goes whole or not at all
    assert all(len(line) <= 60 for line in text.splitlines())


def test_collapsed_device_map_counts_the_json_entries(cols):
    data = plan_json()
    comp = data["components"]["transformer"]
    items = list(comp["device_map"].items())
    # time_text_embed as three JSON entries: the collapsed map shows it once, the count must say three
    at = [k for k, _ in items].index("time_text_embed")
    nested = [(f"time_text_embed.{part}", 0) for part in ("timestep_embedder", "guidance_embedder", "text_embedder")]
    comp["device_map"] = dict(items[:at] + nested + items[at + 1:])
    plan = Plan.from_json(data)
    entries = len(comp["device_map"])
    for width in (80, 120):
        out = cols(render(plan), width)
        assert f"transformer device_map: {entries} entries" in out
        counts = [int(m.group(1)) for m in re.finditer(r"│\s+(\d+) │ (?:GPU \d|cpu|disk)", out)]
        assert sum(counts) == entries, out
        assert "time_text_embed.timestep_embedder" not in out  # collapsed


def test_offload_is_said_plainly(cols):
    out = cols(render(flux_plan()), 120)
    assert "execution device says" not in out
    assert "stay on cpu; each block is copied to GPU 0 when it runs" in out


def test_run_summary_names_the_file_its_size_and_pixels(cols, tmp_path):
    from dm_cli.render.run import RunView

    result = run_result()
    path = tmp_path / "out" / "fox.png"
    path.parent.mkdir()
    png_file(path, 512, 512, 123_456)
    result.images = [str(path)]

    def draw():
        with RunView() as view:
            view.summary(result)

    out = cols(draw, 120)
    line = next(line for line in out.splitlines() if line.startswith("Wrote"))
    assert str(path) in line and "512x512" in line and format_size(os.stat(path).st_size) in line


def test_quiet_run_prints_only_the_path(cols, tmp_path):
    from dm_cli.render.run import RunView

    result = run_result()
    png_file(tmp_path / "fox.png", 512, 512, 1000)

    def draw():
        with RunView(quiet=True) as view:
            view.summary(result)

    assert cols(draw).strip() == "Wrote fox.png"


@pytest.mark.parametrize("output", ("plan.json", None))
def test_plan_render_ends_with_one_next_step(cols, output):
    out = cols(render(flux_plan(), output=output), 120)
    lines = out.rstrip("\n").splitlines()
    assert sum(line.startswith("Next:") for line in lines) == 1
    assert lines[-1].startswith("Next:"), lines[-1]
    assert ("-d plan.json" in lines[-1]) if output else ("-o plan.json" in lines[-1])


def test_plan_next_step_runs_the_plan_file(cols, tmp_path, monkeypatch):
    import dm_cli.run.request as request

    data = plan_json()
    data["source"] = str(tmp_path)  # a folder: no preset caveat; the plan knows it, the command needs no SOURCE
    monkeypatch.setattr(request, "cuda_devices_without_torch", lambda: None)
    out = cols(render(Plan.from_json(data), output="p.json"), 120)
    assert out.rstrip().splitlines()[-1] == 'Next: dmap run -d p.json -p "a prompt" -o p.png'
    monkeypatch.setattr(request, "cuda_devices_without_torch", lambda: 0)  # no GPU here: simulated on the CPU
    out = cols(render(Plan.from_json(data), output="p.json"), 120)
    assert out.rstrip().splitlines()[-1] == 'Next: dmap run -d p.json -p "a prompt" --simulate -o p.png'


def test_errors_wrap_at_spaces_on_a_terminal(monkeypatch):
    import io

    from dm_cli.cli import _errors

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setenv("COLUMNS", "40")
    message = ("--frames 80 is not 4k+1 for WanPipeline: the nearest valid counts are 77 and 81 "
               "(Mistral3ForConditionalGeneration).")
    _errors._say(message)
    lines = stream.getvalue().splitlines()
    assert len(lines) > 1 and " ".join(lines) == message
    assert all(len(line) <= 40 or " " not in line for line in lines)

    piped = io.StringIO()  # not a terminal: one line, as scripts read it
    monkeypatch.setattr("sys.stderr", piped)
    _errors._say(message)
    assert piped.getvalue() == message + "\n"


def test_wrapping_by_items_keeps_device_labels_whole():
    from dm_cli.render import _wrap_atoms

    assert _wrap_atoms("GPU 0, GPU 1, cpu", ", ", 10) == "GPU 0,\nGPU 1, cpu"
    assert _wrap_atoms("GPU 0", ", ", 3) == "GPU 0"

"""docs/commands.md's examples work as written and print what the page quotes: every `dmap ...` line of its ```bash
blocks, in order, in one working folder (the mechanism and the skip marks: tests/doc_examples.py, shared with the
README's test). Lines that plan full-size presets trace them on the meta device (up to minutes each with a cold
cache) and run as slow tests (CI runs them); the rest run on every test run."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_dmap
from doc_examples import comment_of, examples, quoted_figures, run_example

PAGE = REPO / "docs" / "commands.md"
# the lines that trace a full-size model on the meta device at its size (or a tiled decode): minutes with a cold cache
SLOW = ("dmap plan flux ", "dmap plan sdxl ", "dmap plan sd3 ", "dmap plan wan2.2 ", "dmap plan flux2 ",
        "dmap plan qwen-image-edit ", "dmap plan tiny-wan --max-memory 0=38.5MB")
COMMANDS = examples(PAGE.read_text(encoding="utf-8"), "docs/commands.md", slow=SLOW)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("commands")


def test_the_page_has_runnable_examples():
    runnable = [p for p in COMMANDS if not any(m.name == "skip" for m in p.marks)]
    quick = [p for p in runnable if not p.marks]
    assert len(runnable) >= 30 and len(quick) >= 20
    assert any(quoted_figures(p.values[1]) for p in runnable), "the page quotes figures the test checks"


@pytest.mark.parametrize("number, line", COMMANDS)
def test_commands_example(number, line, workdir):
    run_example(number, line, workdir, "docs/commands.md")


def test_comments_and_quoted_figures_are_found():
    line = 'dmap run -p "a # b" --steps 2   # prints "25 + 32" and "1.78x"'
    assert comment_of(line) == '# prints "25 + 32" and "1.78x"'
    assert quoted_figures(line) == ["25 + 32", "1.78x"]
    assert comment_of('dmap run -p "a fox"') == "" and quoted_figures('dmap run -p "a fox"') == []


def test_a_figure_the_command_does_not_print_fails(tmp_path):
    run_example(1, 'dmap cache   # prints "skeletons"', tmp_path, "page")  # `dmap cache` lists its kinds
    with pytest.raises(AssertionError, match='quotes "1.97x"'):
        run_example(2, 'dmap cache   # prints "1.97x"', tmp_path, "page")


def test_in_flight_default_is_the_same_in_the_table_the_help_and_the_code():
    from dm_cli.planning.parallel.parallel import ParallelRequest

    assert ParallelRequest(world_size=3, choice="pipeline").planned_in_flight == 3  # one per rank
    row = next(line for line in PAGE.read_text(encoding="utf-8").splitlines() if line.startswith("| `--in-flight K`"))
    assert "(default `--world-size`, one per rank)" in row, row
    code, out, _ = run_dmap("plan", "--help", env={"COLUMNS": "200"})
    assert code == 0 and "(default --world-size)" in " ".join(out.split()), out

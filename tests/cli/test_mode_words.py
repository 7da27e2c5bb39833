"""The modes' words are declared once (dm_cli.planning.modes) and Typer refuses a word outside them while it parses
the command line, one sentence, before SOURCE is read."""

import json

import pytest
from conftest import run_dmap

from dm_cli.planning.modes import Layout, Mode, Parallel, Strategy


def test_parallel_none_is_the_plans_split_layout_and_every_other_word_is_shared():
    assert Parallel.NONE.layout is Layout.SPLIT and Layout.SPLIT.choice is Parallel.NONE
    assert Parallel.AUTO.layout is None
    assert [layout.choice.layout for layout in Layout] == list(Layout)
    assert set(Parallel.words()) - set(Layout.words()) == {"none", "auto"}


def test_a_member_prints_and_serialises_as_its_word():
    assert f"{Mode.STAGED}" == str(Mode.STAGED) == "staged" and f"{Parallel.CFG_CONTEXT:>12}" == " cfg+context"
    assert json.dumps({"strategy": Strategy.BALANCED_LOW_0}) == '{"strategy": "balanced_low_0"}'


@pytest.mark.parametrize("command", ["plan", "run", "serve"])
@pytest.mark.parametrize("flag, word, allowed", [
    ("--mode", "fast", "auto, resident or staged"),
    ("--parallel", "tensor", "none, cfg, context, cfg+context, pipeline or auto"),
])
def test_a_word_outside_the_vocabulary_is_refused_while_parsing(command, flag, word, allowed):
    code, _, err = run_dmap(command, "no-such-source-anywhere", flag, word)
    message = err.strip().splitlines()[-1]
    assert code == 2 and message == f"Error: Invalid value for '{flag}': {flag} must be {allowed}, not '{word}'.", err


def test_plan_refuses_an_unknown_strategy_while_parsing():
    code, _, err = run_dmap("plan", "no-such-source-anywhere", "--strategy", "fastest")
    assert code == 2 and "--strategy must be auto, sequential, balanced or balanced_low_0, not 'fastest'." in err, err

"""The options table (dm_cli/run/options.py) walked over everything that takes options.

Every row is on `dmap plan`, `dmap run`, `dmap serve`, `dm_cli.plan`, `dm_cli.load` and a queue item, unless the
row says why not; and nothing takes an option the table does not hold. Read from what users meet: the click
commands Typer builds, the API functions' signatures and a queue item's JSON keys as `queue_item` accepts them.
Cheap: no model, no torch.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import typer.main

import dm_cli
from dm_cli.errors import UsageError
from dm_cli.run.options import OPTIONS, REQUIRED, TAKERS, option

COMMANDS = ("plan", "run", "serve")
API = {"api.plan": dm_cli.plan, "api.load": dm_cli.load}
# the API's keywords that are no option of the command line: callbacks (the CLI draws what they hear) and the
# families' own settings (`**settings`, dm_cli.families.Setting: test_family_settings.py walks those)
API_CALLBACKS = {"on_progress", "on_plan", "on_status"}


def _command(name: str):
    from dm_cli.cli import app
    from dm_cli.families import all_settings

    params = {p.name: p for p in typer.main.get_command(app).commands[name].params if p.name != "help"}
    return {k: p for k, p in params.items() if k not in all_settings()}


def test_every_row_says_why_each_taker_it_skips_does_not_take_it():
    for row in OPTIONS:
        assert set(row.without) <= set(TAKERS), f"{row.name}: unknown takers {set(row.without) - set(TAKERS)}"
        for taker, reason in row.without.items():
            assert isinstance(reason, str) and len(reason) > 10, f"{row.name} without {taker}: no reason given"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_takes_exactly_the_rows_that_do_not_say_why_not(command):
    params = _command(command)
    for row in OPTIONS:
        assert row.takes(command) == (row.name in params), (
            f"dmap {command} {'lacks' if row.takes(command) else 'takes'} {row.flags[0]}, "
            f"{'and the table says nothing of it' if row.takes(command) else 'yet the table says: ' + row.without[command]}")
    names = {row.name for row in OPTIONS}
    assert set(params) <= names, f"dmap {command} takes options the table lacks: {sorted(set(params) - names)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_parameter_reads_as_its_row(command):
    """Flags, help, default and bound as the row (its variant for this command) declares them."""
    for name, param in _command(command).items():
        row = option(name, command)
        if row.argument:
            assert param.param_type_name == "argument" and param.metavar == row.metavar
            assert param.required == (row.default is REQUIRED)
        else:
            flags = sorted(param.opts + param.secondary_opts)
            assert flags == sorted(f for spec in row.flags for f in spec.split("/")), f"{command} {name}: {flags}"
            assert param.default == row.default, f"dmap {command} {row.flags[0]}: default {param.default!r}"
            assert getattr(param, "min", None) == row.min, f"dmap {command} {row.flags[0]}: bound"
        assert param.help == row.help, f"dmap {command} {name}: help differs from the table's"


@pytest.mark.parametrize("taker", sorted(API))
def test_each_api_function_takes_exactly_the_rows_that_do_not_say_why_not(taker):
    keywords = set(inspect.signature(API[taker]).parameters) - {"settings"} - API_CALLBACKS
    for row in OPTIONS:
        assert row.takes(taker) == (row.api_name in keywords), (
            f"{API[taker].__name__}({row.api_name}=) {'missing' if row.takes(taker) else 'present'}: "
            + row.without.get(taker, "the table says nothing of it"))
    api_names = {row.api_name for row in OPTIONS}
    assert keywords <= api_names, f"keywords the table lacks: {sorted(keywords - api_names)}"


@pytest.mark.parametrize("taker", sorted(API))
def test_an_api_keyword_of_an_option_it_does_not_take_is_refused_with_the_tables_reason(taker):
    """Before this table, dm_cli.load(steps=30) said "Unknown setting 'steps'" and listed the families' settings."""
    for row in OPTIONS:
        if not row.takes(taker):
            with pytest.raises(UsageError) as refused:
                API[taker](None, **{row.api_name: None})
            assert row.without[taker] in str(refused.value), (row.name, str(refused.value))


def test_an_api_keyword_by_its_flags_name_names_the_keyword_to_give():
    with pytest.raises(UsageError, match="takes --frames as num_frames=, not frames="):
        dm_cli.load(None, frames=81)


def test_a_queue_item_takes_exactly_the_rows_that_do_not_say_why_not():
    from dm_cli.run.sessions.queue import queue_item

    for row in OPTIONS:
        data = {"prompt": "a cat", row.key_name: "a cat" if row.key_name == "prompt" else None}
        try:
            queue_item(data, 0, 0, "line 1")
            refusal = ""
        except UsageError as error:
            refusal = str(error)
        assert ("unknown key" in refusal) == (not row.takes("queue")), f"queue key {row.key_name!r}: {refusal}"


@pytest.mark.parametrize("taker", sorted(API))
def test_each_api_keywords_default_is_its_rows(taker):
    """dm_cli.plan's and dm_cli.load's defaults are the table's (its variant for the function), as the commands'
    are: a `--no-X` flag's keyword (check=, use_cache=) defaults to the flag's negation."""
    params = inspect.signature(API[taker]).parameters
    for row in OPTIONS:
        if not row.takes(taker):
            continue
        row = row.for_command(taker)
        negated = row.flags[0].startswith("--no-") and row.api_name != row.name
        expected = (not row.default) if negated else row.default
        got = params[row.api_name].default
        assert got == expected and type(got) is type(expected) or (got is None and expected is None), (
            f"{API[taker].__name__}({row.api_name}=) defaults to {got!r}, the table to {expected!r}")


def test_serve_defaults_are_the_tables():
    """dmap serve's defaults are declared once, in the table: the server's request takes them from there."""
    from dm_cli.serve.server import ServeRequest

    defaults = {f.name: f.default for f in fields(ServeRequest) if f.name != "run"}
    for name, default in defaults.items():
        row = option("model_name" if name == "model" else name, "serve")
        assert default == row.default, f"ServeRequest.{name} = {default!r}, the table's {row.flags[0]}: {row.default!r}"

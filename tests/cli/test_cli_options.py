"""Options that several commands take are declared once (the options table dm_cli/run/options.py, the aliases
dm_cli/cli/_cli_utils.py) and read the same everywhere.

`dmap plan --height` and `dmap run --height` are one option: same flags, same help. plan, run and serve take
them from the options table (`_cli_utils.table_options`), the other commands as `typing.Annotated` aliases from
`_cli_utils`, so a help text cannot be edited in one command and forgotten in the other. Checked here, cheaply
(no model, no torch): the click commands Typer builds, the rendered --help of each command, and the source of
dm_cli/cli/ (no shared flag is declared outside `_cli_utils.py` and the table).

A flag that means different things to different commands has variants, side by side in `_cli_utils`:
`--output` (a plan file, an image, a shard folder, a demo folder), `--seed` (of the image, of the random
weights), shard's `--dtype` (a conversion, not a compute dtype) and the SOURCE of run (a pipeline, the demo
without it) and shard (weights on disk). VARIANTS lists them; every other
shared option must read the same in every command that takes it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
import typer.main
from conftest import REPO, run_dmap

CLI = REPO / "dm_cli" / "cli"
ALIASES = CLI / "_cli_utils.py"
COMMANDS = ("inspect", "shard", "plan", "run", "cache", "demo")
# flag -> the commands whose text is their own (the other commands taking the flag share one text)
VARIANTS = {"--output": {"plan", "run", "shard", "demo"}, "--seed": {"run", "demo"}, "--dtype": {"shard"},
            "SOURCE": {"run", "shard"}, "--height": {"plan"}, "--parallel": {"plan"}, "--prompt": {"plan"}}


def _commands() -> dict:
    from dm_cli.cli import app

    group = typer.main.get_command(app)
    return {name: group.commands[name] for name in COMMANDS}


def _name(param) -> str:
    """An option by its long flag (`--max-memory`), an argument by its metavar (`SOURCE`).

    Typer builds on its own copy of click (typer._click), so parameters are told apart by their kind,
    not by click's classes."""
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    return max(param.opts, key=len)


def _params_by_name() -> dict[str, dict]:
    """name -> {command: its parameter} for every option and argument of every command."""
    found: dict[str, dict] = defaultdict(dict)
    for command, cmd in _commands().items():
        for param in cmd.params:
            if param.name != "help":
                found[_name(param)][command] = param
    return found


def _shared() -> dict[str, dict]:
    return {name: by_command for name, by_command in _params_by_name().items() if len(by_command) > 1}


def test_the_options_plan_and_run_share_are_the_ones_expected():
    """A guard on the test itself: if introspection found nothing, every check below would pass vacuously."""
    shared = {name for name, by_command in _shared().items() if {"plan", "run"} <= set(by_command)}
    assert {"--max-memory", "--mode", "--overhead", "--height", "--width", "--num-images", "--guidance-scale",
            "--max-sequence-length", "--frames", "--fps", "--dtype", "--weights", "--output", "--overwrite",
            "--json", "--quiet", "--binary"} <= shared


@pytest.mark.parametrize("name", sorted(_shared()))
def test_a_shared_option_has_one_help_text_and_the_same_flags(name):
    by_command = _shared()[name]
    own = VARIANTS.get(name, set())
    texts = {command: param.help for command, param in by_command.items() if command not in own}
    assert len(set(texts.values())) <= 1, f"{name} reads differently in {', '.join(texts)}: {texts}"
    flags = {command: sorted(getattr(param, "opts", [])) + sorted(getattr(param, "secondary_opts", []))
             for command, param in by_command.items()}
    assert len({tuple(f) for f in flags.values()}) == 1, f"{name} has other flags in other commands: {flags}"
    for command, param in by_command.items():
        assert param.help, f"dmap {command} {name} has no help text"


def _squeezed(text: str) -> str:
    """Text without whitespace: --help wraps lines (and breaks words at hyphens) by the column width."""
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("command", ["plan", "run", "inspect", "shard"])
def test_the_help_of_each_command_prints_the_shared_text(command):
    """What people read (`dmap COMMAND --help`) carries each shared option's one text, whole."""
    code, out, err = run_dmap(command, "--help")
    assert code == 0, err
    page = _squeezed(out)
    for name, by_command in _shared().items():
        if command in by_command:
            assert _squeezed(by_command[command].help) in page, f"dmap {command} --help: {name}'s text is not there"


def _flags_declared(path: Path) -> set[str]:
    """The flags and metavars of every typer.Option / typer.Argument call in a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("Option", "Argument")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "typer"):
            found |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
            found |= {kw.value.value for kw in node.keywords
                      if kw.arg == "metavar" and isinstance(kw.value, ast.Constant)}
    return {flag for value in found for flag in value.split("/")}  # "--resume/--no-resume"


def _flags_in_the_table() -> set[str]:
    """The flags (an argument: its metavar) of the options table the aliases and plan/run/serve are made from."""
    from dm_cli.run.options import OPTIONS

    return {flag for row in OPTIONS for flags in row.flags for flag in flags.split("/")}


def test_shared_options_are_declared_only_in_the_aliases_module():
    from dm_cli.families import all_settings

    # a family's own settings are declared once too, in their family's module (dm_cli.families.Setting); the options
    # of plan, run and serve in the options table (dm_cli.run.options), which the aliases module turns into Typer's
    shared = set(_shared()) - {setting.flag for setting in all_settings().values()}
    declared = _flags_declared(ALIASES) | _flags_in_the_table()
    assert shared <= declared, f"declared elsewhere only: {sorted(shared - declared)}"
    for path in sorted(CLI.glob("*.py")):
        if path != ALIASES:
            again = shared & _flags_declared(path)
            assert not again, f"{path.relative_to(REPO)} declares {sorted(again)} again: use the _cli_utils alias"


def test_every_alias_is_used_by_a_command():
    """No dead aliases: an option nobody takes would still read as a promise of the CLI."""
    tree = ast.parse(ALIASES.read_text(encoding="utf-8"))
    aliases = {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
               if isinstance(target, ast.Name) and not target.id.startswith("_")}
    used = set()
    for path in CLI.glob("*.py"):
        if path != ALIASES:
            used |= {alias.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.ImportFrom) and node.module == "dm_cli.cli._cli_utils"
                     for alias in node.names}
    assert aliases and aliases <= used, f"unused: {sorted(aliases - used)}"

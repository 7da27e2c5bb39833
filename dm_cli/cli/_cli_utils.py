"""The options and arguments that more than one command takes, each declared once.

The options of `dmap plan`, `dmap run` and `dmap serve` are rows of one table, `dm_cli.run.options.OPTIONS` (flag,
type, default, help, parser, who takes it): `table_options(COMMAND)` gives a command function its Typer parameters
from it, and the other commands take the rows they share as the aliases below (`table_annotation`). Where one flag
means different things to different commands (`--output` is a plan file for `plan`, an image for `run`, a folder
for `shard` and `demo`), the other commands' variants are declared here side by side, each with the text true for
its command (`tests/cli/test_cli_options.py` checks that a shared flag reads the same everywhere else).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated

import typer

from dm_cli.families import all_settings
from dm_cli.planning.modes import Word
from dm_cli.run.options import REQUIRED, option
from dm_cli.units import shorten


def word_parser(vocabulary: type[Word], flag: str):
    """Typer's parser for an option that takes one of a mode's words (dm_cli.planning.modes): the member, or one
    sentence naming them all, while the command line is parsed (Typer's own Enum message is two)."""
    def parse(text: str) -> Word:
        try:
            return vocabulary(text)
        except ValueError:
            words = vocabulary.words()
            raise typer.BadParameter(f"{flag} must be {', '.join(words[:-1])} or {words[-1]}, not "
                                     f"{shorten(text, quote=True)}.") from None

    return parse


# ---- the options of plan, run and serve (dm_cli.run.options), as Typer annotations ---------------------------


def table_annotation(name: str, command: str | None = None):
    """The Typer annotation of the table's option `name` (dm_cli.run.options.OPTIONS) as `command` declares it:
    its flags, help, metavar, bound, envvar and, for a mode's words, `word_parser`."""
    row = option(name, command)
    if row.argument:
        return Annotated[row.type, typer.Argument(metavar=row.metavar, help=row.help)]
    extra: dict = {"metavar": row.metavar} if row.metavar else {}
    if row.min is not None:
        extra["min"] = row.min
    if row.words is not None:
        extra["parser"] = word_parser(row.words, row.flags[0])
    if row.envvar:
        extra.update(envvar=row.envvar, show_envvar=True)
    return Annotated[row.type, typer.Option(*row.flags, help=row.help, **extra)]


def table_options(command: str):
    """`dmap COMMAND`'s function with its parameters (all but `ctx` and `settings`, in its own order: the order of
    its --help) given their flags and help from the options table. Each is declared with its type and default, so
    the signature reads as the command takes it; both are checked against the table here, at import, so they cannot
    drift from it (`declared_as_table`)."""
    def declare(function):
        hints = typing.get_type_hints(function, include_extras=True)
        params = []
        for param in inspect.signature(function).parameters.values():
            if param.name in ("ctx", "settings"):
                params.append(param.replace(annotation=hints.get(param.name, param.annotation)))
                continue
            declared_as_table(command, param.name, hints.get(param.name), param.default)
            params.append(param.replace(annotation=table_annotation(param.name, command)))
        function.__signature__ = inspect.Signature(params, return_annotation=inspect.Signature.empty)
        function.__annotations__ = {p.name: p.annotation for p in params}
        function.table_command = command
        return function

    return declare


def declared_as_table(command: str, name: str, declared_type, declared_default) -> None:
    """A command parameter's declared type and default are its row's (its variant for `command`): a TypeError at
    import names the difference (a programming error, caught by any test that imports the CLI)."""
    row = option(name, command)
    default = REQUIRED if declared_default is inspect.Parameter.empty else declared_default
    if declared_type != row.type or type(default) is not type(row.default) or default != row.default:
        raise TypeError(f"dmap {command}'s {name} is declared {declared_type} = {default!r}, but the options table "
                        f"(dm_cli.run.options) has {row.type} = {row.default!r}.")


# the table's options that other commands (inspect, shard, cache, calibrate, demo) take as they are
SourceArg = table_annotation("source", "plan")
"""`dmap plan` and `dmap inspect`: anything dmap can read a model from."""
ComponentOpt = table_annotation("component")
DtypeOpt = table_annotation("dtype")
"""The compute dtype `inspect` sizes at and `plan` and `run` plan and run at."""
WeightsOpt = table_annotation("weights")
OverwriteOpt = table_annotation("overwrite")
JsonOpt = table_annotation("as_json")
QuietOpt = table_annotation("quiet")
BinaryOpt = table_annotation("binary")
NoCacheOpt = table_annotation("no_cache")
PipelineOpt = table_annotation("pipeline")

# ---- the variants of other commands (a flag that means something else there) -------------------------------

ShardSourceArg = Annotated[str, typer.Argument(
    metavar="SOURCE", help="Pipeline/component folder, .safetensors or .bin file, or index JSON (--to-diffusers: a "
                           "single .safetensors or .gguf file).")]
"""`dmap shard`: weights on disk (no presets or Hub ids: there is nothing to rewrite)."""

ShardDtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="Convert floating tensors to bf16|fp16|fp32, or fp8: the layers layerwise casting stores in "
                    "float8_e4m3fn (norms, embeddings, modulation and a pipeline's VAE keep their dtype).")]
"""`dmap shard`: a conversion of the files written, not a compute dtype."""

ProfileOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Write the profile here (default: dmap's cache, which dmap plan reads).")]

ProfileOverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace the -o file if it exists (a file only, never a folder). The profile in dmap's cache "
                        "(no -o) is always replaced.")]
"""`dmap calibrate`: its one output is a profile file."""

ShardOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Folder to create (default: SOURCE-sharded beside it).")]

DemoOutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="The pipeline folder to write (a new folder, or --overwrite; default: PRESET, here).")]

DemoSeedOpt = Annotated[int, typer.Option(
    "--seed", help="Seed of the random weights (same seed and library versions, same bytes).")]


# ---- the families' own settings (dm_cli.families.Setting) -----------------------------------------

_WITH_SETTINGS: list = []  # the commands wrapped by with_family_settings, refreshed by refresh_family_options


def with_family_settings(command):
    """`command(..., settings: dict)` as a Typer command with one option per setting the registered families
    declare (`--true-cfg-scale`, `--guidance-scale-2`, ...) in place of `settings`: a family's new setting
    becomes an option of `dmap plan` and `dmap run` with no edit here."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        settings = {name: kwargs.pop(name) for name in list(kwargs) if name in all_settings()}
        return command(*args, settings={k: v for k, v in settings.items() if v is not None}, **kwargs)

    wrapper.__wrapped_command__ = command
    _WITH_SETTINGS.append(wrapper)
    _refresh(wrapper)
    return wrapper


def refresh_family_options() -> None:
    """The settings options as the family registry has them now (a test may register a family)."""
    for wrapper in _WITH_SETTINGS:
        _refresh(wrapper)


def _refresh(wrapper) -> None:
    command = wrapper.__wrapped_command__
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(command).parameters.values() if p.name != "settings"]
    extra = [inspect.Parameter(s.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                               annotation=Annotated[s.type | None, typer.Option(s.flags, help=s.help)])
             for s in all_settings().values()]
    wrapper.__signature__ = inspect.Signature(own + extra, return_annotation=inspect.Signature.empty)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}

"""docs/commands.md cannot drift from the options: every flag of every command is on the page, and the page names
no `--flag` that no command has.

Two sources are walked: the options table (dm_cli/run/options.py `OPTIONS`: each row's flags, for each of plan, run
and serve that takes it, `Option.takes`), and each command's `--help` (in-process, `run_dmap`: the flags Typer
really declares, calibrate's, inspect's, shard's, cache's and demo's included). A flag counts as named when it stands
on the page as a word of its own (`--max-memory`, not inside `--max-memory-x`). The other way, every `--flag` the page
writes must be a flag of some command (or of `dmap` itself, e.g. `--debug`), except the few in NOT_DMAP: another
tool's flags the page quotes (torchrun, SLURM, the benchmark scripts), each with its reason.
"""

from __future__ import annotations

import re
from functools import lru_cache

import pytest
from conftest import REPO, run_dmap

PAGE = REPO / "docs" / "commands.md"
COMMANDS = ("plan", "run", "serve", "calibrate", "inspect", "shard", "cache", "demo")
TABLE_COMMANDS = ("plan", "run", "serve")  # the takers of OPTIONS that are commands

LONG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
# an option's line in Typer's plain help: "  -m, --max-memory <str>  ...", "  --resume / --no-resume", "  --json  ..."
OPTION_LINE = re.compile(r"^ {2}(?:(-[a-zA-Z]), )?(--[a-z][a-z0-9-]*)(?: / (--[a-z][a-z0-9-]*))?(?:\s|$)")
HELP_FLAGS = {"--help", "-h"}  # every command's; the page says it once, not per command

NOT_DMAP = {
    "--nproc-per-node": "torchrun's: the launches the page shows",
    "--nnodes": "torchrun's: a multi-node launch",
    "--rdzv-backend": "torchrun's: a multi-node launch",
    "--rdzv-endpoint": "torchrun's: a multi-node launch",
    "--rdzv-id": "torchrun's: a multi-node launch",
    "--standalone": "torchrun's: a one-node launch",
    "--nodes": "SLURM's (#SBATCH) in the multi-node script",
    "--ntasks-per-node": "SLURM's (#SBATCH) in the multi-node script",
    "--gpus-per-node": "SLURM's (#SBATCH) in the multi-node script",
    "--cpus-per-task": "SLURM's (#SBATCH) in the multi-node script",
    "--flops": "scripts/bench_cache.py's, where the page quotes its FLOP counts",
    "--cpu-offload": "diffusers-cli run's, in the page's comparison with it",
    "--context-parallel": "diffusers-cli run's, in the page's comparison with it",
    "--attention-backend": "diffusers-cli run's, in the page's comparison with it",
    "--vae-tiling": "diffusers-cli run's, in the page's comparison with it",
    "--vae-slicing": "diffusers-cli run's, in the page's comparison with it",
    "--remote": "diffusers-cli run's, in the page's comparison with it",
    "--sections": "scripts/gpu_check.py's, where the page points at its NF4 measurement",
}


def flags_in_help(text: str) -> set[str]:
    """The flags a command's plain `--help` declares, short and long, `--x / --no-x` pairs both."""
    found = set()
    for line in text.splitlines():
        match = OPTION_LINE.match(line)
        if match:
            found |= {flag for flag in match.groups() if flag}
    return found - HELP_FLAGS


def named(flag: str, text: str) -> bool:
    """Whether `flag` stands on the page as a word of its own."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


@lru_cache(maxsize=None)
def help_of(*command: str) -> str:
    code, out, err = run_dmap(*command, "--help", env={"COLUMNS": "100"})
    assert code == 0, (command, err)
    return out


@lru_cache(maxsize=None)
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def dmap_flags() -> set[str]:
    """Every flag of every command, and the ones `dmap` itself takes (its help names `--debug` in a sentence)."""
    return {flag for command in COMMANDS for flag in flags_in_help(help_of(command))} | set(LONG.findall(help_of()))


def test_the_help_parser_finds_short_long_and_paired_flags():
    text = ("Options:\n  -m, --max-memory <str>  Devices, e.g. 0=16GB (see\n                          --overhead).\n"
            "  --resume / --no-resume  Skip done items.\n  --json                  JSON.\n"
            "  -h, --help              Show this message and exit.\n")
    assert flags_in_help(text) == {"-m", "--max-memory", "--resume", "--no-resume", "--json"}
    assert named("--max-memory", "`-m, --max-memory SPEC`") and not named("--max", "`--max-memory`")
    assert LONG.findall("`--no-` wrapped, --x-y, ---z, a--b") == ["--x-y"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_the_command_is_on_the_page(command):
    flags = flags_in_help(help_of(command))
    assert flags, f"dmap {command} --help lists no options: the parser no longer reads Typer's help"
    missing = sorted(flag for flag in flags if not named(flag, page()))
    assert not missing, f"docs/commands.md does not name these flags of `dmap {command}`: {missing}"


def test_every_row_of_the_options_table_is_on_the_page_and_in_the_help():
    from dm_cli.run.options import OPTIONS

    missing, undeclared = [], []
    for row in OPTIONS:
        for command in TABLE_COMMANDS:
            declared = row.for_command(command)
            if declared.argument or not declared.takes(command):
                continue
            for flag in (part.strip() for flags in declared.flags for part in flags.split("/")):  # --x/--no-x
                if not named(flag, page()):
                    missing.append(f"{command} {flag}")
                if flag not in flags_in_help(help_of(command)):
                    undeclared.append(f"{command} {flag}")
    assert not missing, f"docs/commands.md does not name these options of the table: {missing}"
    assert not undeclared, f"rows of the options table missing from the command's --help: {undeclared}"


def test_the_page_names_no_flag_that_no_command_has():
    known = dmap_flags()
    stale = sorted(flag for flag in set(LONG.findall(page())) - known if flag not in NOT_DMAP)
    assert not stale, (f"docs/commands.md names flags no dmap command has: {stale} (a renamed or removed option? "
                       "another tool's flag goes in NOT_DMAP, with its reason)")


def test_the_exceptions_are_still_needed_and_not_dmap_flags():
    known = dmap_flags()
    assert not set(NOT_DMAP) & known, "a flag in NOT_DMAP is a dmap flag now: drop it from the list"
    unused = sorted(flag for flag in NOT_DMAP if not named(flag, page()))
    assert not unused, f"NOT_DMAP lists flags the page no longer names: {unused}"

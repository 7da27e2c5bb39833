"""The `dmap` command line: Typer lives here and nowhere else.

Each subcommand is one module that parses options, calls one core function and hands the result
to the renderer (or prints JSON). Heavy imports stay inside the command functions so that
`dmap --help` never imports torch.
"""

from __future__ import annotations

import gc
import sys

import typer

from dm_cli.cli import cache as cache_command
from dm_cli.cli import calibrate as calibrate_command
from dm_cli.cli import demo as demo_command
from dm_cli.cli import inspect as inspect_command
from dm_cli.cli import plan as plan_command
from dm_cli.cli import run as run_command
from dm_cli.cli import serve as serve_command
from dm_cli.cli import shard as shard_command
from dm_cli.cli._cli_utils import refresh_family_options, with_family_settings
from dm_cli.cli._errors import EXIT_INTERRUPTED, click_exception_types, report_error, torchrun_rank_prefix
from dm_cli.version import __version__

app = typer.Typer(
    name="dmap",
    help="Plan, shard and run big diffusion models across GPUs, CPU and disk. Add --debug anywhere to see the traceback of an error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: Rich's help renderer alone costs ~0.1 s of start-up
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"dmap {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """dmap: inspect, shard, plan and run diffusion pipelines on several devices.

    Add --debug anywhere to see the traceback of an error.
    """


app.command("inspect", help=inspect_command.__doc__)(inspect_command.inspect)
app.command("shard", help=shard_command.__doc__)(shard_command.shard)
app.command("plan", help=plan_command.__doc__)(with_family_settings(plan_command.plan))
app.command("run", help=run_command.__doc__)(with_family_settings(run_command.run))
app.command("serve", help=serve_command.__doc__)(with_family_settings(serve_command.serve))
app.command("cache", help=cache_command.__doc__)(cache_command.cache)
app.command("demo", help=demo_command.__doc__)(demo_command.demo)
app.command("calibrate", help=calibrate_command.__doc__)(calibrate_command.calibrate)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: errors become one sentence and an exit code (tracebacks with --debug).

    As the process's entry point (`dmap`, `python -m dm_cli`: no `argv`), everything alive when the command ends
    is frozen out of the garbage collector (`_exiting`) before the interpreter tears down."""
    if argv is not None:
        _main(list(argv))
        return
    try:
        _main(sys.argv[1:])
    finally:
        _exiting()


def _exiting() -> None:
    """The process ends now: whatever is alive dies with it. Python's teardown runs full collections while it
    clears the modules, and after a run torch, diffusers and transformers leave their ~450k tracked objects for
    each of them to walk: 0.84 s of CPU after a `dmap run` on one core (0.77 s after a script calling diffusers
    itself), 0.15 s frozen (scripts/bench_run.py --case sd15-mid). Frozen, they are skipped: reference counting
    still frees what it frees, atexit handlers and weakref.finalize still run, the standard streams are still
    flushed; only cycles stay where they are until the OS takes the memory back. Only here, never for a caller
    of `main(argv)` (tests, the API), whose process goes on."""
    gc.freeze()


def _main(args: list[str]) -> None:
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    click_error, no_args_is_help = click_exception_types()
    refresh_family_options()  # the families registered now (a test may add one) give dmap plan/run their options
    try:
        result = app(args=args, prog_name="dmap", standalone_mode=False)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except (typer.Abort, KeyboardInterrupt) as error:
        sys.exit(report_error(KeyboardInterrupt() if isinstance(error, typer.Abort) else error, debug))
    except no_args_is_help as error:  # `dmap` alone (or a group without a command): the help, exit 0
        print(error.ctx.get_help())
        sys.exit(0)
    except click_error as error:  # usage errors: click's usage line, its message and hints, exit 2
        prefix = torchrun_rank_prefix(error.exit_code)
        if prefix is None:
            error.show()
        else:  # every rank parsed the same command: one line of this rank's
            print(f"{prefix}Error: {error.format_message()}", file=sys.stderr)
        sys.exit(error.exit_code)
    except Exception as error:  # noqa: BLE001 - every error ends in one sentence and an exit code
        sys.exit(report_error(error, debug))
    if result == EXIT_INTERRUPTED:  # typer turns Ctrl-C into a silent return of 130; no command returns it
        sys.exit(report_error(KeyboardInterrupt(), debug))
    sys.exit(result if isinstance(result, int) else 0)

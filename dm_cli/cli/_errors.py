"""Turn exceptions into one sentence on stderr and the exit code docs/CONTRACTS.md gives them."""

from __future__ import annotations

import os
import sys
import time
import traceback

from dm_cli.cli._output import say
from dm_cli.errors import EXIT_INTERNAL, EXIT_USAGE, DiskFullError, DmapError
from dm_cli.render import plain

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def click_exception_types() -> tuple[type, type]:
    """(ClickException, NoArgsIsHelpError) as the click that typer really uses defines them.

    typer 0.29 vendors its own copy of click (`typer._click`), so `click.ClickException` from the
    separately installed click never matches what typer raises. typer's public BadParameter is
    a subclass of the right ClickException: take the classes from its module.
    """
    import typer  # lazy: typer

    click_exception = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    module = sys.modules[click_exception.__module__]
    no_args = getattr(module, "NoArgsIsHelpError", None) or type("NoArgsIsHelpError", (Exception,), {})
    return click_exception, no_args


def usage_error(message: str, ctx) -> Exception:
    """A click usage error for `ctx`'s command: main() prints its usage line and the message, exit 2."""
    click_exception, _ = click_exception_types()
    return sys.modules[click_exception.__module__].UsageError(message, ctx=ctx)


# Under torchrun, how long a rank other than 0 keeps a usage error to itself: every rank checks the same command, so
# rank 0 says it and exits 2, and torchrun then stops the others (SIGTERM) before they repeat it. A rank whose error
# is its own (rank 0 has none) says it after this wait, prefixed with its rank.
RANK_0_FIRST_S = 10.0


def torchrun_rank_prefix(exit_code: int) -> str | None:
    """None: say the error now, as one process does. Otherwise (a usage error on a torchrun rank other than 0) the
    wait above has passed without torchrun stopping this rank, and the "[rank r/N] " its line starts with."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if exit_code != EXIT_USAGE or "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's own launch only
        return None
    if not (rank.isdecimal() and world.isdecimal() and len(rank + world) < 20 and 0 < int(rank) < int(world)):
        return None

    deadline = time.monotonic() + RANK_0_FIRST_S
    while time.monotonic() < deadline:
        try:
            time.sleep(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            break
    return f"[rank {rank}/{world}] "


def _say(message: str) -> None:
    """One message on stderr, wrapped at spaces on a terminal (`_output.say`)."""
    say(message, sys.stderr)


def report_error(error: BaseException, debug: bool) -> int:
    """Print the error the way a user should see it and return the exit code."""
    if debug:
        traceback.print_exception(error)

    if isinstance(error, DmapError):
        prefix = torchrun_rank_prefix(error.exit_code) or ""
        _say(f"{prefix}Error: {plain(error, keep_newlines=True)}")
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        _say("Interrupted: stopped before finishing; nothing was left half-written (outputs are only renamed "
             "into place when complete).")
        return EXIT_INTERRUPTED
    full = DiskFullError.of(error)  # raised where no writer of dmap's said it in its own words (a library, a thread)
    if full is not None:
        _say(f"Error: {plain(full, keep_newlines=True)}")
        return full.exit_code
    if isinstance(error, MemoryError):
        _say("Error: out of host memory.")
        return EXIT_INTERNAL
    name = type(error).__name__
    _say(f"Internal error ({name}: {plain(error, keep_newlines=True)}). Rerun with --debug for the traceback and report it.")
    return EXIT_INTERNAL

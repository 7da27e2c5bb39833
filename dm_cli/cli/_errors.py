"""Turn exceptions into one sentence on stderr and the exit code DESIGN.md gives them."""

from __future__ import annotations

import sys
import traceback

from ..errors import EXIT_INTERNAL, DmapError


def report_error(error: BaseException, debug: bool) -> int:
    """Print the error the way a user should see it and return the exit code."""
    if debug:
        traceback.print_exception(error)
    from ..render import plain  # messages quote names read from files: never raw escapes on a terminal

    if isinstance(error, DmapError):
        print(f"Error: {plain(error, keep_newlines=True)}", file=sys.stderr)
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        print("Interrupted: nothing was left half-written.", file=sys.stderr)
        return 130
    if isinstance(error, MemoryError):
        print("Error: out of host memory.", file=sys.stderr)
        return EXIT_INTERNAL
    name = type(error).__name__
    print(f"Internal error ({name}: {plain(error, keep_newlines=True)}). Rerun with --debug for the traceback and report it.", file=sys.stderr)
    return EXIT_INTERNAL

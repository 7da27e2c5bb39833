"""Rich rendering: tables, trees, bars and progress for people. The only package that imports Rich.

One module per command; shared helpers here.
"""

from __future__ import annotations

import os
import sys


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Tables are wide: give them room when piped (Rich assumes 80 columns off a terminal).
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 140
    return Console(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, width=width)



def num(n: int) -> str:
    return f"{n:,}"

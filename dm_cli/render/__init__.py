"""Rich rendering: tables, trees, bars and progress for people. The only package that imports Rich.

One module per command; shared helpers here.
"""

from __future__ import annotations

import os
import re
import sys

# C0 and C1 control characters, DEL, and the Unicode bidi overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def plain(text, keep_newlines: bool = False) -> str:
    """Text that came from a file, made inert for a terminal: control characters shown as `\\xNN`.

    An escape sequence in a class or tensor name could otherwise set the window title, clear the
    screen or hide what follows. Used for error messages too (`keep_newlines` for those).
    """
    text = str(text)

    def show(match: re.Match) -> str:
        char = match.group(0)
        if keep_newlines and char in "\n\t":
            return char
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _CONTROL.sub(show, text)


def safe(text) -> str:
    """`plain` plus Rich markup escaped: what every renderer passes file-borne strings through."""
    from rich.markup import escape

    return escape(plain(text))


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Tables are wide: give them room when piped (Rich assumes 80 columns off a terminal).
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 140
    return Console(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, width=width)



def num(n: int) -> str:
    return f"{n:,}"

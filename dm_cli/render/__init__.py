"""Rich rendering: tables, trees, bars and progress for people. The only package that imports Rich.

One module per command; shared helpers here. Every cell and title is plain text (never Rich
markup): names from model files are shown as they are (`[no-split]`, brackets in tensor names),
except control characters, which `plain` shows as `\\x1b` (the console and tables apply it).
Tables fit the console: numbers are never cut or wrapped; when the table is too wide, the least
important columns are dropped (and the output says which), text columns wrap.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

TEXT_MIN_WIDTH = 8  # a wrapping text column keeps at least this many characters per line
OPTIONAL = 3  # columns with Col.drop >= OPTIONAL are dropped before any other column wraps

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


def _inert(renderable):
    """A string or Text with control characters made visible (`plain`); other renderables as they are."""
    from rich.text import Text

    if isinstance(renderable, str):
        return plain(renderable)
    if isinstance(renderable, Text) and _CONTROL.search(renderable.plain):
        return Text(plain(renderable.plain), style=renderable.style)
    return renderable


_CONSOLE_CLASS = None


def _console_class():
    """Rich's Console whose print() passes every string and Text through `_inert`: the one place
    where file-borne text is made safe for the terminal, whatever the renderer prints."""
    global _CONSOLE_CLASS
    if _CONSOLE_CLASS is None:
        from rich.console import Console

        class InertConsole(Console):
            def print(self, *objects, **kwargs):
                super().print(*(_inert(o) for o in objects), **kwargs)

        _CONSOLE_CLASS = InertConsole
    return _CONSOLE_CLASS


def console(stderr: bool = False):
    """Rich's console: the terminal's width (read from stdin/stdout/stderr or COLUMNS), else 80.

    Markup is off: text from model files and paths prints as it is; styles come from Text and style=.
    Control characters in what is printed are shown escaped (`plain`), never sent to the terminal.
    """
    return _console_class()(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, markup=False)


def status(message: str, enabled: bool = True):
    """A spinner with `message` on stderr while a long step runs (nothing when stderr is not a terminal)."""
    import contextlib

    if not enabled or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return console(stderr=True).status(message, spinner="dots")


def num(n: int) -> str:
    return f"{n:,}"


@dataclass
class Col:
    """One table column. `number`: never wrapped or cut. `drop`: 0 never dropped; higher goes first;
    OPTIONAL and above go before other columns wrap."""

    header: str
    number: bool = False
    drop: int = 0
    justify: str | None = None
    name: str | None = None  # how the "hidden" note calls it (default: the header)


def fitted_table(out, title: str | None, columns: list[Col], rows: list[list[str] | None]):
    """A Rich Table of plain-text cells that fits `out.width`; rows of None are section breaks.

    Returns (table, names of the columns dropped to fit).
    """
    from rich.table import Table
    from rich.text import Text

    rows = [None if r is None else [_inert(c) if isinstance(c, Text) else plain(c) for c in r] for r in rows]
    title = plain(title) if title else title
    data = [r for r in rows if r is not None]
    keep = list(range(len(columns)))

    def need(i: int) -> int:
        col = columns[i]
        cells = [len(str(r[i])) for r in data]
        header_words = max((len(w) for w in col.header.split()), default=0)
        widest = max(cells + [header_words])
        return widest if col.number else min(max(cells + [len(col.header)]), TEXT_MIN_WIDTH)

    def natural(i: int) -> int:
        return max([len(str(r[i])) for r in data] + [len(columns[i].header)])

    def total(indices: list[int], width) -> int:
        return sum(width(i) for i in indices) + 3 * len(indices) + 1  # padding and borders

    dropped: list[int] = []
    # optional columns go before anything wraps; then the others, only when wrapping is not enough
    for min_drop, width in ((OPTIONAL, natural), (1, need)):
        while total(keep, width) > out.width:
            candidates = [i for i in keep if columns[i].drop >= min_drop]
            if not candidates:
                break
            worst = max(candidates, key=lambda i: (columns[i].drop, i))
            keep.remove(worst)
            dropped.append(worst)
    table = Table(title=Text(title) if title else None, title_justify="left")
    for i in keep:
        col = columns[i]
        justify = col.justify or ("right" if col.number else "left")
        if col.number:
            table.add_column(Text(col.header), justify=justify, no_wrap=True, min_width=need(i))
        else:
            table.add_column(Text(col.header), justify=justify, overflow="fold")
    for row in rows:
        if row is None:
            table.add_section()
        else:
            table.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in (row[i] for i in keep)))
    return table, [columns[i].name or columns[i].header for i in sorted(dropped)]


def print_table(out, title: str | None, columns: list[Col], rows: list[list[str] | None]) -> list[str]:
    """Print a fitted table and, when columns were dropped, one line naming them (returned too)."""
    table, dropped = fitted_table(out, title, columns, rows)
    out.print(table)
    if dropped:
        out.print(f"(hidden at {out.width} columns: {', '.join(dropped)}; see --json)", style="dim")
    return dropped

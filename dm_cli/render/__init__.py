"""Rich rendering: tables, trees, bars and progress for people. The only package that imports Rich.

One module per command; shared helpers here. Every cell and title is plain text (never Rich
markup): names from model files are shown as they are (`[no-split]`, brackets in tensor names),
except control characters, which `plain` shows as `\\x1b` (the console and tables apply it).
Tables fit the console: numbers are never cut or wrapped; when the table is too wide, the least
important columns are dropped (and the output says which), text columns wrap.
"""

from __future__ import annotations

import contextlib
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
    from rich.text import Text  # lazy: rich only when drawing

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
        from rich.console import Console  # lazy: rich only when drawing

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
    if not enabled or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return console(stderr=True).status(message, spinner="dots")


def num(n: int) -> str:
    return f"{n:,}"


@dataclass
class Col:
    """One table column. `number`: never wrapped or cut. `drop`: 0 never dropped; higher goes first;
    OPTIONAL and above go before other columns wrap. `stretch` (min, max): a picture column (a bar)
    whose cells are callables width -> Text, drawn as wide as the room left allows."""

    header: str
    number: bool = False
    drop: int = 0
    justify: str | None = None
    name: str | None = None  # how the "hidden" note calls it (default: the header)
    stretch: tuple[int, int] | None = None
    atoms: str | None = None  # cells are items joined by this (", "): lines break only between items


def _lines(cell) -> list[str]:
    text = cell.plain if hasattr(cell, "plain") else str(cell)
    return text.split("\n")


def _longest_word(texts) -> int:
    return max((len(word) for text in texts for line in _lines(text) for word in line.split()), default=0)


def fitted_table(out, title: str | None, columns: list[Col], rows: list[list[str] | None]):
    """A Rich Table of plain-text cells that fits `out.width`; rows of None are section breaks.

    Text wraps at spaces only: a text column is never narrower than its longest word (a class or module
    name stays whole), so columns are dropped, least important first, before a word would be cut; only
    when nothing is left to drop are words folded. Returns (table, names of the columns dropped to fit).
    """
    from rich.text import Text  # lazy: rich only when drawing

    rows = [None if r is None else [c if callable(c) else _inert(c) if isinstance(c, Text) else plain(c) for c in r]
            for r in rows]
    title = plain(title) if title else title
    sizes = _ColumnSizes(columns, [r for r in rows if r is not None])
    keep, dropped = _drop_to_fit(sizes, out.width)
    widths = _fit_widths(sizes, keep, out.width)
    table = _build_table(title, columns, rows, keep, widths)
    return table, [columns[i].name or columns[i].header for i in sorted(dropped)]


@dataclass
class _ColumnSizes:
    """The natural and the narrowest width of each column of one table's cells, in one place, so that
    dropping columns and shrinking the kept ones measure them the same way."""

    columns: list[Col]
    data: list[list]  # the rows without section breaks

    def cells(self, i: int) -> list:
        return [r[i] for r in self.data if not callable(r[i])]

    def atoms_width(self, i: int) -> int:
        sep = self.columns[i].atoms
        return max((len(atom) + len(sep.rstrip()) for c in self.cells(i) for atom in str(c).split(sep)), default=0)

    def natural(self, i: int) -> int:
        col = self.columns[i]
        if col.stretch:
            return col.stretch[0]
        return max([len(line) for c in self.cells(i) for line in _lines(c)] + [len(col.header)])

    def minimum(self, i: int) -> int:
        col = self.columns[i]
        if col.stretch:
            return col.stretch[0]
        header_word = _longest_word([col.header])
        if col.atoms:
            return max(self.atoms_width(i), header_word)
        if col.number:
            return max([len(line) for c in self.cells(i) for line in _lines(c)] + [header_word])
        return max(_longest_word(self.cells(i)), header_word, min(self.natural(i), TEXT_MIN_WIDTH))


def _total(indices: list[int], width) -> int:
    return sum(width(i) for i in indices) + 3 * len(indices) + 1  # padding and borders


def _drop_to_fit(sizes: _ColumnSizes, room: int) -> tuple[list[int], list[int]]:
    """(kept, dropped) column indices: optional columns go before anything wraps; then the others, only
    when wrapping at spaces is not enough (a number or a whole word matters more than a column)."""
    columns = sizes.columns
    keep = list(range(len(columns)))
    dropped: list[int] = []
    for min_drop, width in ((OPTIONAL, sizes.natural), (1, sizes.minimum)):
        while _total(keep, width) > room:
            candidates = [i for i in keep if columns[i].drop >= min_drop]
            if not candidates:
                break
            worst = max(candidates, key=lambda i: (columns[i].drop, i))
            keep.remove(worst)
            dropped.append(worst)
    return keep, dropped


def _fit_widths(sizes: _ColumnSizes, keep: list[int], width: int) -> dict[int, int]:
    """The width of each kept column: text columns shrink (widest first) to the room, stretch columns
    (bars) take what is left; numbers never shrink, so they are never cut or wrapped."""
    columns = sizes.columns
    widths = {i: sizes.natural(i) for i in keep}
    floor = {i: sizes.minimum(i) for i in keep}
    room = width - (3 * len(keep) + 1)
    texts = [i for i in keep if not columns[i].number and not columns[i].stretch]
    # wrap the widest text column first, never below its longest word ...
    while sum(widths.values()) > room:
        shrinkable = [i for i in texts if widths[i] > floor[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
    # ... and only as the last resort fold words (nothing left to drop)
    while sum(widths.values()) > room:
        shrinkable = [i for i in texts if widths[i] > 1]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    for i in keep:
        if columns[i].stretch:
            widths[i] = max(1, min(columns[i].stretch[1], widths[i] + room - sum(widths.values())))
    return widths


def _build_table(title: str | None, columns: list[Col], rows: list, keep: list[int], widths: dict[int, int]):
    """The Rich Table of the kept columns at their fitted widths: numbers and bars never wrap, text folds
    only what is wider than its column; callable cells (bars) are drawn at their column's width."""
    from rich.table import Table  # lazy: rich only when drawing
    from rich.text import Text  # lazy: rich only when drawing

    table = Table(title=Text(title) if title else None, title_justify="left")
    for i in keep:
        col = columns[i]
        justify = col.justify or ("right" if col.number else "left")
        if col.number or col.stretch:
            table.add_column(Text(col.header), justify=justify, no_wrap=True, width=widths[i])
        else:
            table.add_column(Text(col.header), justify=justify, overflow="fold", width=widths[i])
    for row in rows:
        if row is None:
            table.add_section()
        else:
            table.add_row(*(cell(widths[i]) if callable(cell) else cell if isinstance(cell, Text)
                            else Text(_wrap_atoms(str(cell), columns[i].atoms, widths[i]) if columns[i].atoms else str(cell))
                            for i, cell in ((i, row[i]) for i in keep)))
    return table


def _wrap_atoms(text: str, sep: str, width: int) -> str:
    """`a, b, c` as lines of at most `width` that break only between items (`GPU 0,` / `GPU 1, cpu`)."""
    atoms = text.split(sep)
    end = sep.rstrip()  # what ends a line that the next item does not share
    lines: list[str] = []
    line = ""
    for n, atom in enumerate(atoms):
        trial = f"{line}{sep}{atom}" if line else atom
        if line and len(trial) + (len(end) if n < len(atoms) - 1 else 0) > width:
            lines.append(line + end)
            line = atom
        else:
            line = trial
    return "\n".join(lines + [line])


def print_table(out, title: str | None, columns: list[Col], rows: list[list[str] | None],
                hidden: list | None = None, label: str | None = None) -> list[str]:
    """Print a fitted table and return the names of the columns dropped to fit.

    Without `hidden`, one line after the table names them. With a list, (label, names) is added to it
    instead, so that a command prints one note for all its tables (`print_hidden`).
    """
    table, dropped = fitted_table(out, title, columns, rows)
    out.print(table)
    if dropped:
        if hidden is None:
            print_hidden(out, [(None, dropped)])
        else:
            hidden.append((label, dropped))
    return dropped


def print_hidden(out, hidden: list) -> None:
    """The one note of a command about the columns its tables left out, each table by its title and each column by
    its header, and what shows them: `(hidden at 80 columns: Stages: host RAM during load; ...)`."""
    parts = [(label, names) for label, names in hidden if names]
    if not parts:
        return
    what = "; ".join(f"{label}: {', '.join(names)}" if label else ", ".join(names) for label, names in parts)
    out.print(f"(hidden at {out.width} columns: {what}; a wider terminal or --json shows them)", style="dim")

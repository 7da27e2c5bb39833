"""Rendering of `dmap cache`."""

from __future__ import annotations

from ..units import format_size
from . import console, num


def render_cache(folder: str, entries, freed: int | None, binary: bool = False) -> None:
    from rich.table import Table

    out = console()
    table = Table(title=f"dmap cache: {folder}", title_justify="left")
    table.add_column("kind")
    table.add_column("files", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("holds", ratio=1)
    for entry in entries:
        table.add_row(entry.kind, num(entry.files), format_size(entry.bytes, binary), entry.what)
    table.add_section()
    table.add_row("total", num(sum(e.files for e in entries)), format_size(sum(e.bytes for e in entries), binary), "")
    out.print(table)
    if freed is not None:
        out.print(f"Cleared {format_size(freed, binary)}; entries are rebuilt when a command needs them.", markup=False)
    else:
        out.print("Entries are keyed by configs and library versions and never expire: "
                  "dmap cache --clear deletes them (set DMAP_CACHE_DIR to move the folder).", markup=False)

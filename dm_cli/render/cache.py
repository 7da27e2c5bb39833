"""Rendering of `dmap cache`."""

from __future__ import annotations

from dm_cli.render import Col, console, num, print_table
from dm_cli.units import format_size


def render_cache(folder: str, entries, freed: int | None, binary: bool = False) -> None:
    out = console()
    rows = [[e.kind, num(e.files), format_size(e.bytes, binary), e.what] for e in entries]
    rows += [None, ["total", num(sum(e.files for e in entries)), format_size(sum(e.bytes for e in entries), binary), ""]]
    print_table(out, f"dmap cache: {folder}",
                [Col("kind"), Col("files", number=True), Col("size", number=True), Col("holds", drop=3)], rows)
    if freed is not None:
        out.print(f"Cleared {format_size(freed, binary)}; entries are rebuilt when a command needs them.")
    else:
        out.print("Entries are keyed by configs and library versions and never expire: "
                  "dmap cache --clear deletes them (set DMAP_CACHE_DIR to move the folder).")

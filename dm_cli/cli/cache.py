"""Show or clear dmap's cache (skeletons, traces, split checks, the demo pipeline): it is rebuilt when needed."""

from __future__ import annotations

import typer

from dm_cli.cli._cli_utils import BinaryOpt, JsonOpt
from dm_cli.cli._output import print_json
from dm_cli.errors import UsageError
from dm_cli.io.cache import CACHE_KINDS, cache_dir, cache_usage, clear_cache
from dm_cli.render.cache import render_cache


def cache(
    clear: bool = typer.Option(False, "--clear", help="Delete the cached entries (all, or the --kind ones)."),
    kind: list[str] = typer.Option([], "--kind", help="Only this kind: skeletons, traces, checks, demo (repeatable)."),
    as_json: JsonOpt = False,
    binary: BinaryOpt = False,
) -> int:
    unknown = [k for k in kind if k not in CACHE_KINDS]
    if unknown:
        raise UsageError(f"Unknown cache kind '{unknown[0]}': use {', '.join(CACHE_KINDS)}.")
    freed = clear_cache(kind or None) if clear else None
    entries = cache_usage()
    if as_json:
        print_json({"folder": str(cache_dir()), "freed_bytes": freed,
                    "kinds": {e.kind: {"files": e.files, "bytes": e.bytes} for e in entries}})
    else:
        render_cache(str(cache_dir()), entries, freed, binary=binary)
    return 0

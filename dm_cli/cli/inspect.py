"""Show what is in a model or pipeline and how big each part is (configs on meta, headers only)."""

from __future__ import annotations

import sys

import typer

from dm_cli.cli._cli_utils import BinaryOpt, ComponentOpt, DtypeOpt, JsonOpt, NoCacheOpt, SourceArg, WeightsOpt
from dm_cli.cli._output import print_json
from dm_cli.errors import EXIT_USAGE
from dm_cli.render import plain, status
from dm_cli.render.inspect import render_inspect
from dm_cli.units import parse_dtype


def inspect(
    source: SourceArg,
    dtype: DtypeOpt = None,
    component: ComponentOpt = None,
    weights: WeightsOpt = None,
    depth: int = typer.Option(0, "--depth", min=0, help="Also show the module tree to this depth."),
    as_json: JsonOpt = False,
    binary: BinaryOpt = False,
    no_cache: NoCacheOpt = False,
) -> int:
    from dm_cli.model.inspection import inspect_source  # lazy: looked up per call (tests patch inspect_source)

    with status(f"Inspecting {source}: reading configs and headers…"):
        report = inspect_source(
            source, dtype=parse_dtype(dtype) if dtype is not None else None, component=component, depth=depth, use_cache=not no_cache,
            weights=weights,
        )
    if as_json:
        print_json(report.to_json())
    else:
        render_inspect(report, binary=binary)
    if report.problems:
        if as_json:  # the table renderer already listed them
            print(f"Error: {len(report.problems)} checkpoint problem(s):", file=sys.stderr)
            for problem in report.problems:
                print(f"  - {plain(problem)}", file=sys.stderr)
        return EXIT_USAGE  # a corrupt checkpoint is bad input: scripts can tell
    return 0

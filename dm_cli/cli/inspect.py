"""Show what is in a model or pipeline and how big each part is (configs on meta, headers only)."""

from __future__ import annotations

import typer


def inspect(
    source: str = typer.Argument(..., metavar="SOURCE", help="Pipeline/component folder, .safetensors, index JSON, preset or Hub repo id."),
    dtype: str | None = typer.Option(None, "--dtype", help="Size at bf16|fp16|fp32 (default: as stored, bf16 for configs)."),
    component: str | None = typer.Option(None, "--component", "-c", help="Only this component."),
    weights: str | None = typer.Option(None, "--weights", "-w",
                                       help="Size with weights stored as fp8 | int8 (every component but the VAE), or per component: transformer=fp8,text_encoder=fp8."),
    depth: int = typer.Option(0, "--depth", min=0, help="Also show the module tree to this depth."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (schema in README) instead of a table."),
    binary: bool = typer.Option(False, "--binary", help="Print sizes in GiB instead of GB."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Rebuild skeletons instead of using the cache."),
) -> int:
    from dm_cli.model.inspection import inspect_source
    from dm_cli.render import status
    from dm_cli.units import parse_dtype

    with status(f"Inspecting {source}: reading configs and headers…"):
        report = inspect_source(
            source, dtype=parse_dtype(dtype) if dtype is not None else None, component=component, depth=depth, use_cache=not no_cache,
            weights=weights,
        )
    if as_json:
        from dm_cli.cli._output import print_json

        print_json(report.to_json())
    else:
        from dm_cli.render.inspect import render_inspect

        render_inspect(report, binary=binary)
    if report.problems:
        from dm_cli.errors import EXIT_USAGE

        if as_json:  # the table renderer already listed them
            import sys

            from dm_cli.render import plain

            print(f"Error: {len(report.problems)} checkpoint problem(s):", file=sys.stderr)
            for problem in report.problems:
                print(f"  - {plain(problem)}", file=sys.stderr)
        return EXIT_USAGE  # a corrupt checkpoint is bad input: scripts can tell
    return 0

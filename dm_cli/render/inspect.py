"""Rendering of `dmap inspect`."""

from __future__ import annotations

from ..units import format_size
from . import console, num as _num, plain, safe

def render_inspect(report, binary: bool = False) -> None:
    from rich.table import Table

    out = console()
    title = safe(report.source)
    if report.pipeline_class:
        title += f" — {safe(report.pipeline_class)}"
    table = Table(title=title, title_justify="left")
    for column, justify in (("component", "left"), ("class", "left"), ("dtype", "left"), ("params", "right"),
                            ("size", "right"), ("blocks", "right"), ("largest block", "left"), ("block size", "right")):
        table.add_column(column, justify=justify)
    for comp in report.components:
        block = comp.largest_block
        table.add_row(
            safe(comp.name), safe(comp.cls), comp.dtype.replace("bfloat16", "bf16").replace("float", "fp"),
            _num(comp.params), format_size(comp.bytes, binary), str(comp.num_blocks),
            safe(f"{block.name} ({block.cls})") if block else "-", format_size(block.bytes, binary) if block else "-",
        )
    if len(report.components) > 1:
        table.add_section()
        table.add_row("total", "", "", _num(report.total_params), format_size(report.total_bytes, binary), "", "", "")
    out.print(table)
    for comp in report.components:
        if comp.tree:
            tree_table = Table(title=f"{safe(comp.name)} modules", title_justify="left")
            tree_table.add_column("module")
            tree_table.add_column("class")
            tree_table.add_column("params", justify="right")
            tree_table.add_column("size", justify="right")
            for row in comp.tree:
                marker = " [no-split]" if row["no_split"] else ""
                tree_table.add_row(safe("  " * (row["depth"] - 1) + row["name"].rpartition(".")[2]), safe(row["class"] + marker),
                                   _num(row["params"]), format_size(row["bytes"], binary))
            out.print(tree_table)
    for note in report.notes:
        out.print(f"note: {plain(note)}", markup=False)
    problems = report.problems
    if problems:
        err = console(stderr=True)
        err.print(f"[bold red]{len(problems)} checkpoint problem(s):[/]")
        for problem in problems:
            err.print(f"  - {plain(problem)}", markup=False)
    elif any(c.weights for c in report.components):
        out.print("Checkpoint checked: index, shards and headers agree.")

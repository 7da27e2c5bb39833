"""Rendering of `dmap inspect`."""

from __future__ import annotations

from dm_cli.render import Col, console, num, print_hidden, print_table
from dm_cli.units import format_size


def _dtype(name: str) -> str:
    return name.replace("bfloat16", "bf16").replace("float", "fp")


def render_inspect(report, binary: bool = False) -> None:
    out = console()
    title = f"{report.source}" + (f" — {report.pipeline_class}" if report.pipeline_class else "")
    columns = [Col("component"), Col("class", drop=1), Col("dtype", drop=2), Col("params", number=True, drop=1),
               Col("size", number=True), Col("blocks", number=True, drop=3), Col("largest block", drop=4),
               Col("block size", number=True, drop=3)]
    rows: list = []
    for comp in report.components:
        block = comp.largest_block
        rows.append([comp.name, comp.cls, _dtype(comp.dtype), num(comp.params), format_size(comp.bytes, binary),
                     str(comp.num_blocks), f"{block.name} ({block.cls})" if block else "-",
                     format_size(block.bytes, binary) if block else "-"])
    if len(report.components) > 1:
        rows += [None, ["total", "", "", num(report.total_params), format_size(report.total_bytes, binary), "", "", ""]]
    hidden: list = []  # one note for every table of the command
    print_table(out, title, columns, rows, hidden)
    for comp in report.components:
        if comp.tree:
            tree_rows = [["  " * (row["depth"] - 1) + row["name"].rpartition(".")[2],
                          row["class"] + (" [no-split]" if row["no_split"] else ""),
                          num(row["params"]), format_size(row["bytes"], binary)] for row in comp.tree]
            print_table(out, f"{comp.name} modules",
                        [Col("module"), Col("class"), Col("params", number=True, drop=1), Col("size", number=True)],
                        tree_rows, hidden, label=f"{comp.name} modules")
    if report.gguf is not None:
        _gguf_tables(out, report.gguf, hidden, binary)
    single = getattr(report, "single_file", None)
    if single is not None:
        _single_file_table(out, single, hidden, binary)
    print_hidden(out, hidden)
    for note in report.notes:
        out.print(f"note: {note}")
    problems = report.problems
    if problems:
        err = console(stderr=True)
        err.print(f"{len(problems)} checkpoint problem(s):", style="bold red")
        for problem in problems:
            err.print(f"  - {problem}")
    elif report.gguf is not None:
        out.print(f"GGUF header checked: {report.gguf['tensor_count']} tensors, in order, aligned and inside the file "
                  "(no tensor data read).")
    elif any(c.weights for c in report.components):
        out.print("Checkpoint checked: index, shards and headers agree.")


def _gguf_tables(out, gguf: dict, hidden: list, binary: bool) -> None:
    """A GGUF file: its ggml types (tensors, params and bytes as stored), then its format and main metadata."""
    rows: list = [[name, str(row["tensors"]), num(row["params"]), format_size(row["bytes"], binary)]
                  for name, row in gguf["types"].items()]
    print_table(out, "ggml types", [Col("type"), Col("tensors", number=True), Col("params", number=True, drop=1),
                                    Col("size", number=True)], rows, hidden, label="ggml types")
    facts = [f"GGUF version {gguf['version']}", f"{gguf['byte_order']}-endian", f"alignment {gguf['alignment']}",
             f"{gguf['metadata_count']} metadata entries"]
    out.print(", ".join(facts))
    for key, value in gguf["metadata"].items():
        if isinstance(value, dict):
            value = f"an array of {value['length']} {value['array']}"
        out.print(f"{key}: {value}")  # inert: the console shows control characters escaped


def _single_file_table(out, single: dict, hidden: list, binary: bool) -> None:
    """An original-layout single file: what it is, then the parts it holds (by key prefix), each as stored."""
    out.print(f"recognized: {single['summary']}")
    rows: list = [[part["name"], part["prefix"] or ("(the rest)" if part["name"] == "other" else "(none)"),
                   _dtype(part["dtype"] or "-"), num(part["params"]), format_size(part["bytes"], binary),
                   f"{part['config']['preset']}/{part['config']['component']}" if part["config"] else "-"]
                  for part in single["parts"]]
    print_table(out, "parts in the file", [Col("part"), Col("key prefix", drop=2), Col("dtype", drop=3),
                                           Col("params", number=True, drop=1), Col("size", number=True),
                                           Col("config", drop=1)], rows, hidden, label="parts in the file")
    for note in single["notes"]:
        out.print(f"note: {note}")

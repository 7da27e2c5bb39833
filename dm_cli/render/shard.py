"""Rendering of `dmap shard`: a byte progress bar while writing and verifying, a summary table after."""

from __future__ import annotations

import sys

from dm_cli.render import Col, console, num, print_table
from dm_cli.units import format_size


class ShardProgressBar:
    """The core's `Progress` drawn with Rich: bytes done / total and throughput, one bar per phase.

    Off (draws nothing) when stdout is not a terminal or with --quiet, so logs and pipes stay clean.
    """

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            # lazy: rich only when drawing
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(TextColumn("{task.description:<7}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=console(), transient=True)
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False

    def phase(self, name: str, total_bytes: int) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.update(self._task, completed=self._progress.tasks[0].total)
        self._task = self._progress.add_task(name, total=max(total_bytes, 1))

    def advance(self, num_bytes: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, num_bytes)


def render_shard(result, binary: bool = False) -> None:
    out = console()
    pipeline = len(result.components) > 1 or result.kind == "pipeline"
    verb = "Would write" if result.dry_run else "Wrote"
    title = f"{result.source} → {result.output}" + ("  (dry run: nothing written)" if result.dry_run else "")
    columns = ([Col("component")] if pipeline else []) + [Col("file"), Col("size", number=True),
                                                          Col("tensors", number=True), Col("note", drop=3)]
    rows: list = []
    for comp in result.components:
        for shard in comp.shards:
            note = "one tensor larger than the limit" if shard.oversized else ""
            rows.append(([comp.name] if pipeline else []) + [shard.name, format_size(shard.file_bytes, binary),
                                                             num(len(shard.tensors)), note])
        if comp.index_name:
            rows.append(([comp.name] if pipeline else []) + [comp.index_name, "", "", "index"])
        if pipeline:
            rows.append(None)
    print_table(out, title, columns, rows[:-1] if rows and rows[-1] is None else rows)
    limit = "one file per component" if result.max_shard_size == 0 else f"shards of at most {format_size(result.max_shard_size, binary)}"
    out.print(f"{verb} {num(result.file_count)} weight file(s), {format_size(result.total_size, binary)} of tensors, as {limit}.")
    for comp in result.components:
        for file_name, tensor, nbytes in comp.oversized:
            out.print(f"Note: tensor {tensor} ({format_size(nbytes, binary)}) is larger than the limit: "
                      f"it has a shard of its own ({file_name}).")
        if comp.dropped:
            out.print(f"{comp.name}: {len(comp.dropped)} shared tensor name(s) written once; the dropped names are "
                      "recorded in the metadata.")
        if comp.converted:
            out.print(f"{comp.name}: {num(comp.converted)} tensor(s) converted to {result.dtype}.")
    if result.copied_files:
        out.print(f"{'Would copy' if result.dry_run else 'Copied'} {num(len(result.copied_files))} other file(s) unchanged "
                  "(configs, tokenizers, schedulers).")
    if result.skipped_files:
        out.print("Not carried over (weights in another form or variant): " + ", ".join(result.skipped_files))
    if not result.dry_run:
        speed = result.bytes_written / result.seconds if result.seconds > 0 else 0
        check = "every tensor verified against the source" if result.verified else "not verified (--no-verify)"
        where = "replaced in place" if result.in_place else f"into {result.output}"
        out.print(f"Done in {result.seconds:.2f} s ({format_size(speed, binary)}/s), {check}; {where}.")
    for done in result.removed_stale:  # sentences: what recovery did, or where a backup is
        out.print(done)

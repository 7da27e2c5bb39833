"""Rewrite weights as safetensors shards of a given size, streaming (never the whole model in RAM)."""

from __future__ import annotations

import sys

import typer

from dm_cli.cli._cli_utils import (
    BinaryOpt,
    JsonOpt,
    OverwriteOpt,
    PipelineOpt,
    QuietOpt,
    ShardDtypeOpt,
    ShardOutputOpt,
    ShardSourceArg,
)
from dm_cli.cli._output import print_json
from dm_cli.errors import UsageError
from dm_cli.io.claims import claim_outputs
from dm_cli.model.shard import shard as shard_source
from dm_cli.model.shard import shard_to_diffusers
from dm_cli.render.shard import ShardProgressBar, render_shard


def shard(
    ctx: typer.Context,
    source: ShardSourceArg,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", "-s",
                                       help="Largest file: 5GB = 5e9 bytes, 5GiB = 5*2^30; 0 = one file per component."),
    output: ShardOutputOpt = None,
    dtype: ShardDtypeOpt = None,
    variant: str | None = typer.Option(None, "--variant", help="Read and write this variant, e.g. fp16."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the shard layout; write nothing."),
    overwrite: OverwriteOpt = False,
    in_place: bool = typer.Option(False, "--in-place", help="Replace the source weights, after the new ones are verified."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip re-reading and hashing every written tensor."),
    to_diffusers: bool = typer.Option(
        False, "--to-diffusers", help="SOURCE is a single file (original-layout .safetensors or .gguf): write it as a "
                                      "diffusers component folder (config.json from the bundled preset or --pipeline, "
                                      "diffusers-named shards). GGUF tensors are dequantized to --dtype (default bf16)."),
    pipeline: PipelineOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    binary: BinaryOpt = False,
) -> int:
    if to_diffusers:
        _refuse_with_to_diffusers(variant, in_place)
    elif pipeline is not None:
        raise UsageError("--pipeline goes with --to-diffusers (dmap shard reshards a folder's own weights otherwise).")
    if not dry_run and (output or in_place):  # claimed until the command ends: a second shard of it stops
        ctx.with_resource(claim_outputs([output or source], "dmap shard"))
    with ShardProgressBar(enabled=False if (quiet or as_json or dry_run) else None) as bar:
        if to_diffusers:
            result = shard_to_diffusers(source, max_shard_size, output=output, dtype=dtype, pipeline=pipeline,
                                        dry_run=dry_run, overwrite=overwrite, verify=not no_verify, progress=bar)
        else:
            result = shard_source(source, max_shard_size, output=output, dtype=dtype, variant=variant, dry_run=dry_run,
                                  overwrite=overwrite, in_place=in_place, verify=not no_verify, progress=bar)
    if as_json:
        print_json(result.to_json())
    elif quiet:
        _print_quiet(result)
    else:
        render_shard(result, binary=binary)
        for note in result.notes:
            print(note)
    return 0


def _refuse_with_to_diffusers(variant: str | None, in_place: bool) -> None:
    if variant is not None or in_place:
        raise UsageError("--to-diffusers writes a new folder from one file: drop --variant and --in-place.")


def _print_quiet(result) -> None:
    """-q: one line of what was written where (stdout); what recovery did and tensors above the limit (stderr)."""
    for comp in result.components:
        for file_name, tensor, _nbytes in comp.oversized:
            print(f"Note: tensor {tensor} is larger than the limit: it has a shard of its own ({file_name}).",
                  file=sys.stderr)
    for done in result.removed_stale:
        print(done, file=sys.stderr)
    for note in result.notes:
        print(note, file=sys.stderr)
    files = f"{result.file_count} weight file(s)"
    if result.dry_run:
        print(f"Would write {files} into {result.output} (dry run: nothing written).")
    elif result.in_place:
        print(f"Wrote {files}, replacing the weights of {result.source} in place.")
    else:
        print(f"Wrote {files} into {result.output}.")

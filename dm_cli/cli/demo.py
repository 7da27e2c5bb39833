"""Write a tiny preset as a pipeline folder with random weights, ready for `dmap run` (its images are noise)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from dm_cli.cli._cli_utils import DemoOutputOpt, DemoSeedOpt, OverwriteOpt
from dm_cli.cli._output import say
from dm_cli.io.claims import claim_outputs
from dm_cli.model.demo import tiny_presets, write_preset
from dm_cli.render import plain, status
from dm_cli.units import format_size


def demo(
    ctx: typer.Context,
    preset: Annotated[str, typer.Argument(
        metavar="PRESET", help="A tiny-* preset, e.g. tiny-sd15 or tiny-wan; `list` lists them all.")],
    output: DemoOutputOpt = None,
    seed: DemoSeedOpt = 0,
    overwrite: OverwriteOpt = False,
) -> int:
    if preset == "list":
        print("\n".join(tiny_presets()))
        return 0
    output = output or preset  # the preset's name, here
    # claimed until the command ends: a second `dmap demo -o` of the same folder stops, naming this one
    ctx.with_resource(claim_outputs([Path(output).expanduser()], "dmap demo"))
    with status(f"Generating {preset} with random weights…"):
        written = write_preset(preset, output, seed=seed, overwrite=overwrite)
    for note in written.notes:
        print(plain(note), file=sys.stderr)
    say(f"Wrote {written.preset} ({plain(written.pipeline_class)}, random weights from seed {written.seed}: its "
        f"outputs are noise, not art) to {plain(str(written.folder))}: {written.files} files, "
        f"{format_size(written.bytes)}.")
    print(f"Next: {plain(written.next_command())}")
    return 0

"""Measure this machine's device (matmul, attention, memory, copy rates) into a profile dmap plan predicts with."""

from __future__ import annotations

import sys

import typer

from dm_cli.cli._cli_utils import JsonOpt, ProfileOutputOpt, ProfileOverwriteOpt, QuietOpt
from dm_cli.cli._output import print_json, say
from dm_cli.errors import UsageError
from dm_cli.io.atomic import atomic_write_bytes
from dm_cli.io.strict_json import json_text
from dm_cli.planning.time.calibrate import CalibrationSizes, check_device, check_profile_output, machine_load
from dm_cli.planning.time.calibrate import measure as measure_device
from dm_cli.planning.time.profiles import default_profile_path
from dm_cli.render.calibrate import profile_summary, written_sentence
from dm_cli.render.queue import TickingStatus


def calibrate(
    output: ProfileOutputOpt = None,
    device: str | None = typer.Option(None, "--device", help="cpu or cuda:N (default: the first GPU, else the CPU)."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, seconds: a rough profile (tests)."),
    overwrite: ProfileOverwriteOpt = False,
    force: bool = typer.Option(False, "--force", help="Save the figures as this machine's profile even when the "
                               "machine was busy while measuring (they run slower than it can)."),
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> int:
    """Measure this machine's device into the profile dmap plan predicts step times with."""
    target = check_device(device)  # before measuring: a missing GPU or a bad -o costs nothing
    path = str(check_profile_output(output, overwrite)) if output else str(default_profile_path())
    before = machine_load()
    if before.busy and not quiet:
        say(f"warning: the machine is busy ({before.words()}): figures measured now run slower than it can.",
            stream=sys.stderr)
    status = TickingStatus(f"Calibrating {target}", enabled=not quiet)

    def progress(message: str) -> None:  # a spinner on a terminal, else a line each (a log shows how far it got)
        status(message)
        if not quiet and not status.enabled:
            say(message, stream=sys.stderr)

    with status:
        result = measure_device(CalibrationSizes.quick() if quick else CalibrationSizes(), target, progress)
    load = type(before)(before.load, before.cores, result.spread)
    if load.busy and not output and not force:
        again = " ".join(["dmap calibrate", *(["--device", device] if device else []), *(["--quick"] if quick else [])])
        raise UsageError(f"The machine was busy while measuring ({load.words()}): its figures were not saved as this "
                         f"machine's profile; rerun {again} when it is quiet, or {again} --force to save them anyway.")
    if not output:
        default_profile_path().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json_text(result.profile.to_json(), indent=2) + "\n").encode())
    if as_json:
        print_json({"path": path, "profile": result.profile.to_json(), "load": load.to_json()})
        return 0
    if load.busy:
        say(f"warning: measured while the machine was busy ({load.words()}): these figures run slower than it can.",
            stream=sys.stderr)
    if not quiet:
        say(profile_summary(result.profile))
    say(written_sentence(path, default=not output))
    return 0

"""Measure this machine's device (matmul, attention, memory, copy rates) into a profile dmap plan predicts with."""

from __future__ import annotations

import json

import typer

from dm_cli.cli._cli_utils import JsonOpt, OverwriteOpt, ProfileOutputOpt
from dm_cli.cli._output import print_json, say
from dm_cli.errors import UsageError
from dm_cli.io.atomic import atomic_write_bytes, refuse_existing
from dm_cli.planning.profiles import default_profile_path
from dm_cli.run.calibrate import CalibrationSizes
from dm_cli.run.calibrate import calibrate as measure


def calibrate(
    output: ProfileOutputOpt = None,
    device: str | None = typer.Option(None, "--device", help="cpu or cuda:N (default: the first GPU, else the CPU)."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, seconds: a rough profile (tests)."),
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
) -> int:
    if device is not None and device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"--device must be cpu or cuda:N, not {device!r}.")
    path = output or str(default_profile_path())
    if output:
        refuse_existing([output], overwrite)
    profile = measure(CalibrationSizes.quick() if quick else CalibrationSizes(), device)
    if not output:
        default_profile_path().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(profile.to_json(), indent=2) + "\n").encode())
    if as_json:
        print_json({"path": path, "profile": profile.to_json()})
        return 0
    rates = ", ".join(f"{k} {v:.3g}" for k, v in profile.matmul_tflops.items())
    attention = ", ".join(f"{k} {v:.3g}" for k, v in profile.attention_tflops.items())
    say(f"{profile.name}: matmul TFLOP/s {rates}; attention TFLOP/s {attention}; memory {profile.memory_gbps:.3g} "
        f"GB/s; host copies {profile.host_gbps:.3g} GB/s; link {profile.link_gbps:.3g} GB/s ({profile.link}); "
        f"{profile.op_seconds * 1e6:.3g} us per op"
        + (f"; {profile.link_latency_s * 1e6:.3g} us per message on the link" if profile.link_latency_s else "")
        + (f"; an all-to-all {profile.collective_latency_s * 1e6:.3g} us and {profile.collective_gbps:.3g} GB/s."
           if profile.collective_latency_s else "."))
    say(f"Profile written to {path}" + ("" if output else " (dmap plan reads it from there)") + ".")
    return 0

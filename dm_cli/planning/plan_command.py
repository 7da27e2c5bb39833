"""The `dmap plan` command line that makes a plan again, read back from the plan itself: the hint a run prints when
its SOURCE and its plan file disagree must be a command that, pasted, succeeds."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from dm_cli.planning.modes import Layout

if TYPE_CHECKING:  # the noun, for annotations only
    from dm_cli.planning.plan_file import Plan


def _size(num_bytes: int) -> str:
    """A byte count as the shortest exact size a device spec takes (16GB, 600MB, or plain bytes)."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def _devices(plan: Plan) -> list[str]:
    sized = [d for d in plan.devices if d.capacity is not None]
    memory = ",".join(d.name if d.capacity is None else f"{d.name}={_size(d.capacity)}" for d in plan.devices)
    overhead = ",".join(f"{d.name}={_size(d.overhead)}" for d in sized)
    return [*(["--max-memory", memory] if memory else []), *(["--overhead", overhead] if overhead else [])]


def _inputs(plan: Plan) -> list[str]:
    inputs = plan.inputs
    flags: list[str] = []
    if inputs.weights_only:
        return ["--height", "0", "--width", "0"]
    for flag, value in (("--height", inputs.height), ("--width", inputs.width), ("--batch-size", inputs.batch_size),
                        ("--num-images", inputs.num_images), ("--guidance-scale", inputs.guidance_scale),
                        ("--max-sequence-length", inputs.max_sequence_length), ("--frames", inputs.num_frames),
                        ("--fps", inputs.fps)):
        if value is not None:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    steps = (plan.predicted_time or {}).get("steps")  # the steps `dmap run -d` runs (dm_cli.run.request)
    if steps:
        flags += ["--steps", str(steps)]
    for width, height in inputs.image_sizes:
        flags += ["--image-size", f"{width}x{height}"]
    if inputs.last_image_size is not None:
        flags += ["--last-image-size", "{}x{}".format(*inputs.last_image_size)]
    return flags


def _parallel(plan: Plan) -> list[str]:
    layout = plan.parallel
    if layout is None:
        return []
    flags = ["--world-size", str(layout.world_size), "--parallel", "none" if layout.layout == Layout.SPLIT else layout.layout,
             "--device-tflops", f"{layout.device_tflops:g}", "--link-gbps", f"{layout.link_gbps:g}"]
    if layout.layout == Layout.PIPELINE and layout.in_flight:
        flags += ["--in-flight", str(layout.in_flight)]
    return flags


def _features(plan: Plan) -> list[str]:
    flags: list[str] = []
    weights = ",".join(f"{name}={fmt}" for name, fmt in sorted(plan.weights.items()) if fmt)
    if weights:
        flags += ["--weights", weights]
    flags += lora_flags(plan)
    if plan.step_cache:
        flags += ["--cache", str(plan.step_cache.get("label") or plan.step_cache["name"])]
    return flags


def lora_flags(plan: Plan) -> list[str]:
    """The plan's LoRAs as `--lora COMPONENT=FILE:SCALE` flags: `dmap plan` makes them again, `dmap run -d` must
    give them (the plan counts their bytes)."""
    return [word for lora in plan.loras for word in ("--lora", f"{lora['component']}={lora['path']}:{lora['scale']:g}")]


def plan_command(plan: Plan, source: str, output: str, overwrite: bool = False) -> str:
    """`dmap plan SOURCE ...` with every flag `plan` was made with (devices, dtype, strategy, mode, inputs, the
    parallel layout, weight storage, LoRAs, step cache), writing `output`: shell-quoted, ready to paste."""
    words = ["dmap", "plan", source, *_devices(plan), "--dtype", plan.dtype, "--strategy", plan.strategy,
             "--mode", plan.mode, *_inputs(plan), *_parallel(plan), *_features(plan), "-o", output]
    if overwrite:
        words.append("--overwrite")
    return " ".join(shlex.quote(str(word)) for word in words)

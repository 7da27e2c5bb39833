"""Rendering of `dmap plan`: per stage and device use, the pipeline map, split maps, warnings."""

from __future__ import annotations

from ..devices import device_rank
from ..planner import clean_device_map
from ..units import format_size
from . import Col, console, print_table

BAR_WIDTH = 24
# One glyph per part, so the bar reads without colour too (NO_COLOR, a pipe, a screen reader).
BAR_PARTS = (("weights", "█", "cyan"), ("offload reserve", "▓", "magenta"), ("activations", "▒", "yellow"),
             ("overhead", "▪", "red"))
BAR_FREE = ("free", "·", "dim")


def _bar(values: list[int], capacity: int | None):
    """A bar of weights/reserve/activations/overhead against the device capacity."""
    from rich.text import Text

    if not capacity:
        return Text("")
    bar = Text()
    cells = 0
    for value, (_name, glyph, style) in zip(values, BAR_PARTS):
        n = min(BAR_WIDTH - cells, round(BAR_WIDTH * value / capacity))
        if n > 0:
            bar.append(glyph * n, style=style)
            cells += n
    bar.append(BAR_FREE[1] * (BAR_WIDTH - cells), style=BAR_FREE[2])
    return bar


def bar_legend():
    from rich.text import Text

    legend = Text("bar: ")
    for name, glyph, style in BAR_PARTS + (BAR_FREE,):
        legend.append(glyph, style=style)
        legend.append(f" {name}  ")
    return legend


def _device_label(key: str) -> str:
    return f"GPU {key}" if key.isdigit() else key



def render_plan(plan, binary: bool = False, output: str | None = None) -> None:
    from rich.text import Text

    out = console()
    size = lambda n: format_size(n, binary)  # noqa: E731
    capacity = {d.name: d.capacity for d in plan.devices}
    inputs = plan.inputs
    frames = f", {inputs.num_frames} frames" if inputs.num_frames else ""
    what = "weights only" if inputs.weights_only else (
        f"{inputs.height}x{inputs.width}{frames}, batch {inputs.batch_size}x{inputs.num_images}")
    out.print(Text.assemble((str(plan.source), "bold"), f" — {plan.mode} plan, strategy {plan.strategy}, {plan.dtype}, {what}"))
    columns = [Col("device"), Col("weights", number=True), Col("reserve", number=True, drop=2),
               Col("activations", number=True), Col("overhead", number=True, drop=2), Col("peak", number=True),
               Col("capacity", number=True, drop=3), Col("free", number=True, drop=1), Col("", drop=4, name="bar")]
    bar_shown = False
    for stage in plan.stages:
        rows = []
        for key, use in sorted(stage.use.items(), key=lambda item: device_rank(item[0])):
            cap = capacity.get(key)
            rows.append([
                _device_label(key), size(use.weights), size(use.reserve) if use.reserve else "-",
                size(use.activations) if use.activations else "-", size(use.overhead) if use.overhead else "-",
                size(use.peak) if key != "disk" else "-", size(cap) if cap is not None else "unlimited",
                size(cap - use.peak) if cap is not None else "-",
                _bar([use.weights, use.reserve, use.activations, use.overhead], cap),
            ])
        note = f" ({stage.note})" if stage.note else ""
        dropped = print_table(out, f"stage {stage.name}: {', '.join(stage.components)}{note}", columns, rows)
        bar_shown = bar_shown or "bar" not in dropped
    if bar_shown:
        out.print(bar_legend())
    pipe_rows = []
    for name, comp in plan.components.items():
        devices = ", ".join(_device_label(str(d)) for d in sorted(comp.devices, key=device_rank))
        pipe_rows.append([name, comp.cls, comp.stage, plan.weights.get(name) or plan.dtype, size(comp.weights_bytes), devices,
                          size(comp.offloaded_bytes) if comp.offloaded_bytes else "-", str(comp.hops)])
    print_table(out, "hf_device_map (pipeline level)",
                [Col("component"), Col("class", drop=2), Col("stage", drop=3), Col("stored as", drop=3), Col("weights", number=True),
                 Col("devices"), Col("offloaded", number=True), Col("hops", number=True, drop=3)], pipe_rows)
    for name, comp in plan.components.items():
        if not comp.is_split:
            continue
        modules = list(comp.device_map)
        parents = set()
        for key in modules:
            while key:
                key = key.rpartition(".")[0]
                parents.add(key)
        collapsed = clean_device_map(comp.device_map, sorted(set(modules) | parents))
        print_table(out, f"{name} device_map ({len(comp.device_map)} blocks, collapsed)",
                    [Col("modules"), Col("device")],
                    [[module, _device_label(str(device))] for module, device in _runs(collapsed)])
    check = plan.check or {}
    if check.get("ran"):
        if check.get("problems"):
            err = console(stderr=True)
            err.print(f"Split check failed ({len(check['problems'])} problem(s)):", style="bold red")
            for problem in check["problems"]:
                err.print(f"  - {problem}")
        elif check.get("components"):
            out.print(Text.assemble(("Split check passed", "green"), f" on the meta device: {', '.join(check['components'])}."))
    if not any(d.is_gpu for d in plan.devices):
        on_disk = sum(c.disk_bytes for c in plan.components.values())
        out.print("No GPU in the device list: every component runs on the CPU"
                  + (f"; {size(on_disk)} of weights are streamed from disk." if on_disk else "."))
    elif plan.offloaded_bytes:
        out.print(f"Offloaded to cpu/disk: {size(plan.offloaded_bytes)} (run where the plan's execution device says).")
    else:
        out.print("Nothing offloaded to cpu or disk.")
    for warning in plan.warnings:
        out.print(Text.assemble(("warning:", "yellow"), f" {warning}"))
    if output:
        out.print(f"Plan written to {output}.")


def _runs(device_map: dict) -> list[tuple[str, object]]:
    """Consecutive entries on the same device as one row: 'first … last (n)'."""
    rows: list[tuple[str, object]] = []
    run: list[str] = []
    device = None
    for key, value in device_map.items():
        if run and value != device:
            rows.append((_join(run), device))
            run = []
        run.append(key or "(whole)")
        device = value
    if run:
        rows.append((_join(run), device))
    return rows


def _join(keys: list[str]) -> str:
    if len(keys) <= 3:
        return ", ".join(keys)
    return f"{keys[0]}, {keys[1]} … {keys[-1]} ({len(keys)} entries)"

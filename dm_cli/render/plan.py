"""Rendering of `dmap plan`: per stage and device use, the pipeline map, split maps, warnings."""

from __future__ import annotations

from ..devices import device_label
from ..planner import clean_device_map
from ..units import format_size
from . import console

BAR_WIDTH = 24


def _bar(parts: list[tuple[int, str]], capacity: int | None) -> str:
    """A bar of weights/reserve/activations/overhead against the device capacity."""
    if not capacity:
        return ""
    cells, text = 0, ""
    for value, style in parts:
        n = min(BAR_WIDTH - cells, round(BAR_WIDTH * value / capacity))
        if n > 0:
            text += f"[{style}]" + "█" * n + "[/]"
            cells += n
    return text + "[dim]" + "░" * (BAR_WIDTH - cells) + "[/]"


def render_plan(plan, binary: bool = False, output: str | None = None) -> None:
    from rich.table import Table

    out = console()
    size = lambda n: format_size(n, binary)  # noqa: E731
    capacity = {d.name: d.capacity for d in plan.devices}
    inputs = plan.inputs
    what = "weights only" if inputs.weights_only else (
        f"{inputs.height}x{inputs.width}, batch {inputs.batch_size}x{inputs.num_images}")
    out.print(f"[bold]{plan.source}[/] — {plan.mode} plan, strategy {plan.strategy}, {plan.dtype}, {what}")
    for stage in plan.stages:
        table = Table(title=f"stage {stage.name}: {', '.join(stage.components)}", title_justify="left")
        for column, justify in (("device", "left"), ("weights", "right"), ("reserve", "right"),
                                ("activations", "right"), ("overhead", "right"), ("peak", "right"),
                                ("capacity", "right"), ("free", "right"), ("", "left")):
            table.add_column(column, justify=justify)
        for key, use in stage.use.items():
            cap = capacity.get(key)
            table.add_row(
                device_label(key), size(use.weights), size(use.reserve) if use.reserve else "-",
                size(use.activations) if use.activations else "-", size(use.overhead) if use.overhead else "-",
                size(use.peak), size(cap) if cap is not None else "unlimited",
                size(cap - use.peak) if cap is not None else "-",
                _bar([(use.weights, "cyan"), (use.reserve, "magenta"), (use.activations, "yellow"),
                      (use.overhead, "red")], cap),
            )
        out.print(table)
    out.print("[dim]bar: [cyan]weights[/] [magenta]offload reserve[/] [yellow]activations[/] [red]overhead[/][/]")
    pipe = Table(title="hf_device_map (pipeline level)", title_justify="left")
    for column in ("component", "class", "stage", "weights", "devices", "offloaded", "hops"):
        pipe.add_column(column, justify="right" if column in ("weights", "offloaded", "hops") else "left")
    for name, comp in plan.components.items():
        devices = ", ".join(device_label(str(d)) for d in comp.devices)
        pipe.add_row(name, comp.cls, comp.stage, size(comp.weights_bytes), devices,
                     size(comp.offloaded_bytes) if comp.offloaded_bytes else "-", str(comp.hops))
    out.print(pipe)
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
        split = Table(title=f"{name} device_map ({len(comp.device_map)} blocks, collapsed)", title_justify="left")
        split.add_column("modules")
        split.add_column("device")
        for module, device in _runs(collapsed):
            split.add_row(module, device_label(str(device)))
        out.print(split)
    check = plan.check or {}
    if check.get("ran"):
        if check.get("problems"):
            err = console(stderr=True)
            err.print(f"[bold red]Split check failed ({len(check['problems'])} problem(s)):[/]")
            for problem in check["problems"]:
                err.print(f"  - {problem}", markup=False)
        elif check.get("components"):
            out.print(f"[green]Split check passed[/] on the meta device: {', '.join(check['components'])}.")
    if not any(d.is_gpu for d in plan.devices):
        out.print("No GPU in the device list: every component runs on the CPU.")
    elif plan.offloaded_bytes:
        out.print(f"Offloaded to cpu/disk: {size(plan.offloaded_bytes)} (run where the plan's execution device says).")
    else:
        out.print("Nothing offloaded to cpu or disk.")
    for warning in plan.warnings:
        out.print(f"[yellow]warning:[/] {warning}", markup=True)
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

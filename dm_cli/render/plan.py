"""Rendering of `dmap plan`: per stage and device use, the pipeline map, split maps, warnings."""

from __future__ import annotations

import shlex
from pathlib import Path

from dm_cli.devices import device_label, device_rank
from dm_cli.io.input_images import shown_path
from dm_cli.model.sources import PRESETS
from dm_cli.planning.modes import Layout
from dm_cli.planning.placement.blocks import clean_device_map
from dm_cli.planning.plan_command import lora_flags
from dm_cli.render import Col, console, print_hidden, print_table
from dm_cli.run import request  # the module: tests replace its cuda_devices_without_torch
from dm_cli.run.request import prediction_at
from dm_cli.units import format_size

BAR_WIDTH = (16, 32)  # the bar takes the room the numbers leave, within these widths
# One glyph per part, so the bar reads without colour too (NO_COLOR, a pipe, a screen reader).
BAR_PARTS = (("weights", "█", "cyan"), ("offload reserve", "▓", "magenta"), ("activations", "▒", "yellow"),
             ("overhead", "▪", "red"))
BAR_FREE = ("free", "·", "dim")
BAR_CACHE = ("cache", "░", "green")  # drawn, and in the legend, only for a plan with --cache


def _bar(values: list[int], capacity: int | None, parts=BAR_PARTS):
    """A bar of weights/reserve/activations/overhead (and the step cache's state) against the device capacity: a
    callable width -> Text."""
    from rich.text import Text  # lazy: rich only when drawing

    def draw(width: int):
        if not capacity:
            return Text("")
        bar = Text()
        cells = 0
        for value, (_name, glyph, style) in zip(values, parts):
            n = min(width - cells, round(width * value / capacity))
            if n > 0:
                bar.append(glyph * n, style=style)
                cells += n
        bar.append(BAR_FREE[1] * (width - cells), style=BAR_FREE[2])
        return bar

    return draw


def bar_legend(parts=BAR_PARTS):
    from rich.text import Text  # lazy: rich only when drawing

    legend = Text("bar: ")
    for name, glyph, style in parts + (BAR_FREE,):
        legend.append(glyph, style=style)
        legend.append(f" {name}  ")
    legend.rstrip()
    return legend


def _stage_labels(stages) -> list[str]:
    """Stage names, numbered where a name repeats (Wan 2.2's two denoise stages: `denoise 1`, `denoise 2`)."""
    names = [s.name for s in stages]
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(f"{name} {seen[name]}" if names.count(name) > 1 else name)
    return labels


def _is_preset(source: str) -> bool:
    return source in PRESETS and not Path(source).expanduser().exists()


def next_step(plan, output: str | None) -> str:
    """The one thing to do next with this plan."""
    if len(plan.components) == 1:
        name = next(iter(plan.components))
        where = output or "the JSON (add -o plan.json to keep it)"
        return (f"Next: load {name} with from_pretrained(device_map=...) using components.{name}.device_map "
                f"of {where}.")
    if not output:
        return "Next: add -o plan.json to keep this plan for dmap run -d plan.json."
    source = str(plan.source)
    if _is_preset(source):  # the plan's own run, with a folder of weights for SOURCE (a preset has none)
        return "Next: " + run_command(plan, output).replace(" run -d ", f" run path/to/{source} -d ", 1)
    return f"Next: {run_command(plan, output)}"


def run_command(plan, output: str) -> str:
    """The command that runs this plan file, here, as pasted: `dmap run -d PLAN.json` (the plan knows its SOURCE),
    under torchrun for a plan of several ranks, with --simulate where this machine has none of the planned GPUs."""
    gpus = {dev for comp in plan.components.values() for dev in comp.device_map.values()} - {"cpu", "disk", "mps"}
    simulate = " --simulate" if gpus and request.cuda_devices_without_torch() == 0 else ""
    loras = "".join(f" {shlex.quote(word)}" for word in lora_flags(plan))  # run -d gives the plan's LoRAs
    # an output named after the plan: the default dmap.png may be an earlier run's (dmap never overwrites it)
    name = f"{Path(output).stem or 'plan'}.{'mp4' if plan.inputs.num_frames else 'png'}"
    written = f" -o {shlex.quote(str(Path(output).with_name(name)))}"
    run = f"run -d {shlex.quote(output)} -p \"a prompt\"{loras}{simulate}{written}"
    ranks = plan.parallel.world_size if plan.parallel is not None else 1
    return f"torchrun --nproc-per-node {ranks} -m dm_cli {run}" if ranks > 1 else f"dmap {run}"


def render_plan(plan, binary: bool = False, output: str | None = None, hidden: list | None = None,
                show_next: bool = True, run: bool = False) -> None:
    """The plan for people: one memory picture (a bar per stage and device), the components, split maps.

    `hidden`: a list to collect the columns left out (the caller prints one note for the whole
    command, `print_hidden`); without it the note is printed here. `show_next`: end with the next step. `run`: the
    plan of a run (`dmap run`), whose predicted time is for the run's own steps, size and prompts.
    """
    from rich.text import Text  # lazy: rich only when drawing

    out = console()
    own_note = hidden is None
    hidden = [] if hidden is None else hidden
    size = lambda n: format_size(n, binary)  # noqa: E731
    inputs = plan.inputs
    frames = f", {inputs.num_frames} frames" if inputs.num_frames else ""
    what = "weights only" if inputs.weights_only else (
        f"{inputs.height}x{inputs.width}{frames}, batch {inputs.batch_size}x{inputs.num_images}")
    out.print(Text.assemble((str(plan.source), "bold"), f" — {plan.mode} plan, strategy {plan.strategy}, {plan.dtype}, {what}"))
    _print_memory(out, plan, size, hidden)
    _print_components(out, plan, size, hidden)
    _print_split_maps(out, plan, hidden)
    predicted = getattr(plan, "predicted_time", None)
    predicted = predicted if predicted and "step_s" in predicted else None  # no prediction (no profile of its CPU)
    if getattr(plan, "parallel", None) is not None:
        _print_parallel(out, plan.parallel, size, hidden, plan.dtype, timed=bool((predicted or {}).get("layouts")))
    for line in (plan.peak_lines() if hasattr(plan, "peak_lines") else []):
        out.print(line)
    if predicted:
        _print_predicted_time(out, predicted, plan, run)
    if own_note:
        print_hidden(out, hidden)
    _print_notes(out, plan, size)
    if output:
        out.print(f"Plan written to {output}.")
    if show_next:
        out.print(next_step(plan, output), soft_wrap=True)  # a command to paste: never broken in two


def _print_memory(out, plan, size, hidden: list) -> None:
    """The memory picture: a row per stage and device at that stage's peak, with its bar, the bar's
    legend and which components each stage holds (the answer to 'does it fit, and where')."""
    capacity = {d.name: d.capacity for d in plan.devices}
    # what the bar draws goes first when the room is short: overhead, reserve, capacity and free
    columns = [Col("stage"), Col("device"), Col("weights", number=True, drop=2), Col("reserve", number=True, drop=5),
               Col("activations", number=True, drop=1), Col("overhead", number=True, drop=6),
               Col("step cache", number=True, drop=2), Col("peak", number=True), Col("capacity", number=True, drop=4),
               Col("free", number=True, drop=3), Col("use of capacity", stretch=BAR_WIDTH)]
    parts = BAR_PARTS + (BAR_CACHE,) if plan.step_cache else BAR_PARTS
    rows: list = []
    labels = _stage_labels(plan.stages)
    for label, stage in zip(labels, plan.stages):
        if rows:
            rows.append(None)
        for n, (key, use) in enumerate(sorted(stage.use.items(), key=lambda item: device_rank(item[0]))):
            cap = capacity.get(key)
            rows.append([
                label if n == 0 else "", device_label(key), size(use.weights), size(use.reserve) if use.reserve else "-",
                size(use.activations) if use.activations else "-", size(use.overhead) if use.overhead else "-",
                size(use.cache) if use.cache else "-",
                size(use.peak) if key != "disk" else "-", size(cap) if cap is not None else "unlimited",
                size(cap - use.peak) if cap is not None else "-",
                _bar([use.weights, use.reserve, use.activations, use.overhead, use.cache], cap, parts),
            ])
    # no step cache (no --cache), no overhead (weights only), no reserve (nothing offloaded): no column
    for index in (6, 5, 3):
        if all(row is None or row[index] == "-" for row in rows):
            columns.pop(index)
            for row in rows:
                if row is not None:
                    row.pop(index)
    dropped = print_table(out, "Memory per stage and device, at each stage's peak", columns, rows, hidden,
                          label="Memory per stage and device (its bar draws them)")
    if "use of capacity" not in dropped:
        out.print(bar_legend(parts))
    elif dropped:  # no bar to draw them
        hidden[-1] = ("Memory per stage and device", dropped)
    out.print("Stages: " + "; ".join(
        f"{label}: {', '.join(stage.components)}" + (f" ({stage.note})" if stage.note else "")
        for label, stage in zip(labels, plan.stages)) + ".")
    line = step_cache_line(plan, size)
    if line:
        out.print(line)


def step_cache_line(plan, size) -> str | None:
    """--cache: which step cache, on which denoiser, and the bytes its hooks hold between steps on each device (the
    `step cache` column of the memory table, which a narrow terminal may leave out); None without a cache."""
    cache = plan.step_cache
    if not cache:
        return None
    held = []
    for name, counted in cache.get("components", {}).items():
        devices = [(device_label(device), n) for device, n in
                   sorted(counted.get("bytes", {}).items(), key=lambda item: device_rank(item[0])) if n]
        where = (f" on {devices[0][0]}" if len(devices) == 1 else
                 f" ({', '.join(f'{label} {size(n)}' for label, n in devices)})" if devices else "")
        held.append(f"{name} holds {size(counted.get('total_bytes', 0))} between steps{where}")
    settings = plan.cache.label.partition(":")[2].replace(",", ", ")  # as --cache takes them, room to wrap
    return (f"Step cache: {cache['name']}" + (f" ({settings})" if settings else "") + ": "
            + ("; ".join(held) if held else "nothing held between steps") + ", counted in the peaks.")


def _print_components(out, plan, size, hidden: list) -> None:
    """The pipeline-level hf_device_map: each component's class, storage, weights and devices (what a
    script passes to from_pretrained); the 'stored as' column only when storage differs from the dtype."""
    pipe_rows = []
    stored = {name: plan.weights.get(name) or plan.dtype for name in plan.components}
    for name, comp in plan.components.items():
        devices = ", ".join(device_label(str(d)) for d in sorted(comp.devices, key=device_rank))
        pipe_rows.append([name, comp.cls, stored[name], size(comp.weights_bytes), devices,
                          size(comp.offloaded_bytes) if comp.offloaded_bytes else "-", str(comp.hops)])
    pipe_columns = [Col("component"), Col("class", drop=1), Col("stored as", drop=3), Col("weights", number=True),
                    Col("devices", atoms=", "), Col("offloaded", number=True, drop=2), Col("hops", number=True, drop=4)]  # the offload sentences say it too
    if all(dtype == plan.dtype for dtype in stored.values()):  # the header line says it
        pipe_columns.pop(2)
        for row in pipe_rows:
            row.pop(2)
    print_table(out, "hf_device_map (pipeline level)", pipe_columns, pipe_rows, hidden, label="hf_device_map")


def _print_split_maps(out, plan, hidden: list) -> None:
    """For each component split across devices, its device_map as runs of consecutive modules on one
    device: thousands of entries read as a handful of rows."""
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
        runs = _runs(collapsed, comp.device_map)
        print_table(out, f"{name} device_map: {len(comp.device_map)} entries in {len(runs)} runs",
                    [Col("modules"), Col("entries", number=True), Col("device")],
                    [[modules_text, str(count), device_label(str(device))] for modules_text, count, device in runs],
                    hidden, label=f"{name} device_map")


def _print_parallel(out, layout, size, hidden: list, dtype: str = "", timed: bool = False) -> None:
    """--world-size > 1: the layout the ranks would share each step in, each rank's peak, the predicted step
    of every layout compared (and why the others were not), the reason, and the numbers behind the times.
    `timed`: the plan has a predicted time, which prints each layout's seconds (one figure per layout): the time
    model's own seconds, which only rank the layouts, are then not printed."""
    rows = [[str(rank), f"GPU {rank}", size(peak)] for rank, peak in sorted(layout.per_rank_peak_bytes.items(),
                                                                            key=lambda item: int(item[0]))]
    columns = [Col("rank"), Col("device"), Col("peak", number=True)]
    pipeline = layout.layout == Layout.PIPELINE
    if pipeline:  # each rank's slice of the denoiser's blocks: first … last (how many)
        title = (f"Parallel: {layout.title}, world size {layout.world_size}, {layout.in_flight} queue prompts in "
                 "flight (--in-flight)")
        columns.insert(2, Col("blocks"))
        for row in rows:
            names = layout.slices.get(row[0], [])
            shown = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}" if names else "-"
            row.insert(2, f"{shown} ({len(names)})")
    else:
        title = (f"Parallel: {layout.title}, world size {layout.world_size} = cfg {layout.cfg} x ulysses "
                 f"{layout.ulysses} x ring {layout.ring}"
                 + (", experts one at a time" if layout.experts != "together" else ""))
    out.print(title)
    print_table(out, "Peak per rank", columns, rows, hidden, label="Peak per rank")
    for name, seconds in ({} if timed else layout.predicted_step_s).items():
        unit = " per image-step in a queue" if name == Layout.PIPELINE else " per step"
        # the plan keeps 4 decimals: a tiny model's step rounds to 0, which is not a prediction of no time
        shown = "under 0.1 ms" if seconds < 1e-4 else f"{seconds:.3g} s"
        out.print(f"  {name}: predicted {shown}{unit}" + (" (chosen)" if name == layout.layout else ""))
    if pipeline:
        out.print(f"  predicted speed-up: {layout.predicted_speedup:.2f}x the split's images per second for a queue "
                  f"(1x for one prompt); basis: {layout.speedup_basis or 'the time model'}")
    for name, why in layout.rejected.items():
        out.print(f"  {name}: not planned: {why}")
    out.print(f"Parallel: {_without_seconds(layout.reason) if timed else layout.reason}.")
    at = f" at {dtype}" if dtype else ""
    out.print(f"Time model (ranks the layouts): {layout.device_tflops:g} TFLOP/s per GPU{at} (--device-tflops; "
              f"dmap's default is 100 at bfloat16 and float16, 50 at float32), {layout.link_gbps:g} GB/s between GPUs "
              "(--link-gbps).")


def _without_seconds(reason: str) -> str:
    """A layout's reason without the time model's seconds (the predicted time prints each layout's, one figure each):
    "context parallel (Ulysses 2), as asked: predicted 0.1 s/step against 0.2 s/step split (cfg 0.3 s); fits ..."
    reads "context parallel (Ulysses 2), as asked: each layout's predicted time below; fits ..."; a speed-up stays."""
    import re  # lazy: only for a parallel plan

    reason = re.sub(r" \([^()]*\d s\b[^()]*\)", "", reason)  # the bracketed seconds
    return re.sub(r"predicted [0-9.e+-]+ s/step(?: against [0-9.e+-]+ s/step split)?",
                  "each layout's predicted time below", reason)


def _seconds(value: float) -> str:
    """Seconds as people read them: 3 significant figures, whole seconds from 1000 on (never 1.23e+04)."""
    return "under 0.1 ms" if value < 1e-4 else f"{value:,.0f} s" if value >= 1000 else f"{value:.3g} s"


def _print_predicted_time(out, predicted: dict, plan=None, run: bool = False) -> None:
    """The denoise stage's predicted time (planning/time/step_time.py), through `prediction_at` at its own steps and
    queue (a run's plan carries the run's): per step, image and queue, its largest terms, and the profile it rests
    on. A parallel plan: one line per layout, its own seconds (one figure each), the chosen one marked."""
    predicted = prediction_at(predicted)
    terms = sorted(predicted.get("step_terms_s", {}).items(), key=lambda item: -item[1])
    shown = ", ".join(f"{name} {_seconds(value)}" for name, value in terms[:3] if value > 0)
    steps, queue = predicted["steps"], predicted.get("queue", 1)
    if run:
        inputs = getattr(plan, "inputs", None)
        frames = f", {inputs.num_frames} frames" if inputs is not None and inputs.num_frames else ""
        size = f"{inputs.width}x{inputs.height}{frames}, " if inputs is not None and inputs.height else ""
        what = f"this run ({size}{steps} steps, {queue} prompt{'s' if queue != 1 else ''})"
        at, for_queue = "", f"{_seconds(predicted['queue_s'])} for its {queue} prompts" if queue > 1 else ""
    else:
        what, at = "this plan", f" at {steps} steps (--steps)"
        for_queue = f"{_seconds(predicted['queue_s'])} for a queue of {queue} (--queue)"
    layouts = predicted.get("layouts") or {}
    if layouts:
        chosen = getattr(getattr(plan, "parallel", None), "layout", None)
        out.print(f"Predicted denoise time for {what}{at}" + (f" and a queue of {queue} (--queue)" if not run else "")
                  + (f"; one step in one process: {shown}" if shown else "") + ":")
        for name, times in layouts.items():
            unit = "per image-step in a queue" if name == Layout.PIPELINE else "per step"
            out.print(f"  {name}{' (chosen)' if name == chosen else ''}: {_seconds(times['step_s'])} {unit}, "
                      f"{_seconds(times['image_s'])} per image, {_seconds(times['queue_s'])} per queue")
    else:
        out.print(f"Predicted denoise time for {what}: {_seconds(predicted['step_s'])} per step"
                  + (f" ({shown})" if shown else "") + f", {_seconds(predicted['image_s'])} per image{at}"
                  + (f", {for_queue}" if for_queue else "") + ".")
    overlap = predicted.get("offload_overlap") or {}
    if overlap.get("synchronous_step_s"):
        out.print(f"Offload overlapped with compute: {_seconds(overlap.get('transfer_s', 0))} of copies per step, "
                  f"{_seconds(predicted['step_s'])} per step against {_seconds(overlap['synchronous_step_s'])} "
                  "copying each block in its turn.")
    if predicted.get("pipeline_s") and not layouts:
        out.print(f"The whole pipeline call (encode, {steps} steps, decode): {_seconds(predicted['pipeline_s'])}.")
    origin = {"default": "no profile of these GPUs (--profile table:NAME predicts with a GPU's published figures; "
                         "dmap calibrate measures the GPU it runs on)", "cached": "this machine's calibrated profile",
              "file": "--profile", "table": "published figures (--profile table:...)"}.get(
        predicted.get("profile_origin"), "")
    out.print(f"Device profile: {predicted.get('profile')}, {origin}.")


def _print_notes(out, plan, size) -> None:
    """The sentences after the tables: the split check's verdict (failures on stderr), what is offloaded
    and what that costs, and the planner's warnings."""
    from rich.text import Text  # lazy: rich only when drawing

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
        for name, comp in plan.components.items():
            if comp.offloaded_bytes:
                out.print(_offload_sentence(name, comp, size))
    else:
        out.print("Nothing offloaded to cpu or disk.")
    report = getattr(plan, "input_images", None)
    if report:
        tokens = report["tokens"]
        out.print(f"Input images: {len(tokens)} add {' + '.join(f'{t:,}' for t in tokens)} tokens to {report['component']}'s "
                  f"sequence: its activations {size(report['activation_peak_bytes'])}, "
                  f"{size(report['activation_peak_without_bytes'])} without them.")
    for lora in getattr(plan, "loras", None) or []:
        name = shown_path(lora["path"].replace("\\", "/").rsplit("/", 1)[-1])
        out.print(Text.assemble(("LoRA ", "bold"), f"{name}: scale {lora['scale']:g} on {lora['component']}, "
                                f"{lora['tensors']} tensors, {size(lora['bytes'])} counted beside the layers it patches"
                                f"{', fused into them at load' if lora['fused'] else ' (unfused)'}, "
                                f"sha256 {lora['digest'][:12]}."))
    for warning in plan.warnings:
        out.print(Text.assemble(("warning:", "yellow"), f" {warning}"))


def _offload_sentence(name: str, comp, size) -> str:
    """What happens to a component's offloaded blocks, plainly."""
    target = device_label(str(comp.execution_device))
    on_disk = comp.disk_bytes
    on_cpu = comp.offloaded_bytes - on_disk
    where = (f"cpu ({size(on_cpu)}) and disk ({size(on_disk)})" if on_cpu and on_disk
             else "disk" if on_disk else "cpu")
    offload = getattr(comp, "offload", None) or {}
    if offload.get("mode") == "overlapped":
        return (f"Offloaded: {size(comp.offloaded_bytes)} of {name}'s weights stay on {where}; overlapped: "
                f"{offload['reason']}, then each block is dropped.")
    why = f" Synchronous: {offload['reason']}." if offload.get("reason") else ""
    return (f"Offloaded: {size(comp.offloaded_bytes)} of {name}'s weights stay on {where}; each block is copied to "
            f"{target} when it runs, then dropped (slower than weights kept on a GPU).{why}")


def _runs(collapsed: dict, device_map: dict) -> list[tuple[str, int, object]]:
    """Consecutive entries on the same device as one row: ('first, second … last', JSON entries, device).

    The count is of the JSON's device_map entries the row covers (a collapsed parent counts every entry
    under it), so the rows add up to the map's length."""

    def covered(key: str) -> int:
        if not key:
            return len(device_map)
        return sum(1 for k in device_map if k == key or k.startswith(key + "."))

    rows: list[tuple[str, int, object]] = []
    run: list[str] = []
    count = 0
    device = None
    for key, value in collapsed.items():
        if run and value != device:
            rows.append((_join(run), count, device))
            run, count = [], 0
        run.append(key or "(whole)")
        count += covered(key)
        device = value
    if run:
        rows.append((_join(run), count, device))
    return rows


def _join(keys: list[str]) -> str:
    if len(keys) <= 3:
        return ", ".join(keys)
    return f"{keys[0]}, {keys[1]} … {keys[-1]}"

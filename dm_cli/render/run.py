"""Rich output of `dmap run`: the plan, a progress bar over denoising steps, the final table."""

from __future__ import annotations

from . import console
from ..units import format_size


class RunView:
    """Shows the plan when it is known, the denoising progress, then the per-stage/per-device table."""

    def __init__(self, quiet: bool = False, binary: bool = False):
        self.quiet = quiet
        self.binary = binary
        self.console = console()
        self._progress = None
        self._task = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        return False

    def show_plan(self, plan) -> None:
        if self.quiet:
            return
        from .plan import render_plan

        try:
            render_plan(plan, binary=self.binary)
        except (KeyError, ValueError, TypeError, AttributeError):  # a hand-written plan without the planner's extras
            self.console.print(f"Plan: {plan.mode} mode, devices {', '.join(d.name for d in plan.devices)}")

    def step(self, done: int, total: int) -> None:
        if self.quiet or not self.console.is_terminal:
            return
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("denoise"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("denoise", total=total)
        self._progress.update(self._task, completed=done)
        if done >= total:
            self._progress.stop()
            self._progress = None

    def summary(self, result) -> None:
        from rich.table import Table

        size = lambda n: format_size(n, binary=self.binary) if n else "-"  # noqa: E731
        for notice in result.notices:
            self.console.print(f"[bold yellow]{notice}[/]")
        where = "on this machine"
        if result.simulate:
            where = "simulated on this CPU (every planned device)" + (
                ", split check on" if result.split_check else ", split check unavailable in this build")
        self.console.print(
            f"{result.pipeline_class} from {result.source}: {result.width}x{result.height}, {result.steps} steps, "
            f"guidance {result.guidance_scale}, seed {result.seed}, {where}; plan {result.plan_digest}"
        )
        stages = Table(title="Stages", title_justify="left")
        for column in ("stage", "components", "load s", "run s", "wall s", "host RAM during load"):
            stages.add_column(column, justify="left" if column in ("stage", "components") else "right")
        for s in result.stages:
            stages.add_row(s.name, ", ".join(s.components), f"{s.load_s:.2f}", f"{s.run_s:.2f}", f"{s.wall_s:.2f}",
                           size(s.load_rss_delta))
        self.console.print(stages)
        devices = Table(title="Peak memory per device (measured vs planned)", title_justify="left")
        overheads = {d.name: d.overhead for d in result.plan.devices}
        for column in ("device", "measured peak", "planned peak", "planned overhead", "measured / planned w/o overhead"):
            devices.add_column(column, justify="left" if column == "device" else "right")
        for dev, (measured, planned) in sorted(result.device_peaks().items()):
            base = planned - overheads.get(dev, 0)
            ratio = f"{measured / base:.0%}" if base > 0 else "-"
            label = f"GPU {dev}" if dev.isdigit() else dev
            devices.add_row(label, size(measured), size(planned), size(overheads.get(dev, 0)), ratio)
        self.console.print(devices)
        note = tracking_note(result)
        if note:
            self.console.print(f"[dim]{note}[/]")
        if result.split_problems:
            self.console.print("[bold red]Split check problems (this plan would fail on real devices):[/]")
            for problem in result.split_problems:
                self.console.print(f"  {problem}")
        for path in result.images:
            self.console.print(f"Wrote {path}")
        if result.latents_path:
            self.console.print(f"Wrote latents to {result.latents_path}")


def tracking_note(result) -> str:
    """Say what the measured peaks cover: the activation tracker runs on the first denoising step only."""
    parts = []
    first = next((s.tracked for s in result.stages if s.tracked.startswith("first")), None)
    if first:
        parts.append(f"Activations on CPU and simulated devices are tracked during encode, decode and the {first} "
                     "of denoise: later steps repeat the second one's graph on the same shapes, so its peak is the "
                     "stage's, and tracking each op costs time.")
    if not result.simulate and any(dev.isdigit() for dev in result.device_peaks()):
        parts.append("GPU rows: torch.cuda.max_memory_allocated over each whole stage.")
    return " ".join(parts)

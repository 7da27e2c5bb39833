"""Rich output of `dmap run`: the plan, a progress bar over denoising steps, the final table."""

from __future__ import annotations

import os

from dm_cli.devices import device_label, device_rank, is_cuda
from dm_cli.render import Col, console, print_hidden, print_table
from dm_cli.render.plan import render_plan
from dm_cli.units import format_size


class RunView:
    """Shows the plan when it is known, the denoising progress, then the per-stage/per-device table."""

    def __init__(self, quiet: bool = False, binary: bool = False, plan_file: str | None = None):
        self.quiet = quiet
        self.binary = binary
        self.plan_file = plan_file  # SOURCE taken from this plan file: said on the first line
        self.console = console()
        self.err = console(stderr=True)  # progress and status: stdout keeps only the results
        self._progress = None
        self._status = None
        self._task = None
        self._component = None
        self._hidden: list = []  # columns the plan's and the summary's tables left out: one note at the end

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.status(None)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        return False

    def status(self, message: str | None) -> None:
        """A spinner on stderr saying what the run is doing now (loading, planning); None clears it."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if message and not self.quiet and self.err.is_terminal:
            self._status = self.err.status(message, spinner="dots")
            self._status.start()

    def show_plan(self, plan) -> None:
        if self.quiet:
            return
        from rich.text import Text  # lazy: rich only when drawing

        if self.plan_file is not None:  # no markup: the names come from the command line and the plan file
            self.console.print(Text(f"Running {plan.source} from {self.plan_file}"), soft_wrap=True)

        try:
            # the note on hidden columns waits for this summary's, to be one; a view with its own summary
            # (the queue's) gets it with the plan
            hidden = self._hidden if type(self).summary is RunView.summary else None
            render_plan(plan, binary=self.binary, hidden=hidden, show_next=False, run=True)
        except (KeyError, ValueError, TypeError, AttributeError):  # a hand-written plan without the planner's extras
            self.console.print(f"Plan: {plan.mode} mode, devices {', '.join(d.name for d in plan.devices)}")

    def step(self, done: int, total: int, component: str | None = None) -> None:
        """One denoising step done; `component` is the denoiser that ran it (the expert, for Wan 2.2)."""
        if self.quiet or not self.err.is_terminal:
            return
        if self._progress is None:
            self.status(None)  # one live display at a time
            # lazy: rich only when drawing
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("denoise {task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.err,
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task(component or "", total=total)
            self._component = component
        if component != self._component:  # the expert switch: said once, the bar goes on across both
            self._progress.console.print(f"denoise: {component} takes over from {self._component} at step {done} of {total}")
            self._component = component
        self._progress.update(self._task, completed=done, description=component or "")
        if done >= total:
            self._progress.stop()
            self._progress = None

    def summary(self, result) -> None:
        size = lambda n: format_size(n, binary=self.binary) if n else "-"  # noqa: E731
        for notice in result.notices:
            self.console.print(notice, style="bold yellow")
        if self.quiet:
            self._problems_and_outputs(result)
            return
        where = "on this machine"
        if result.simulate:
            where = "simulated on this CPU (every planned device)" + (
                ", split check on" if result.split_check else ", split check unavailable in this build")
        self.console.print(
            f"{result.pipeline_class} from {result.source}: {result.width}x{result.height}"
            f"{f', {result.num_frames} frames at {result.fps} fps' if result.num_frames else ''}, {result.steps} steps, "
            f"guidance {result.guidance_scale}"
            f"{f' (low-noise expert {expert})' if (expert := result.settings.get('guidance_scale_2')) is not None else ''}, "
            f"seed {result.seed}, {where}; plan {result.plan_digest}"
        )
        line = step_cache_summary(result.step_cache)
        if line:
            self.console.print(line)
        self._stages(result)
        overheads = {d.name: d.overhead for d in result.plan.devices}
        device_rows = []
        # disk holds weights, it is not memory: no peak for it
        peaks = [(dev, mp) for dev, mp in result.device_peaks().items() if dev != "disk"]
        by_rss = any(s.tracked == "process peak RSS" for s in result.stages)  # the cpu row: the whole process
        for dev, (measured, planned) in sorted(peaks, key=lambda item: device_rank(item[0])):
            base = planned - overheads.get(dev, 0)
            ratio = f"{measured / base:.0%}" if base > 0 and measured else "-"
            if by_rss and dev == "cpu" and ratio != "-":
                ratio += " (RSS)"
            label = device_label(dev)
            device_rows.append([label, size(measured), size(planned), size(overheads.get(dev, 0)), ratio])
        print_table(self.console, "Peak memory per device (measured vs planned)",
                    [Col("device"), Col("measured peak", number=True), Col("planned peak", number=True),
                     Col("planned overhead", number=True, drop=3), Col("measured / planned (w/o overhead)", number=True)],
                    device_rows, self._hidden, label="Peak memory per device")
        print_hidden(self.console, self._hidden)
        self._hidden = []
        note = tracking_note(result)
        if note:
            self.console.print(note, style="dim")
        self._problems_and_outputs(result, detail=True)

    def _stages(self, result) -> None:
        """The Stages table; with --compile, the cold compile's seconds in a column of their own, apart from the
        steps' (run s is then the stage's run without them)."""
        compiled = any(s.compile_s for s in result.stages)
        size = lambda n: format_size(n, binary=self.binary) if n else "-"  # noqa: E731
        rows = []
        for s in result.stages:
            run = [f"{s.run_s - s.compile_s:.2f}", f"{s.compile_s:.2f}"] if compiled else [f"{s.run_s:.2f}"]
            rows.append([s.name, ", ".join(s.components), f"{s.load_s:.2f}", *run, f"{s.wall_s:.2f}",
                         size(s.load_rss_delta)])
        runs = [Col("run s", number=True)] + ([Col("compile s", number=True)] if compiled else [])
        print_table(self.console, "Stages", [Col("stage"), Col("components", drop=2), Col("load s", number=True),
                                             *runs, Col("wall s", number=True),
                                             Col("host RAM during load", number=True, drop=3)], rows,
                    self._hidden, label="Stages")
        if compiled:
            self.console.print("compile s: torch.compile's cold start (dynamo and its backend), paid once per process "
                               "and shape; run s is the stage without it.", style="dim")

    def _problems_and_outputs(self, result, detail: bool = False) -> None:
        """What even --quiet prints: what would fail on real devices, and what was written (`detail`: with
        each file's size and, for an image or video, its width x height)."""
        if result.split_problems:
            self.console.print("Split check problems (this plan would fail on real devices):", style="bold red")
            for problem in result.split_problems:
                self.console.print(f"  {problem}")
        for path in result.images:  # whole on one line, however long: scripts read the path after --quiet
            self.console.print(f"Wrote {path}" + (f" ({written(path, result, self.binary)})" if detail else ""),
                               soft_wrap=True, markup=False, highlight=False)
        if result.latents_path:
            self.console.print(f"Wrote latents to {result.latents_path}", soft_wrap=True, markup=False,
                               highlight=False)


def step_cache_summary(step_cache: dict) -> str | None:
    """--cache: how many of each cached denoiser's calls ran its blocks and how many the cache skipped (every guidance
    branch counted); None without a cache."""
    if not step_cache:
        return None
    name = step_cache["label"].partition(":")[0]
    counts = [f"{component} computed {c['computed']} of {c['calls']} calls in full, skipped {c['skipped']}"
              for component, c in step_cache.get("counts", {}).items()]
    return f"Step cache {name}: " + ("; ".join(counts) if counts else "no denoiser call ran") + "."


def tracking_note(result) -> str:
    """Say what the measured peaks cover and how they were measured."""
    parts = []
    first = next((s.tracked for s in result.stages if s.tracked.startswith("first")), None)
    if first:
        parts.append(f"Activations on CPU and simulated devices are tracked during encode, decode and the {first} "
                     "of denoise: later steps repeat the second one's graph on the same shapes, so its peak is the "
                     "stage's, and tracking each op costs time.")
    if any(s.tracked == "process peak RSS" for s in result.stages):
        parts.append("cpu row: the loaded weights plus the growth of this process's peak resident memory during "
                     "each stage (the kernel's high-water mark), which also holds what the plan does not count (the "
                     "libraries, torch's and malloc's caches), so a cpu ratio over 100% is not a planning error; "
                     "--track-activations counts tensors op by op instead.")
    if not result.simulate and any(is_cuda(dev) for dev in result.device_peaks()):
        parts.append("GPU rows: torch.cuda.max_memory_allocated over each whole stage.")
    return " ".join(parts)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def written(path: str, result, binary: bool = False) -> str:
    """What a written output is, from the file itself: `512x512 PNG, 389.42 KB`; a folder: its files and size."""
    try:
        if os.path.isdir(path):
            files = [e for e in os.scandir(path) if e.is_file(follow_symlinks=False)]
            return f"{len(files)} files, {format_size(sum(e.stat().st_size for e in files), binary)}"
        nbytes = os.stat(path).st_size
    except OSError:
        return f"{result.width}x{result.height}"
    suffix = os.path.splitext(path)[1].lower()
    what = ""
    if suffix in IMAGE_SUFFIXES:
        try:
            from PIL import Image  # lazy: PIL (heavy, off start-up)

            with Image.open(path) as image:  # reads the header only
                what = f"{image.width}x{image.height} {image.format}, "
        except Exception:  # noqa: BLE001 - a file we cannot read back: its size still says something
            what = f"{result.width}x{result.height}, "
    elif result.num_frames and suffix not in (".json",):
        what = f"{result.width}x{result.height}, {result.num_frames} frames at {result.fps} fps, "
    return f"{what}{format_size(nbytes, binary)}"

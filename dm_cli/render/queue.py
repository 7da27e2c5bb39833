"""Rich output of `dmap run --prompts`: the plan (rank 0), what is skipped and why, the chunk size, each image.

Also the live spinner with elapsed seconds that `dmap plan` shows (`TickingStatus`): only one process
per terminal draws live displays (`live_allowed`: under torchrun, local rank 0).
"""

from __future__ import annotations

import sys
import threading
import time

from dm_cli.planning.modes import Mode
from dm_cli.render import console, plain
from dm_cli.render.run import RunView, step_cache_summary
from dm_cli.run.distributed import Ranks
from dm_cli.units import format_size


def live_allowed() -> bool:
    """Whether this process may draw a live spinner or bar: always, except under torchrun, where the ranks of a
    node share its terminal: a spinner's redraws would run into the other ranks' lines, so each prints plain ones."""
    try:
        return not Ranks.from_env().distributed
    except Exception:  # noqa: BLE001 - bad torchrun variables are refused elsewhere, with a message
        return True


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class TickingStatus:
    """A spinner on stderr with the latest progress message and how long it has run, redrawn every
    `interval` seconds by a timer thread, so that one long step still shows time passing.

    Call it with each new message (`on_progress`). Nothing is drawn when disabled, when stderr is not a
    terminal, or on a torchrun rank other than local rank 0.
    """

    def __init__(self, message: str, enabled: bool = True, interval: float = 1.0):
        self.message = message
        self.enabled = enabled and sys.stderr.isatty() and live_allowed()
        self.interval = interval
        self.started = self.since = time.monotonic()
        self._status = None
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()

    def __enter__(self):
        if self.enabled:
            self._status = self._make_status()
            self._status.start()
            self._thread = threading.Thread(target=self._tick, name="dmap-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._status is not None:
            self._status.stop()
            self._status = None
        return False

    def _make_status(self):
        from rich.text import Text  # lazy: rich only when drawing

        return console(stderr=True).status(Text(plain(self.message)), spinner="dots")

    def __call__(self, message: str) -> None:
        with self._lock:
            self.message, self.since = message, time.monotonic()
        self._draw()

    def text(self) -> str:
        now = time.monotonic()
        with self._lock:
            message, since = self.message, self.since
        return f"{message}… {duration(now - since)} (all: {duration(now - self.started)})"

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        status = self._status
        if status is not None:
            from rich.text import Text  # lazy: rich only when drawing

            status.update(Text(plain(self.text())))


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 0.05 else "under 0.1 s"


def stage_summary(stages: dict[str, dict]) -> str:
    """The closing line about loads: 'encode (text_encoder) loaded twice (3.1 s), ran 0.4 s; ...'.
    Stages that neither loaded nor ran are left out; None when none is left."""
    parts = []
    for name, totals in stages.items():
        components = totals.get("components") or []
        label = "all components" if name == "load" else (f"{name} ({', '.join(components)})" if components else name)
        bits = []
        if totals.get("loads"):
            bits.append(f"loaded {_times(totals['loads'])} ({_seconds(totals.get('load_s', 0.0))})")
        if totals.get("run_s", 0.0) >= 0.05:
            bits.append(f"ran {_seconds(totals['run_s'])}")
        if bits:
            parts.append(f"{label} {', '.join(bits)}")
    return "; ".join(parts) if parts else None


class QueueView(RunView):
    """The plan and denoise progress as for one prompt; then one line per image and a closing summary.

    Under torchrun every rank prints its own lines, prefixed with its rank; only rank 0 shows the plan,
    and under torchrun no rank draws a live spinner or bar (each prints its status lines, prefixed).
    """

    def __init__(self, quiet: bool = False, binary: bool = False, plan_file: str | None = None):
        super().__init__(quiet=quiet, binary=binary, plan_file=plan_file)
        ranks = Ranks.from_env()
        self.prefix = f"[rank {ranks.rank}/{ranks.world_size}] " if ranks.distributed else ""
        self.show_plans = ranks.is_main
        self.live = live_allowed()
        self.todo = 0  # items this run generates (this rank's share minus the complete ones)
        self.done = 0
        self.started: float | None = None
        self.resume = True

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self.interrupted()
        return False

    def interrupted(self) -> None:
        """Ctrl-C: what was kept and how to go on (printed even with --quiet, on stderr)."""
        kept = f"{self.done} of {self.todo} item(s) written this run are kept" if self.started is not None else \
            "nothing was written yet"
        if self.resume:
            how = "run the same command again to resume: it skips every complete image and generates the rest"
        else:
            how = "run the command again without --no-resume (or --overwrite) to resume from the complete images"
        self.err.print(f"{self.prefix}Queue interrupted: {kept}; {how}.", soft_wrap=True)

    def status(self, message: str | None) -> None:
        if self.live:
            super().status(message)
        elif message and not self.quiet:  # another rank of this node draws; this one prints plain lines
            self.err.print(f"{self.prefix}{message}", soft_wrap=True)

    def step(self, done: int, total: int, component: str | None = None) -> None:
        if self.live:
            super().step(done, total, component)

    def show_plan(self, plan) -> None:
        if self.show_plans:
            super().show_plan(plan)

    def _say(self, text: str, style: str | None = None) -> None:
        if not self.quiet:
            self.console.print(f"{self.prefix}{text}", soft_wrap=True, style=style)

    def start(self, result) -> None:
        self.todo, self.done, self.started = result.mine - len(result.skipped), 0, time.monotonic()
        self.resume = getattr(result, "resume", True)
        for notice in result.notices if self.show_plans else ():  # the same on every rank: said once, by rank 0
            self._say(notice, style="bold yellow")  # the console takes no markup: text from files stays text
        share = f"{result.mine} of {result.items} items" if result.world_size > 1 else f"{result.items} items"
        self._say(f"Queue: {share}, {result.mode} plan {result.plan_digest}, writing to {result.output_dir}")
        if result.skipped:
            self._say(f"Skipping {len(result.skipped)} item(s) whose PNG is complete and made for them "
                      f"(--no-resume to redo them): {_ranges(result.skipped)}")
        for index, why in sorted(result.redone.items()):
            self._say(f"Item {index}: the existing file is {why}: generating it again")
        todo = result.mine - len(result.skipped)
        if todo and result.mode != Mode.RESIDENT:
            size = lambda n: format_size(n, binary=self.binary)  # noqa: E731
            how = ("--chunk-size" if result.chunk_size_given else
                   f"{size(result.bytes_per_item)} of embeddings and latents per item, budget {size(result.chunk_budget)}; "
                   "--chunk-size or --chunk-memory to change")
            self._say(f"Chunk size: {min(result.chunk_size, todo)} item(s) ({how}): each stage loads once per chunk")

    def chunk(self, number: int, total: int) -> None:
        if total > 1:
            self._say(f"Chunk {number + 1} of {total}")

    def item(self, item, path: str, seconds: float) -> None:
        self.done += 1
        left = max(0, self.todo - self.done)
        if left and self.started is not None:  # images come out per chunk: the rate so far, loads included
            elapsed = time.monotonic() - self.started
            eta = f"ETA {duration(elapsed / self.done * left)} for the {left} left"
        else:
            eta = "the last one"
        self._say(f"Wrote {path} (item {item.index}, seed {item.seed}, {seconds:.2f} s): "
                  f"item {self.done} of {max(self.todo, self.done)}, {eta}")

    def summary(self, result) -> None:
        self._say(f"Generated {len(result.generated)}, skipped {len(result.skipped)} in {result.seconds:.1f} s")
        cache = step_cache_summary(result.step_cache)
        if cache:
            self._say(cache)
        loads = stage_summary(result.stages)
        if loads:
            per = "once per chunk" if result.mode != Mode.RESIDENT else "once for the whole queue"
            self._say(f"Each stage loads its components {per}: {loads}")
        if result.manifest:
            self._say(f"Wrote {result.manifest}")


def _ranges(indices: list[int]) -> str:
    """0,1,2,5 -> '0-2, 5'."""
    out, start, prev = [], None, None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)

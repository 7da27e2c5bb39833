"""Rich output of `dmap run --prompts`: the plan (rank 0), what is skipped and why, the chunk size, each image."""

from __future__ import annotations

from ..units import format_size
from .run import RunView


class QueueView(RunView):
    """The plan and denoise progress as for one prompt; then one line per image and a closing summary.

    Under torchrun every rank prints its own lines, prefixed with its rank; only rank 0 shows the plan.
    """

    def __init__(self, quiet: bool = False, binary: bool = False):
        super().__init__(quiet=quiet, binary=binary)
        from ..distributed import Ranks

        ranks = Ranks.from_env()
        self.prefix = f"[rank {ranks.rank}/{ranks.world_size}] " if ranks.distributed else ""
        self.show_plans = ranks.is_main

    def show_plan(self, plan) -> None:
        if self.show_plans:
            super().show_plan(plan)

    def _say(self, text: str, style: str | None = None) -> None:
        if not self.quiet:
            self.console.print(f"{self.prefix}{text}", soft_wrap=True, style=style)

    def start(self, result) -> None:
        for notice in result.notices:
            self._say(notice, style="bold yellow")  # the console takes no markup: text from files stays text
        share = f"{result.mine} of {result.items} items" if result.world_size > 1 else f"{result.items} items"
        self._say(f"Queue: {share}, {result.mode} plan {result.plan_digest}, writing to {result.output_dir}")
        if result.skipped:
            self._say(f"Skipping {len(result.skipped)} item(s) whose PNG is complete and made for them "
                      f"(--no-resume to redo them): {_ranges(result.skipped)}")
        for index, why in sorted(result.redone.items()):
            self._say(f"Item {index}: the existing file is {why}: generating it again")
        todo = result.mine - len(result.skipped)
        if todo and result.mode != "resident":
            size = lambda n: format_size(n, binary=self.binary)  # noqa: E731
            how = ("--chunk-size" if result.chunk_size_given else
                   f"{size(result.bytes_per_item)} of embeddings and latents per item, budget {size(result.chunk_budget)}; "
                   "--chunk-size or --chunk-memory to change")
            self._say(f"Chunk size: {min(result.chunk_size, todo)} item(s) ({how}): each stage loads once per chunk")

    def chunk(self, number: int, total: int) -> None:
        if total > 1:
            self._say(f"Chunk {number + 1} of {total}")

    def item(self, item, path: str, seconds: float) -> None:
        self._say(f"Wrote {path} (item {item.index}, seed {item.seed}, {seconds:.2f} s)")

    def summary(self, result) -> None:
        self._say(f"Generated {len(result.generated)}, skipped {len(result.skipped)} in {result.seconds:.1f} s")
        used = [(name, t) for name, t in result.stages.items() if t["loads"] or t["run_s"]]
        if used:
            self._say("Stages: " + "; ".join(f"{name} loaded {t['loads']}x in {t['load_s']:.1f} s, ran {t['run_s']:.1f} s"
                                            for name, t in used))
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

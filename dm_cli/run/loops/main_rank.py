"""The loop of ranks that share each job (`--parallel cfg` / `context`: dm_cli.run.ranks.parallel; `--parallel pipeline`:
dm_cli.run.ranks.pipeline): rank 0 encodes and every rank gets what the encoding stages make; rank 0 alone decodes (it
writes the outputs); on a machine without GPUs each rank's CPU stands for its GPU of the plan (`on_this_rank`). Those
loops give their stage loop these runners (`StageLoop.stage_runners`), or their own made from them."""

from __future__ import annotations

import functools

from dm_cli.devices import device_key, is_gpu
from dm_cli.families import Job
from dm_cli.families.stages import DECODE, DECODE_AUDIO, ENCODE, ENCODE_IMAGE
from dm_cli.run.distributed import broadcast
from dm_cli.run.loops.carry import Carry
from dm_cli.run.loops.stage_kinds import StageRunners


def on_this_rank(planned: dict, cuda: bool, simulate: bool) -> dict:
    """Where a component loads on a rank sharing a job: as planned, except that without GPUs (and without --simulate,
    whose split check reads the planned devices) each rank's CPU stands for the plan's GPUs (`run/settle/layout.py`'s `cpu_ranks`)."""
    if cuda or simulate:
        return planned
    return {key: "cpu" if is_gpu(device_key(dev)) else dev for key, dev in planned.items()}


class MainRankRunners(StageRunners):
    """The stage runners of ranks that share each job (the loop has a `sharing` that says whether this is rank 0):
    rank 0 encodes and every rank gets what the encoding stages make; rank 0 alone decodes."""

    def runner(self, stage_plan):
        own = super().runner(stage_plan)
        if stage_plan.kind in (ENCODE, ENCODE_IMAGE):
            return functools.partial(self._run_once_and_share, own)
        if stage_plan.kind in (DECODE, DECODE_AUDIO):
            return functools.partial(self._run_on_main, own)
        return own

    def _run_once_and_share(self, own, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Encode on rank 0; every rank gets what the stage produces (embeddings, image latents)."""
        if self.loop.sharing.is_main:
            own(stage_plan, job, carry, on_step)
        made = broadcast({value: getattr(carry, value) for value in stage_plan.produces}, self.loop.sharing)
        for value, data in made.items():
            setattr(carry, value, data)

    def _run_on_main(self, own, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Decode on rank 0 only; the other ranks keep the latents and make no images."""
        if self.loop.sharing.is_main:
            own(stage_plan, job, carry, on_step)


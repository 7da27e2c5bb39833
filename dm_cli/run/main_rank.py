"""The loop of ranks that share each job (`--parallel cfg` / `context`: dm_cli.run.parallel; `--parallel pipeline`:
dm_cli.run.pipeline): rank 0 encodes and every rank gets what the encoding stages make; rank 0 alone decodes (it
writes the outputs); on a machine without GPUs each rank's CPU stands for its GPU of the plan. A mixin placed before
the stage loop (dm_cli.run.stages) in those loops' bases."""

from __future__ import annotations

from dm_cli.devices import device_key, is_gpu
from dm_cli.families import Job
from dm_cli.families.stages import DECODE, DECODE_AUDIO, ENCODE, ENCODE_IMAGE
from dm_cli.run.carry import Carry
from dm_cli.run.distributed import broadcast


class MainRankStages:
    """For the loops of ranks that share each job (before StageLoop in the bases, with a `sharing` that says whether
    this is rank 0): rank 0 encodes and every rank gets what the encoding stages make; rank 0 alone decodes."""

    def device_map(self, name: str) -> dict:
        """Where `name` loads on this rank: as planned, except that without GPUs (and without --simulate, whose split
        check reads the planned devices) each rank's CPU stands for the plan's GPUs (`run.parallel.cpu_ranks`)."""
        planned = super().device_map(name)
        if self.cuda or self.simulate:
            return planned
        return {key: "cpu" if is_gpu(device_key(dev)) else dev for key, dev in planned.items()}

    def _runner(self, stage_plan):
        if stage_plan.kind in (ENCODE, ENCODE_IMAGE):
            return MainRankStages._run_once_and_share
        if stage_plan.kind in (DECODE, DECODE_AUDIO):
            return MainRankStages._run_on_main
        return super()._runner(stage_plan)

    def _run_once_and_share(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Encode on rank 0; every rank gets what the stage produces (embeddings, image latents)."""
        if self.sharing.is_main:
            super()._runner(stage_plan)(self, stage_plan, job, carry, on_step)
        made = broadcast({value: getattr(carry, value) for value in stage_plan.produces}, self.sharing)
        for value, data in made.items():
            setattr(carry, value, data)

    def _run_on_main(self, stage_plan, job: Job, carry: Carry, on_step) -> None:
        """Decode on rank 0 only; the other ranks keep the latents and make no images."""
        if self.sharing.is_main:
            super()._runner(stage_plan)(self, stage_plan, job, carry, on_step)

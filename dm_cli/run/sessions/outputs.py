"""The metadata of what a run writes: every image, video and latents file carries it (the writers are
dm_cli.io.outputs), and a queue's resume compares it (dm_cli.io.outputs.is_complete); and the claims a run
holds on its outputs while it runs (dm_cli.io.claims).
"""

from __future__ import annotations

import os
from pathlib import Path

from dm_cli.families import Job
from dm_cli.io.claims import Claims, claim_folder, claim_outputs
from dm_cli.run.distributed import Ranks
from dm_cli.version import __version__


def claim_run_outputs(request) -> Claims:
    """`dmap run --prompt`'s claims on its --output and --save-latents, taken before anything loads; a second run
    writing either stops (exit 2) naming this one. Under torchrun, rank 0 writes and claims: the ranks of one run
    never refuse each other."""
    if not Ranks.from_env().is_main:
        return Claims()
    return claim_outputs([path for path in (request.output, request.save_latents) if path], "dmap run")


def claim_queue_folder(folder: str | os.PathLike, is_main: bool) -> Claims:
    """A queue's claim on its whole output folder (its items and its manifest), by rank 0 of its ranks."""
    return claim_folder(Path(folder), "dmap run --prompts") if is_main else Claims()


def job_metadata(job: Job, source_spec: str, pipeline_class: str, digest: str, demo: bool,
                 fps: float | None = None, tiled_decode=(), loras=(), fused_loras=(), step_cache=None) -> dict[str, str]:
    """The PNG text metadata of one generated job (what a queue's resume compares, see dm_cli.run.sessions.queue).

    `tiled_decode`: components the plan decodes in tiles (written only when there are some, so the
    metadata of untiled images stays as it was): tiles change pixels at their seams. `loras` (dm_cli.inputs.LoraAdapter,
    settled): "lora" is what the resume key compares (component, sha256, scale), "lora_files" names the files;
    `fused_loras`: the components whose LoRAs were fused into the weights ("lora_fused", compared too: the
    pixels differ from unfused ones in the last bits). `step_cache` (dm_cli.inputs.StepCache): "step_cache", the cache
    and its settings (written only with one; compared by the resume)."""
    meta = {
        "prompt": job.prompt, "seed": str(job.seed), "steps": str(job.steps), "guidance_scale": str(job.guidance_scale),
        "source": source_spec, "pipeline": pipeline_class, "height": str(job.height), "width": str(job.width),
        "plan_digest": digest, "dmap_version": __version__,
    }
    if job.num_frames:
        meta.update(num_frames=str(job.num_frames), fps=str(fps))
    if job.negative_prompt is not None:
        meta["negative_prompt"] = job.negative_prompt
    for name, value in job.settings:  # the family's own (Family.settings), given or by default
        if value is not None:
            meta[name] = str(value)
    if job.images:  # what the run read: a changed input image is another job (the resume key has it)
        meta["input_images"] = ",".join(image.label for image in job.images)
    if job.last_image is not None:  # a first-last-frame video's last frame: part of the resume key too
        meta["last_image"] = f"{job.last_image.width}x{job.last_image.height}:{job.last_image.digest}"
    if tiled_decode:
        meta["tiled_decode"] = ",".join(sorted(tiled_decode))
    if loras:
        meta["lora"] = ",".join(lora.key() for lora in loras)
        meta["lora_files"] = ",".join(lora.name for lora in loras)
        if fused_loras:
            meta["lora_fused"] = ",".join(sorted(fused_loras))
    if step_cache is not None:
        meta["step_cache"] = step_cache.label
    if demo:
        meta["weights"] = "random (dmap demo pipeline)"
    return meta


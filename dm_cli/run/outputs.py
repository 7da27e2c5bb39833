"""What a run writes: images (dm_cli.io.images), videos with their sidecar, latents, and the metadata of each.

The metadata is also what a queue's resume compares (dm_cli.run.queue).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from dm_cli.errors import UsageError
from dm_cli.families import Job
from dm_cli.io.atomic import atomic_write
from dm_cli.version import __version__


def job_metadata(job: Job, source_spec: str, pipeline_class: str, digest: str, demo: bool,
                 fps: float | None = None, tiled_decode=()) -> dict[str, str]:
    """The PNG text metadata of one generated job (what a queue's resume compares, see dm_cli.run.queue).

    `tiled_decode`: components the plan decodes in tiles (written only when there are some, so the
    metadata of untiled images stays as it was): tiles change pixels at their seams."""
    meta = {
        "prompt": job.prompt, "seed": str(job.seed), "steps": str(job.steps), "guidance_scale": str(job.guidance_scale),
        "source": source_spec, "pipeline": pipeline_class, "height": str(job.height), "width": str(job.width),
        "plan_digest": digest, "dmap_version": __version__,
    }
    if job.num_frames:
        meta.update(num_frames=str(job.num_frames), fps=str(fps))
    if job.negative_prompt is not None:
        meta["negative_prompt"] = job.negative_prompt
    if job.true_cfg_scale is not None:
        meta["true_cfg_scale"] = str(job.true_cfg_scale)
    if job.guidance_scale_2 is not None:
        meta["guidance_scale_2"] = str(job.guidance_scale_2)
    if tiled_decode:
        meta["tiled_decode"] = ",".join(sorted(tiled_decode))
    if demo:
        meta["weights"] = "random (dmap demo pipeline)"
    return meta


def save_videos(videos: list, output: str, fps: int, metadata: dict[str, str], overwrite: bool = False) -> list[str]:
    """Each video (uint8 frames) to `output` (out-1.mp4, ... when several), with its JSON sidecar."""
    from dm_cli.io.video import save_video

    written = []
    path = Path(output.rstrip("/"))
    for index, frames in enumerate(videos):
        target = output if len(videos) == 1 else str(path.with_name(f"{path.stem}-{index}{path.suffix}"))
        written += save_video(frames, target, fps, metadata, overwrite)
    return written


def save_latents(latents, output: str, metadata: dict[str, str]) -> str:
    from safetensors.torch import save_file

    path = Path(output)
    _atomic_write(path, lambda tmp: save_file({"latents": latents.contiguous()}, tmp, metadata=metadata))
    return str(path)


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    if path.parent and not path.parent.exists():
        raise UsageError(f"Cannot write {path}: folder {path.parent} does not exist.")
    atomic_write(path, write)

"""What a stage loop hands from stage to stage (`Carry`) and measures of each stage (`StageResult`): the data every
run mode's loop shares (dm_cli.run.loops.stages and the loop files beside it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass

from dm_cli.families import Embeds
from dm_cli.families.stages import IMAGE_LATENTS, INPUTS
from dm_cli.io.video import with_audio


@dataclass
class StageResult:
    name: str
    components: list[str]
    load_s: float = 0.0
    run_s: float = 0.0
    wall_s: float = 0.0
    resident_before: dict[str, int] = field(default_factory=dict)  # tracked weight bytes per device before loading
    resident_after_load: dict[str, int] = field(default_factory=dict)
    measured_peak: dict[str, int] = field(default_factory=dict)
    planned_peak: dict[str, int] = field(default_factory=dict)
    load_rss_delta: int = 0  # peak host RSS during this stage's load minus RSS before it
    tracked: str = "all"  # which part of the run the activation tracker saw ("first of N steps" in denoise)
    largest_shard: int = 0  # largest safetensors file this stage read
    compile_s: float = 0.0  # --compile: of run_s, the seconds torch.compile spent compiling (the cold start)


@dataclass
class Carry:
    """What one job hands from stage to stage: one field per value a stage produces (dm_cli.families.stages)."""

    embeds: Embeds | None = None
    image_latents: object = None
    latents: object = None
    images: list = field(default_factory=list)
    audio_latents: object = None  # LTX-2: the denoised audio latents
    audio: object = None  # (one waveform per video, sample rate): joined to `images` once both are there

    def has(self, value: str) -> bool:
        """Whether `value` is there for a stage that consumes it (the job's inputs always are)."""
        if value in INPUTS:
            return True
        got = getattr(self, value, None)
        return got is not None and not (isinstance(got, list) and not got)


def join_audio(carry: Carry) -> None:
    """Each video's frames carry its waveform once both are decoded (dm_cli.io.video.with_audio): the writers put
    it in the MP4, or as a WAV beside a frames folder."""
    if carry.audio is not None and carry.images:
        waves, rate = carry.audio
        carry.images = [with_audio(frames, wave, rate) for frames, wave in zip(carry.images, waves)]
        carry.audio = None


def consumed_image(stage_plan, carry: Carry):
    """The encoded input image when the stage consumes it, else None."""
    return carry.image_latents if IMAGE_LATENTS in stage_plan.consumes else None


# the `version` of `dmap run --json` and of the queue's `--json` (docs/CONTRACTS.md); 2: the queue's `stages` became a
# list of objects with a "name", as run's always were (version 1, unnumbered: an object keyed by the stage's name)
RESULT_JSON_VERSION = 2


def stages_json(stages) -> list[dict]:
    """The `stages` of every result JSON (one prompt's and a queue's): one object per stage, its "name" first, so a
    reader parses both the same way and a new field is a new key, never a new shape."""
    out = []
    for stage in stages:
        fields = asdict(stage) if is_dataclass(stage) else dict(stage)
        out.append({"name": fields.pop("name"), **fields})
    return out


def stage_result(stage_plan) -> StageResult:
    return StageResult(stage_plan.name, list(stage_plan.components),
                       planned_peak={str(k): int(v) for k, v in stage_plan.peak_bytes.items()})

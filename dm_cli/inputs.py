"""What the user asks a pipeline for (resolution, frames, batch, CFG, sequence length), as plain data.

Shared by the tracer (activation estimates), the planner and the runner. No torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import UsageError


@dataclass(frozen=True)
class InputSpec:
    """The inputs a plan is made for. height == width == 0 means weights only (no activations).

    height/width None (only between the command line and `plan.make_plan`): the pipeline's default size.
    """

    height: int | None = 1024
    width: int | None = 1024
    batch_size: int = 1
    num_images: int = 1  # images per prompt: the models see batch_size * num_images
    guidance_scale: float | None = None  # None: the pipeline's default
    max_sequence_length: int | None = None  # None: the pipeline's default (T5 tokens)
    num_frames: int | None = None  # video pipelines: frames to generate (None: the pipeline's default; images: unused)
    fps: int | None = None  # video pipelines: frames per second of the written video (no effect on memory)

    def __post_init__(self) -> None:
        """Refuse what no pipeline can take (and what would write invalid JSON, such as NaN)."""
        for name, low in (("height", 0), ("width", 0), ("batch_size", 1), ("num_images", 1)):
            value = getattr(self, name)
            if value is None and name in ("height", "width"):
                continue  # the pipeline's default size, settled by the planner
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be a whole number >= {low}, not {value!r}.")
        if self.guidance_scale is not None and (isinstance(self.guidance_scale, bool) or not isinstance(
                self.guidance_scale, (int, float)) or not math.isfinite(self.guidance_scale)):
            raise UsageError(f"--guidance-scale must be a finite number, not {self.guidance_scale!r}.")
        value = self.max_sequence_length  # None: the pipeline's default (frames and fps: the family checks them)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--max-sequence-length must be a whole number >= 1, not {value!r}.")

    @property
    def weights_only(self) -> bool:
        return self.height == 0 or self.width == 0

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.num_images

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "InputSpec":
        fields = {k: data[k] for k in ("height", "width", "batch_size", "num_images", "guidance_scale",
                                        "max_sequence_length", "num_frames", "fps") if k in data}
        return cls(**fields)

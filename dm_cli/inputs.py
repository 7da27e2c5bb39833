"""What the user asks a pipeline for (resolution, batch, CFG, sequence length), as plain data.

Shared by the tracer (activation estimates), the planner and the runner. No torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import UsageError


@dataclass(frozen=True)
class InputSpec:
    """The inputs a plan is made for. height == width == 0 means weights only (no activations)."""

    height: int = 1024
    width: int = 1024
    batch_size: int = 1
    num_images: int = 1  # images per prompt: the models see batch_size * num_images
    guidance_scale: float | None = None  # None: the pipeline's default
    max_sequence_length: int | None = None  # None: the pipeline's default (T5 tokens)

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
        if self.max_sequence_length is not None and (isinstance(self.max_sequence_length, bool) or not isinstance(
                self.max_sequence_length, int) or self.max_sequence_length < 1):
            raise UsageError(f"--max-sequence-length must be a whole number >= 1, not {self.max_sequence_length!r}.")

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
                                        "max_sequence_length") if k in data}
        return cls(**fields)

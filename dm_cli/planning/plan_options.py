"""What `make_plan` is asked (PlanOptions), and the placement search run with those options."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from dm_cli.inputs import Generation, InputImage, InputSpec, PlacementSpec, StepCache
from dm_cli.planning.parallel.parallel import ParallelRequest
from dm_cli.planning.placement.placement import NoFit, Placement
from dm_cli.planning.placement.search import plan_pipeline
from dm_cli.planning.time.plan_prediction import PredictionRequest


@dataclass
class PlanOptions:
    """What `make_plan` is asked: where (the placement), for what (the generation), and how to work.

    The generation is held once, as the one `Generation` that `dmap run` settles: `inputs`, `settings`,
    `negative_prompt`, `loras` and `cache` are read from it, so no setting can be restated here and drift."""

    placement: PlacementSpec = field(default_factory=PlacementSpec)  # devices, strategy, mode, overhead, dtype, weights
    # what is generated: size, frames, guidance, the family's settings, the negative prompt, input image sizes, --cache
    # (settled by make_plan as `dmap run` settles it); the default plans InputSpec's default, 1024x1024
    generation: Generation = field(default_factory=lambda: Generation(height=1024, width=1024))
    component: str | None = None  # plan one component only
    check: bool = True
    use_cache: bool = True
    on_progress: Callable[[str], None] | None = None  # hears each step (resolving, sizing, each trace, the check)
    parallel: ParallelRequest = field(default_factory=ParallelRequest)  # --world-size, --parallel (planning/parallel/parallel.py)
    pipeline: str | None = None  # --pipeline: SOURCE is a single file, the rest of the pipeline comes from here
    # --component-file: (component, file) pairs, these components from these single files
    component_files: tuple[tuple[str, str], ...] = ()
    # the LoRAs stay unfused, switchable per image: `dmap serve`'s requests (and a queue's items) choose among them
    switch_loras: bool = False
    prediction: PredictionRequest = field(default_factory=PredictionRequest)  # --profile, --steps, --queue
    # the plan's devices include a GPU: activations as its kernels hold them (gpu_kernels.py); set by make_plan
    on_gpu: bool = False

    def __post_init__(self) -> None:
        """InputSpec's checks (the pixel bound) when the options are made, before any source is resolved."""
        self.generation.inputs()

    @classmethod
    def of(cls, generation: Generation, placement: PlacementSpec, **rest) -> "PlanOptions":
        """Options for one generation (`dmap plan`, the API, `dmap run`'s inline plan), its input images as sizes
        (`sizes_only`)."""
        return cls(placement, sizes_only(generation), **rest)

    @property
    def inputs(self) -> InputSpec:
        """What the tracer and the planner read of the generation (sizes, frames, batch, guidance)."""
        return self.generation.inputs()

    @property
    def settings(self) -> dict:
        """The family's own settings (Family.settings): checked as dmap run checks them."""
        return dict(self.generation.settings)

    @property
    def negative_prompt(self) -> str | None:
        """Checked as dmap run checks it (FLUX refuses one); true CFG is planned anyway."""
        return self.generation.negative_prompt

    @property
    def loras(self) -> tuple:
        """LoRA adapters (dm_cli.inputs.LoraAdapter, --lora): their bytes beside the layers they patch."""
        return self.generation.loras

    @property
    def cache(self) -> StepCache | None:
        """--cache: a step cache on the denoiser, its state counted (planning/step_cache.py)."""
        return self.generation.cache


def sizes_only(generation: Generation) -> Generation:
    """`generation` with its input images as a plan knows them: sizes and keyframes, without a file, digest or
    pixels. A plan depends on sizes only; a run's files would make `Family.validate` check what only a run reads
    (LTX-2's PyAV for the files it re-compresses) and keep an in-memory image alive in the options. The same
    object when no image carries more."""
    def bare(image: InputImage | None) -> InputImage | None:
        if image is None or all(value is None for value in (image.path, image.digest, image.pixels, image.encoded)):
            return image
        return replace(image, path=None, digest=None, pixels=None, encoded=None)

    images, last = tuple(bare(image) for image in generation.images), bare(generation.last_image)
    if all(a is b for a, b in zip(images, generation.images)) and last is generation.last_image:
        return generation
    return replace(generation, images=images, last_image=last)


def place_or_none(specs, stages, devices, options: PlanOptions) -> Placement | None:
    """plan_pipeline, None where nothing fits: the tiling choice and the suggestions try many variants."""
    try:
        return plan_pipeline(specs, stages, devices, options.placement.strategy, options.placement.mode)
    except NoFit:
        return None
